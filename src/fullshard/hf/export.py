"""Write a plain Hugging Face directory (safetensors + index + config) from a sharded model or checkpoint.

The files hold what transformers' `save_pretrained` writes: the Hub's names and layout, following
the export recipe (`fullshard.hf.recipe`: `export_recipe`, `fullshard.lora.merge_recipe` for LoRA
merged), which says for each Hub tensor the state tensor it is, the region of it (one expert of a
fused MoE tensor), or the concatenation of several (Qianfan-OCR's vision `qkv`). The same recipe
drives the offline export and the weight stream (`fullshard.hf.stream`), so all three give the
same tensors.

No rank ever holds the whole model. Live, every file is created at its final size first (a
safetensors header follows from names, shapes and dtypes alone), then every rank writes its own
rows of each row-sharded (FSDP, EP) tensor straight into every Hub tensor they overlap (into its
place among the parts of a fused one), cast to the written dtype: no gather, and each rank writes
1/N of the bytes. Tensors in other layouts (TP, merged LoRA weights) are gathered one state tensor
at a time and written by the rank they are dealt to. Offline, one process streams the DCP
checkpoint tensor by tensor, with no process group.

The recipe's names are importable from here too, where they lived before `fullshard.hf.recipe`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..checkpoint import layout
from ..distributed import all_ranks_agree_ok, broadcast_from_rank0, get_rank, get_world_size, run_agreed
from ..dtypes import SAFETENSORS_NAMES, dtype_name, resolve_dtype
from ..errors import CheckpointError
from ..fsdp import model_class_name, reshard_all
from ..loading.convert import HubView
from ..tensors import holds_part, replicated
from .recipe import (  # the recipe's names, also importable from here as before
    SOURCE_DTYPE,
    ExportRecipe,
    alias_names,
    export_recipe,
    hub_recipe,
    kept_in_fp32,
    merge_lora,
    recipe_parts,
    recipe_view,
    remember_source_dtype,
    source_dtype,
    written_dtype,
)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a Hugging Face size string ("5GB" = 5e9, "500MiB" = 500 * 2**20)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.I)
        if not match:
            raise CheckpointError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or an int of bytes")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return value


def config_json(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return config.to_json_string(use_diff=True) if hasattr(config, "to_json_string") else None


def generation_config_json(model: torch.nn.Module) -> str | None:
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    return generation.to_json_string(use_diff=True) if generation is not None and can_generate else None


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype written

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def plan_files(entries: list[Entry], max_bytes: int) -> list[tuple[str, list[Entry]]]:
    """Group tensors in order into files of at most `max_bytes` (a bigger tensor gets its own file)."""
    groups: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not groups or (groups[-1] and size + entry.nbytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) <= 1:
        return [(WEIGHTS_NAME, groups[0] if groups else [])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", group) for i, group in enumerate(groups)]


def export_config(raw: str, class_name: str, dtype: torch.dtype) -> str:
    config = json.loads(raw)
    config["architectures"] = [class_name]
    config["dtype"] = dtype_name(dtype)
    config.pop("torch_dtype", None)
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def staging_dir(output_dir: Path) -> Path:
    """A sibling of `output_dir` to write into and rename into place, so a failed write leaves no half directory."""
    return output_dir.parent / f".{output_dir.name}{layout.TMP_PREFIX}{uuid.uuid4().hex[:8]}"


def safetensors_header(entries: list[Entry]) -> tuple[bytes, list[int]]:
    """A safetensors file's leading bytes (length + JSON header) and where each entry's bytes start
    in the file: all known from names, shapes and dtypes, before any tensor is at hand."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        if entry.dtype not in SAFETENSORS_NAMES:
            raise CheckpointError(f"tensor {entry.name!r} has dtype {entry.dtype}, which safetensors cannot store")
        header[entry.name] = {"dtype": SAFETENSORS_NAMES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    lead = struct.pack("<Q", len(raw)) + raw
    return lead, [len(lead) + header[entry.name]["data_offsets"][0] for entry in entries]


class SafetensorsStream:
    """Writes one safetensors file a tensor at a time.

    The header (names, dtypes, shapes, offsets) follows from the plan alone, so it goes first and
    each tensor's bytes are appended as the tensor arrives: the writer never holds more than the
    tensor in hand, whatever `max_shard_size` is.
    """

    def __init__(self, path: Path, entries: list[Entry]):
        self.path = path
        self.pending = [(entry.name, entry.nbytes) for entry in entries]
        self.handle = open(path, "wb")
        self.handle.write(safetensors_header(entries)[0])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, nbytes = self.pending.pop(0)
        if name != expected or tensor.numel() * tensor.element_size() != nbytes:
            raise CheckpointError(
                f"{self.path}: got {name!r} ({tuple(tensor.shape)}) where {expected!r} of {nbytes} bytes belongs"
            )
        self.handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self.pending:
            raise CheckpointError(
                f"{self.path}: {len(self.pending)} tensors never arrived, first {self.pending[0][0]!r}"
            )
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


def finish_directory(staging: Path, output_dir: Path, files: list[tuple[str, list[Entry]]], config: str | None,
                     generation_config: str | None, tokenizer) -> None:
    """Index, configs and tokenizer into `staging`, then move every file into `output_dir`.

    Weight files of an earlier export that the new one does not have are removed, so the
    directory never mixes two exports' shards.
    """
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for _, group in files for e in group)},
                 "weight_map": {e.name: fname for fname, group in files for e in group}}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        (staging / layout.CONFIG).write_text(config)
    if generation_config is not None:
        (staging / layout.GENERATION_CONFIG).write_text(generation_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(staging))
    output_dir.mkdir(parents=True, exist_ok=True)
    new_items = list(staging.iterdir())
    for item in new_items:
        if (output_dir / item.name).is_dir() and not item.is_dir():
            raise CheckpointError(f"cannot write {output_dir / item.name}: a directory of that name exists")
    # what the new export replaces is renamed aside, not overwritten: freeing a big file's blocks
    # (here 40 ms per 100 MB, on a disk mounted with online discard) then happens in the background
    replaced = staging / ".replaced"
    replaced.mkdir()
    new_names = {item.name for item in new_items}
    for old in output_dir.iterdir():
        weights = old.name == INDEX_NAME or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", old.name)
        if old.name in new_names or weights:
            os.rename(old, replaced / old.name)
    for item in new_items:
        os.rename(item, output_dir / item.name)
    layout.discard(staging, background=True)


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor, whole, on every rank (a collective for DTensors): the unit export works in."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:  # CPU-offloaded shards of an accelerator mesh
        tensor = tensor.to(mesh_device)
    return replicated(tensor).detach()


def merged_full(state: dict, key: str, merge: dict | None) -> torch.Tensor:
    """The whole state tensor `key`, with a recipe's LoRA terms merged in (a collective per tensor
    read): what the export writes where its rows cannot be written in place."""
    if merge is None:
        return gather_full(state[key])
    terms = [(None if a is None else gather_full(state[a]), gather_full(state[b]), s) for a, b, s in merge["terms"]]
    return merge_lora(gather_full(state[key]), terms, merge["fan_in_fan_out"])


@dataclass(frozen=True)
class Slot:
    """Where a part of a fused Hub tensor lands in it: from `start` along `dim` of the fused
    `shape`."""

    dim: int
    start: int
    shape: tuple[int, ...]


def slot_runs(slot: Slot | None, part_shape: tuple[int, ...], lo: int,
              hi: int) -> list[tuple[int, int, int]]:
    """The elements [lo, hi) of a part (in its contiguous layout) as runs of the Hub tensor it is
    written into: (element offset in the Hub tensor, lo, hi) each; a single run where the part is
    the whole Hub tensor (`slot` None) or fused along the first dim (Qianfan-OCR's `qkv`)."""
    if slot is None:
        return [(lo, lo, hi)]
    inner = 1
    for size in part_shape[slot.dim + 1:]:
        inner *= size
    block, fused_block = part_shape[slot.dim] * inner, slot.shape[slot.dim] * inner
    runs = []
    while lo < hi:
        outer, within = divmod(lo, block)
        end = min(hi, (outer + 1) * block)
        runs.append((outer * fused_block + slot.start * inner + within, lo, end))
        lo = end
    return runs


@dataclass
class Unit:
    """The Hub tensors one state tensor gives (itself, renamed, its regions: one per expert of a
    fused tensor, or its part of a Hub tensor fused from several, at `Slot`), gathered or written
    together; `merge` the LoRA terms merged into it first."""

    key: str
    outputs: list[tuple[Entry, HubView, Slot | None]]
    merge: dict | None


def export_units(recipe: ExportRecipe, entries: list[Entry], shapes: dict) -> list[Unit]:
    """The entries' parts grouped by the state tensor they come from (`shapes`: state key -> shape),
    in the order of their first entry."""
    units: dict[str, Unit] = {}
    for entry in entries:
        spec, start = recipe.fused.get(entry.name), 0
        for part_name, view in recipe_parts(recipe, entry.name):
            slot = None
            if spec is not None:  # the parts follow each other along the fused dim
                slot = Slot(int(spec["dim"]), start, entry.shape)
                start += view.shape(shapes)[slot.dim]
            merge = recipe.merges.get(part_name)
            unit = units.setdefault(view.source, Unit(view.source, [], merge))
            unit.outputs.append((entry, view, slot))
    return list(units.values())


def recipe_entries(recipe: ExportRecipe, state: dict, out_dtype: torch.dtype) -> list[Entry]:
    """The Hub tensors a recipe writes from `state` (this rank's part of it): name, shape, dtype written."""
    entries = []
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    for name in recipe.hub_names():
        view = recipe_view(recipe, name)
        stored = state[view.parts[0].source].dtype
        written = written_dtype(recipe, name, stored, out_dtype)
        entries.append(Entry(name, view.shape(shapes), written))
    return entries


def own_rows(tensor) -> tuple[int, torch.Tensor | None] | None:
    """For a DTensor split only by rows (FSDP's Shard(0), possibly replicated over other mesh
    dims, or MoE experts split over ep and FSDP inside each rank's experts): the first row this
    rank holds and, if this rank is the replica that writes them, the rows. Such rows are one
    contiguous byte range of the written tensor, so every rank can write its own straight into the
    file with no gather. None for any other layout."""
    if not isinstance(tensor, DTensor):
        return None
    placements = tensor.placements
    if not all(p == Replicate() or (type(p) is Shard and p.dim == 0) for p in placements) and not _expert_rows(tensor):
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return 0, None
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    writes = all(c == 0 for c, p in zip(coordinate, placements) if p == Replicate())
    return (offset[0] if offset else 0), (tensor.to_local() if writes else None)


def _expert_rows(tensor: DTensor) -> bool:
    """Experts under ep: Shard(0) over the ep ranks, FSDP's strided Shard(0) over the efsdp ranks
    inside each rank's experts, which leaves every rank one contiguous run of rows."""
    names = tensor.device_mesh.mesh_dim_names or ()
    return names == ("efsdp", "ep") and all(isinstance(p, (Shard, _StridedShard)) and p.dim == 0
                                            for p in tensor.placements)


class RegionWriter:
    """Writes byte ranges into files that already have their final size (`os.pwrite`), from one
    background thread while the caller prepares the next tensor. One tensor at most waits for it
    while another is written, so memory stays at two tensors. Each file is fsynced once, at the
    end; the first failure stops the writing and is reported by `finish`."""

    def __init__(self, depth: int = 1) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fullshard-export")
        self.pending: list = []
        self.depth = depth
        self.error = ""
        self.files: dict[Path, int] = {}

    def write(self, path: Path, offset: int, tensor: torch.Tensor) -> None:
        self.pending.append(self.pool.submit(self._write, path, offset, tensor))
        while len(self.pending) > self.depth:
            self.pending.pop(0).result()

    def _write(self, path: Path, offset: int, tensor: torch.Tensor) -> None:
        if self.error:
            return
        try:
            if path not in self.files:
                self.files[path] = os.open(path, os.O_WRONLY)
            view = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
            while len(view):
                done = os.pwrite(self.files[path], view, offset)
                view, offset = view[done:], offset + done
        except Exception as err:  # noqa: BLE001 - reported on every rank by `finish`
            self.error = f"writing {path.name}: {type(err).__name__}: {err}"

    def finish(self, sync: bool = True) -> str:
        """Wait for the writes (and with `sync` fsync every file written); the first error, or ""."""
        for future in self.pending:
            future.result()
        self.pending.clear()
        self.pool.shutdown()
        for path, fd in self.files.items():
            try:
                if sync and not self.error:
                    os.fsync(fd)
            except OSError as err:
                self.error = f"fsync of {path.name}: {err}"
            finally:
                os.close(fd)
        self.files.clear()
        return self.error


def every_rank_part(items: list, name: Callable = lambda item: item) -> list:
    """The items (state names, or entries named by `name`) of every rank's part of a model split over
    ranks (pipeline stages, per-expert modules under ep; a collective), each name once, in the same
    order on every rank (layers by number), so every rank plans the same files."""
    import torch.distributed as dist

    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, items)
    merged = {name(item): item for rank_items in gathered for item in rank_items}
    order = lambda key: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]  # noqa: E731
    return [merged[key] for key in sorted(merged, key=order)]


def first_holder(tensor: torch.Tensor) -> bool:
    """Whether this rank writes a gathered tensor of its stage: the first rank of its mesh (a plain
    tensor is written by every rank holding it, the same bytes to the same place)."""
    if not isinstance(tensor, DTensor):
        return True
    return all(c == 0 for c in tensor.device_mesh.get_coordinate())


def create_files(headers: dict[Path, tuple[bytes, int]]) -> None:
    """Each output file with its header and at its final size (the data still a hole), so that
    any rank can write any range of it."""
    for path, (lead, size) in headers.items():
        with open(path, "wb") as handle:
            handle.write(lead)
            handle.truncate(size)


def contiguous_region(view: HubView, numel: int) -> tuple[int, int] | None:
    """The flat range of its (contiguous) state tensor a Hub tensor covers, or None where it is not
    one run of elements (then the unit is gathered whole)."""
    if view.view is None:
        return 0, numel
    shape, stride, offset = view.view
    expected, size = [], 1
    for dim in reversed(shape):
        expected.insert(0, size)
        size *= dim
    same = all(a == b for a, b, n in zip(stride, expected, shape) if n > 1)
    return (offset, offset + size) if same else None


def write_part(writer: RegionWriter, places: dict, entry: Entry, slot: Slot | None,
               part_shape: tuple[int, ...], first: int, flat: torch.Tensor) -> None:
    """Elements `first` on of a Hub tensor's part (`flat`, on any device and in any dtype) into its
    place in the file: one write, or one per run where the part is fused along a later dim."""
    path, offset = places[entry.name]
    for at, lo, hi in slot_runs(slot, part_shape, first, first + flat.numel()):
        piece = flat[lo - first:hi - first].to("cpu", entry.dtype)
        writer.write(path, offset + at * entry.dtype.itemsize, piece)


def write_own_rows(writer: RegionWriter, unit: Unit, places: dict, rows: tuple[int, torch.Tensor | None],
                   full_shape: tuple[int, ...]) -> None:
    """This rank's rows of a row-sharded state tensor into every Hub tensor of its unit that they
    overlap (each Hub tensor, or part of a fused one, one run of the state tensor's elements), cast
    to the written dtype."""
    first, local = rows
    if local is None or not local.numel():
        return
    row_numel = local.numel() // local.shape[0] if local.dim() else 1
    held_lo = first * row_numel
    flat = local.reshape(-1)
    numel = 1
    for dim in full_shape:
        numel *= dim
    for entry, view, slot in unit.outputs:
        region_lo, region_hi = contiguous_region(view, numel)
        lo, hi = max(region_lo, held_lo), min(region_hi, held_lo + flat.numel())
        if lo < hi:
            part_shape = view.shape({unit.key: full_shape})
            held = flat[lo - held_lo:hi - held_lo]
            write_part(writer, places, entry, slot, part_shape, lo - region_lo, held)


def in_place(unit: Unit, tensor) -> tuple[int, torch.Tensor | None] | None:
    """`own_rows` of the unit's state tensor where every Hub tensor of the unit can be written from
    them (no merge, each one run of elements); None where the unit is gathered whole."""
    if unit.merge is not None:
        return None
    rows = own_rows(tensor)
    numel = tensor.numel()
    if rows is None or any(contiguous_region(view, numel) is None for _, view, _ in unit.outputs):
        return None
    return rows


def write_units(writer: RegionWriter, units: list[Unit], state: dict, places: dict, staged: bool) -> None:
    """Every unit this rank holds into the files: row-sharded ones by every rank's own rows, no gather;
    any other layout gathered whole (a collective) and written by the rank it is dealt to (a stage's
    first rank where ranks hold different parts); a rank whose writing failed keeps gathering."""
    rank, world = get_rank(), get_world_size()
    for number, unit in enumerate(units):
        tensor = state.get(unit.key)
        if tensor is None:  # held by another pipeline stage or ep rank, which writes it
            continue
        rows = in_place(unit, tensor)
        if rows is not None:
            write_own_rows(writer, unit, places, rows, tuple(tensor.shape))
            continue
        full = merged_full(state, unit.key, unit.merge).contiguous()
        if first_holder(tensor) if staged else number % world == rank:
            for entry, view, slot in unit.outputs:
                if slot is None:
                    writer.write(*places[entry.name], view.of(full).to("cpu", entry.dtype))
                else:
                    part = view.of(full).contiguous()
                    write_part(writer, places, entry, slot, tuple(part.shape), 0, part.reshape(-1))
        del full


def export_hf(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer=None,
              dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a sharded (or plain) model as a directory `from_pretrained` loads; call on every rank.

    The files hold what transformers' `save_pretrained` writes for the same model: its names and
    layout (fused MoE experts one key per expert; `export_recipe`), tied weights once under their
    canonical name. dtype defaults to the dtype the model was loaded from (`source_dtype`); what
    transformers keeps in fp32 at that dtype (`_keep_in_fp32_modules(_strict)`) is written in fp32.
    """
    reshard_all(model)
    state = model.state_dict()
    return write_export(model, output_dir, state, export_recipe(model, state), tokenizer, dtype, max_shard_size)


def write_export(model: torch.nn.Module, output_dir: str | os.PathLike, state: dict, recipe: ExportRecipe,
                 tokenizer=None, dtype: torch.dtype | str | None = None,
                 max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """`export_hf` of `state` (a state dict, sharded or not) following `recipe` (`export_recipe`, or
    `fullshard.lora.merge_recipe` for a LoRA model merged): every rank calls it."""
    output_dir = Path(output_dir)
    config = config_json(model)
    if config is None:
        raise CheckpointError(
            f"{type(model).__name__} has no Hugging Face config: export_hf needs a transformers model"
        )
    out_dtype = resolve_dtype(dtype) or source_dtype(model)
    max_bytes = parse_size(max_shard_size)
    entries = recipe_entries(recipe, state, out_dtype)
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    units = export_units(recipe, entries, shapes)
    staged = holds_part(model)
    if staged:
        entries = every_rank_part(entries, lambda entry: entry.name)
    files = plan_files(entries, max_bytes)
    staging = Path(broadcast_from_rank0(str(staging_dir(output_dir)) if get_rank() == 0 else None))
    layouts = [(staging / fname, group, *safetensors_header(group)) for fname, group in files]
    headers = {path: (lead, len(lead) + sum(e.nbytes for e in group)) for path, group, lead, _ in layouts}
    places = {
        entry.name: (path, offset) for path, group, _, offsets in layouts for entry, offset in zip(group, offsets)
    }
    run_agreed(lambda: staging.mkdir(parents=True) or create_files(headers), on_rank=0, error_type=CheckpointError)
    writer = RegionWriter()
    try:
        write_units(writer, units, state, places, staged)
        error = writer.finish()
        all_ranks_agree_ok(not error, error, CheckpointError)
        hf_config = export_config(config, model_class_name(model), out_dtype)
        run_agreed(lambda: finish_directory(staging, output_dir, files, hf_config, generation_config_json(model),
                                            tokenizer), on_rank=0, error_type=CheckpointError)
    except BaseException:
        writer.finish(sync=False)
        if get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


__all__ = [  # the writer's names, and the recipe's (`fullshard.hf.recipe`) importable as before
    "DEFAULT_SHARD_SIZE", "INDEX_NAME", "SOURCE_DTYPE", "WEIGHTS_NAME", "Entry", "ExportRecipe",
    "RegionWriter", "SafetensorsStream", "alias_names", "config_json", "every_rank_part",
    "export_config", "export_hf", "export_recipe", "finish_directory", "first_holder",
    "gather_full", "generation_config_json", "hub_recipe", "kept_in_fp32", "merge_lora",
    "parse_size", "plan_files", "recipe_entries", "recipe_parts", "recipe_view",
    "remember_source_dtype", "safetensors_header", "source_dtype", "staging_dir", "write_export",
    "written_dtype",
]
