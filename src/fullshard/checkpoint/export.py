"""Write a plain Hugging Face directory (safetensors + index + config) from a sharded model or checkpoint.

No rank ever holds the whole model. Live, every file is created at its final size first (a
safetensors header follows from names, shapes and dtypes alone), then every rank writes its own
rows of each row-sharded (FSDP) tensor straight into place, cast to the written dtype: no gather,
and each rank writes 1/N of the bytes. Tensors in other layouts (TP, merged LoRA weights) are
gathered one at a time and written by the rank the file is dealt to. Offline, one process
streams the DCP checkpoint tensor by tensor, with no process group.
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
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..distributed import all_ranks_agree_ok, broadcast_from_rank0, get_rank, get_world_size, run_agreed
from ..dtypes import SAFETENSORS_NAMES, dtype_name, resolve_dtype
from ..errors import CheckpointError
from ..fsdp import model_class_name, reshard_all
from ..tensors import holds_part, replicated, tensor_aliases
from . import layout

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


SOURCE_DTYPE = "fullshard_source_dtype"  # the attribute `remember_source_dtype` sets


def remember_source_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Record the dtype the model's weights are stored in where it was loaded from; a model built in
    another dtype (fp32 masters of a bf16 checkpoint) keeps its own in its config."""
    if dtype is not None:
        setattr(model, SOURCE_DTYPE, dtype)


def source_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's weights came in: what an export writes unless told otherwise. The
    stored dtype `remember_source_dtype` recorded, else the config's `dtype`; master weights are
    often upcast (bf16 files trained in fp32), so the parameters' dtype is the last resort. A PEFT
    model's is its base model's."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    if getattr(model, SOURCE_DTYPE, None) is not None:
        return getattr(model, SOURCE_DTYPE)
    try:
        configured = resolve_dtype(getattr(getattr(model, "config", None), "dtype", None))
    except ValueError:
        configured = None
    if configured is not None:
        return configured
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


def alias_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that are the same tensor as another, canonical one: written once, under the
    canonical name, as `save_pretrained` does. The canonical name is the tie's target in the HF tie
    map when the model declares one (the loader ties the alias to it), else the first registered."""
    tie_map = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    targets = set(tie_map.values()) if isinstance(tie_map, dict) else set()
    aliases = set()
    for names in tensor_aliases(model).values():
        canonical = next((n for n in names if n in targets), names[0])
        aliases.update(n for n in names if n != canonical)
    return aliases


def export_recipe(model: torch.nn.Module, state_keys) -> dict:
    """What an export writes from a model's state: output name -> state key (aliases left out).
    A LoRA model's recipe (`fullshard.lora.merge_recipe`) also merges adapters; this is the plain one."""
    aliases = alias_names(model)
    return {"names": {k: k for k in state_keys if k not in aliases}, "merges": {}}


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


def written_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


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
            raise CheckpointError(f"{self.path}: got {name!r} ({tuple(tensor.shape)}) where {expected!r} of {nbytes} bytes belongs")
        self.handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self.pending:
            raise CheckpointError(f"{self.path}: {len(self.pending)} tensors never arrived, first {self.pending[0][0]!r}")
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


@dataclass
class GatheredTensor:
    """A tensor an export computes rather than reads: its shape and dtype up front (for the file
    headers) and `gather`, a collective every rank calls, returning the full tensor (e.g. a base
    weight with its LoRA adapter merged in, built one layer at a time)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    gather: Callable[[], torch.Tensor]


def gather_full(tensor: torch.Tensor | GatheredTensor) -> torch.Tensor:
    """One tensor, whole, on every rank (a collective for DTensors): the unit export works in."""
    if isinstance(tensor, GatheredTensor):
        return tensor.gather().detach()
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:  # CPU-offloaded shards of an accelerator mesh
        tensor = tensor.to(mesh_device)
    return replicated(tensor).detach()


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


def export_hf(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer=None,
              dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE,
              tensors: dict[str, torch.Tensor | GatheredTensor] | None = None) -> Path:
    """Write a sharded (or plain) model as a directory `from_pretrained` loads; call on every rank.

    dtype defaults to the dtype the model was loaded from (`source_dtype`); tied weights are
    written once under their canonical name. `tensors` replaces the model's state dict as what is
    written (same order and names as the files should have), e.g. `fullshard.lora.merged_state`.
    """
    output_dir = Path(output_dir)
    config = config_json(model)
    if config is None:
        raise CheckpointError(f"{type(model).__name__} has no Hugging Face config: export_hf needs a transformers model")
    out_dtype = resolve_dtype(dtype) or source_dtype(model)
    max_bytes = parse_size(max_shard_size)
    reshard_all(model)
    state = model.state_dict() if tensors is None else tensors
    aliases = alias_names(model)
    entries = [Entry(k, tuple(t.shape), written_dtype(t.dtype, out_dtype)) for k, t in state.items() if k not in aliases]
    staged = holds_part(model)
    if staged:
        entries = every_rank_part(entries, lambda entry: entry.name)
    files = plan_files(entries, max_bytes)
    staging = Path(broadcast_from_rank0(str(staging_dir(output_dir)) if get_rank() == 0 else None))
    rank, world = get_rank(), get_world_size()
    layouts = [(staging / fname, group, *safetensors_header(group)) for fname, group in files]
    headers = {path: (lead, len(lead) + sum(e.nbytes for e in group)) for path, group, lead, _ in layouts}
    run_agreed(lambda: staging.mkdir(parents=True) or create_files(headers), on_rank=0, error_type=CheckpointError)
    writer = RegionWriter()
    try:
        for number, (path, group, _, offsets) in enumerate(layouts):
            for entry, offset in zip(group, offsets):
                tensor = state.get(entry.name)
                if tensor is None:  # held by another pipeline stage or ep rank, which writes it
                    continue
                rows = own_rows(tensor)
                if rows is not None:  # every rank writes its own rows: no gather at all
                    first, local = rows
                    if local is not None and local.numel():
                        row_bytes = entry.nbytes // entry.shape[0] if first else 0  # a replicated scalar has no rows
                        writer.write(path, offset + first * row_bytes, local.to("cpu", entry.dtype))
                    continue
                # any other layout is gathered whole on every rank (a collective), and the rank the
                # file is dealt to writes it; a rank whose writing failed keeps gathering, so none hangs
                full = gather_full(tensor)
                if (first_holder(tensor) if staged else number % world == rank):
                    writer.write(path, offset, full.to("cpu", entry.dtype))
                del full
        error = writer.finish()
        all_ranks_agree_ok(not error, error, CheckpointError)
        run_agreed(lambda: finish_directory(staging, output_dir, files, export_config(config, model_class_name(model), out_dtype),
                                             generation_config_json(model), tokenizer), on_rank=0, error_type=CheckpointError)
    except BaseException:
        writer.finish(sync=False)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir
