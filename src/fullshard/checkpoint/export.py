"""Write a plain Hugging Face directory (safetensors + index + config) from a sharded model or checkpoint.

No rank ever holds the whole model. Live, the output files are dealt round-robin to the ranks;
each tensor is gathered once (one tensor at a time) and kept only by the rank that writes its
file, so a rank holds at most one output file plus one tensor and all ranks write in parallel.
Offline, one process reads the DCP checkpoint one output file at a time, with no process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..distributed import all_ranks_agree_ok, get_rank, get_world_size
from ..engine import DTYPES, reshard_all
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
            raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or an int of bytes")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name in DTYPES:
        return DTYPES[name]
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. bf16, fp16, fp32, bfloat16 or a torch.dtype")
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def source_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's weights came in: what an export writes unless told otherwise.

    Master weights are often upcast (bf16 files trained in fp32), so the parameters' dtype is
    the last resort; a loader that knows better sets `model.fullshard_source_dtype`.
    """
    for candidate in (getattr(model, "fullshard_source_dtype", None), getattr(getattr(model, "config", None), "dtype", None)):
        if candidate is not None:
            try:
                return to_dtype(candidate)
            except ValueError:
                continue
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


def tied_alias_keys(model: torch.nn.Module) -> list[str]:
    """State keys that are the same parameter as an earlier-named one; written once, under the
    canonical name, as `save_pretrained` does (the HF tie map names the alias; otherwise the
    second name of a shared parameter is the alias)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    aliases: set[str] = set()
    tie_map = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    if isinstance(tie_map, dict):
        for alias, canonical in tie_map.items():
            if alias in named and canonical in named and named[alias] is named[canonical]:
                aliases.add(alias)
    first_name: dict[int, str] = {}
    for name, param in named.items():
        if id(param) in first_name and name not in aliases and first_name[id(param)] not in aliases:
            aliases.add(name)
        first_name.setdefault(id(param), name)
    return sorted(aliases)


def config_json(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return config.to_json_string(use_diff=True) if hasattr(config, "to_json_string") else None


def generation_config_json(model: torch.nn.Module) -> str | None:
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    return generation.to_json_string(use_diff=True) if generation is not None and can_generate else None


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype written

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def _out_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


def plan_files(entries: list[_Entry], max_bytes: int) -> list[tuple[str, list[_Entry]]]:
    """Group tensors in order into files of at most `max_bytes` (a bigger tensor gets its own file)."""
    groups: list[list[_Entry]] = []
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


def _export_config(raw: str, class_name: str, dtype: torch.dtype) -> str:
    config = json.loads(raw)
    config["architectures"] = [class_name]
    config["dtype"] = dtype_name(dtype)
    config.pop("torch_dtype", None)
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _staging_dir(output_dir: Path) -> Path:
    return output_dir.parent / f".{output_dir.name}{layout.TMP_PREFIX}{uuid.uuid4().hex[:8]}"


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _finish_directory(staging: Path, output_dir: Path, files: list[tuple[str, list[_Entry]]], config: str | None,
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
    new_names = {p.name for p in staging.iterdir()}
    for stale in output_dir.iterdir():
        weights = stale.name == INDEX_NAME or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", stale.name)
        if weights and stale.name not in new_names:
            stale.unlink()
    for item in staging.iterdir():
        target = output_dir / item.name
        if target.is_dir() and not item.is_dir():
            raise IsADirectoryError(f"cannot write {target}: a directory of that name exists")
        if item.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(item, target)
    shutil.rmtree(staging, ignore_errors=True)


def _run_agreed(fn: Callable, on_rank: int | None = None):
    """Run `fn` on every rank (or only `on_rank`); every rank raises if any failed."""
    result, ok, message = None, True, ""
    if on_rank is None or get_rank() == on_rank:
        try:
            result = fn()
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported on every rank below
            ok, message = False, f"{type(err).__name__}: {err}"
    all_ranks_agree_ok(ok, message)
    return result


def broadcast_from_rank0(value):
    if not dist.is_initialized() or get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_full(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:  # CPU-offloaded shards of an accelerator mesh
        tensor = tensor.to(mesh_device)
    return tensor.full_tensor().detach()


def export_hf(model: torch.nn.Module, output_dir: str | os.PathLike, tokenizer=None,
              dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a sharded (or plain) model as a directory `from_pretrained` loads; call on every rank.

    dtype defaults to the dtype the model was loaded from (`source_dtype`); tied weights are
    written once under their canonical name.
    """
    output_dir = Path(output_dir)
    config = config_json(model)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no Hugging Face config: export_hf needs a transformers model")
    out_dtype = to_dtype(dtype) or source_dtype(model)
    max_bytes = parse_size(max_shard_size)
    reshard_all(model)
    state = model.state_dict()
    aliases = set(tied_alias_keys(model))
    entries = [_Entry(k, tuple(t.shape), _out_dtype(t.dtype, out_dtype)) for k, t in state.items() if k not in aliases]
    files = plan_files(entries, max_bytes)
    staging = Path(broadcast_from_rank0(str(_staging_dir(output_dir)) if get_rank() == 0 else None))
    _run_agreed(lambda: staging.mkdir(parents=True), on_rank=0)
    rank, world = get_rank(), get_world_size()
    try:
        for first in range(0, len(files), world):
            # one round: every rank gathers the next `world` files, then all write at once
            mine: dict[str, torch.Tensor] = {}
            my_file = None
            for offset, (fname, group) in enumerate(files[first:first + world]):
                for entry in group:
                    full = _gather_full(state[entry.name])
                    if offset == rank:
                        mine[entry.name] = full.to("cpu", entry.dtype).contiguous()
                        my_file = fname
                    del full
            _run_agreed(lambda: my_file is not None and _write_safetensors(staging / my_file, mine))
            mine.clear()
        _run_agreed(lambda: _finish_directory(staging, output_dir, files, _export_config(config, type(model).__name__, out_dtype),
                                              generation_config_json(model), tokenizer), on_rank=0)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def export_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                      dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Turn a fullshard checkpoint (any world size) into an HF directory in this one process.

    `checkpoint_dir` is one checkpoint or a save directory (its newest complete checkpoint). No
    process group is needed; tensors are read from the DCP shards one output file at a time.
    """
    import torch.distributed.checkpoint as dcp

    checkpoint = layout.resolve_checkpoint(checkpoint_dir)
    meta = layout.read_json(checkpoint / layout.MODEL_META)
    if not (checkpoint / layout.CONFIG).is_file():
        raise FileNotFoundError(f"{checkpoint / layout.CONFIG} is missing: the checkpoint was saved from a model "
                                "without a Hugging Face config, so there is nothing to export it as")
    state_dir = checkpoint / layout.STATE_DIR
    metadata = layout.read_dcp_metadata(state_dir)
    layout.check_storage_files(state_dir, metadata)
    out_dtype = to_dtype(dtype) or to_dtype(meta["dtype"])
    entries, stored = [], {}
    for name in meta["state_keys"]:
        item = metadata.state_dict_metadata.get(f"model.{name}")
        if item is None or not hasattr(item, "size"):
            raise KeyError(f"{checkpoint}: tensor {name!r} is listed in {layout.MODEL_META} but not in the DCP index")
        stored[name] = item.properties.dtype
        entries.append(_Entry(name, tuple(item.size), _out_dtype(item.properties.dtype, out_dtype)))
    files = plan_files(entries, parse_size(max_shard_size))
    output_dir = Path(output_dir)
    staging = _staging_dir(output_dir)
    staging.mkdir(parents=True)
    try:
        for fname, group in files:
            buffers = {f"model.{e.name}": torch.empty(e.shape, dtype=stored[e.name]) for e in group}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(buffers, storage_reader=dcp.FileSystemReader(str(state_dir)), no_dist=True)
            _write_safetensors(staging / fname, {e.name: buffers[f"model.{e.name}"].to(e.dtype).contiguous() for e in group})
            del buffers
        generation = checkpoint / layout.GENERATION_CONFIG
        _finish_directory(staging, output_dir, files,
                          _export_config((checkpoint / layout.CONFIG).read_text(), meta["class_name"], out_dtype),
                          generation.read_text() if generation.is_file() else None, tokenizer=None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir
