"""Where the loader's bytes come from: one `Source` per checkpoint format, behind one protocol.

A source answers two questions, in two phases the loader keeps apart:
- `plan(names)`: from metadata alone (file headers, an index, DCP's `.metadata`), which model
  tensors it fills, with which shapes and dtypes, and which of its keys fit no model tensor.
  Nothing is allocated or copied, so a checkpoint that does not fit is refused before the model
  is touched.
- `read(targets)`: fill each target (a DTensor or plain tensor, one per tie group) with this
  rank's region, with no collective in flight; returns the tensor bytes this rank read.

HF directories (safetensors or `.bin`, single or indexed) are an `HFSource`; torch Distributed
Checkpoints are a `DCPSource` (`dcp.py`). A new weight format is one more class with these three
methods.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ..errors import LoadError
from .bin_reader import BinReader
from .convert import Converted, ignored_unexpected, plan_keys, transformers_conversions
from .readers import TensorReader
from .resolve import CheckpointFiles, find_checkpoint_files
from .safetensors_reader import SafetensorsReader
from .shards import local_region


def load_threads() -> int:
    """Threads that copy slices (torch releases the GIL in `copy_`, and page faults on the mapped
    files overlap); FULLSHARD_LOAD_THREADS overrides it, read at each load, not at import."""
    return max(1, int(os.environ.get("FULLSHARD_LOAD_THREADS", min(8, os.cpu_count() or 1))))


@dataclass
class SourcePlan:
    """What a source fills, known from metadata only. Keys are the model's (checkpoint-side) names."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    unexpected: list[str]
    checkpoint_bytes: int
    dtype: torch.dtype | None  # the dtype to load into when the caller names none (None: the model's)
    whole_tensor_conversions: list[str] = field(default_factory=list)


class Source(Protocol):
    location: str
    format: str

    def plan(self, names: dict[str, torch.Tensor]) -> SourcePlan: ...

    def read(self, targets: dict[str, torch.Tensor]) -> int: ...

    def close(self) -> None: ...


def open_reader(files: CheckpointFiles) -> TensorReader:
    reader_cls = SafetensorsReader if files.format == "safetensors" else BinReader
    return reader_cls(files.files, files.weight_map)


def main_dtype(infos) -> torch.dtype | None:
    """The floating dtype holding most of the checkpoint's bytes."""
    totals: dict[torch.dtype, int] = {}
    for info in infos:
        if info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + math.prod(info.shape) * info.dtype.itemsize
    return max(totals, key=totals.get) if totals else None


def checkpoint_dtype(directory: str | os.PathLike) -> torch.dtype | None:
    """The main floating dtype of the HF checkpoint in `directory`, from its headers only."""
    reader = open_reader(find_checkpoint_files(directory))
    try:
        return main_dtype(reader.infos.values())
    finally:
        reader.close()


class HFSource:
    """A transformers checkpoint directory. Keys are mapped with transformers' own conversion
    tables for `keys_model` (renames, fused MoE experts), each model tensor becoming a lazy recipe
    (`convert.py`); slices are copied by a thread pool straight into the shards."""

    def __init__(self, directory: Path, keys_model: nn.Module, key_mapping: dict[str, str] | None = None) -> None:
        self.location, self.format = str(directory), "hf"
        self.keys_model, self.key_mapping = keys_model, key_mapping
        self.reader: TensorReader | None = None
        self.recipes: dict = {}

    def plan(self, names: dict[str, torch.Tensor]) -> SourcePlan:
        files = find_checkpoint_files(self.location)
        self.format, self.reader = files.format, open_reader(files)
        keys = plan_keys(self.reader, names, transformers_conversions(self.keys_model, self.key_mapping),
                         getattr(self.keys_model, "base_model_prefix", None))
        self.recipes = keys.recipes
        buffers = [n for n, _ in self.keys_model.named_buffers(remove_duplicate=False)]
        ignored = set(ignored_unexpected(self.keys_model, keys.unexpected,
                                         lambda suffix: any(b.endswith(suffix) for b in buffers)))
        converted = [k for k, r in self.recipes.items() if isinstance(r, Converted)]
        for key in converted:  # no sliceable form: its shape is known only once built
            tensor = self.recipes[key].convert()
            self.recipes[key].shape, self.recipes[key].dtype = tuple(tensor.shape), tensor.dtype
        infos = self.reader.infos.values()
        return SourcePlan(
            shapes={k: tuple(r.shape) for k, r in self.recipes.items()},
            dtypes={k: r.dtype for k, r in self.recipes.items()},
            unexpected=[k for k in keys.unexpected if k not in ignored],
            checkpoint_bytes=sum(math.prod(i.shape) * i.dtype.itemsize for i in infos),
            dtype=main_dtype(infos), whole_tensor_conversions=converted)

    def read(self, targets: dict[str, torch.Tensor]) -> int:
        jobs = [(key, *local_region(target)) for key, target in targets.items()]
        jobs.sort(key=lambda job: -job[1].numel())  # largest first: the pool ends together
        with ThreadPoolExecutor(load_threads(), thread_name_prefix="fullshard-load") as pool:
            for future in [pool.submit(self._read_one, key, local, region) for key, local, region in jobs]:
                future.result()
        return self.reader.bytes_read

    def _read_one(self, key: str, local: torch.Tensor, region: tuple[slice, ...]) -> None:
        recipe = self.recipes[key]
        try:
            with torch.no_grad():  # grad mode is per thread
                recipe.read_into(region, local)
        except Exception as exc:  # noqa: BLE001 - name the key and file
            files = sorted({str(self.reader.infos[k].file) for k in recipe.sources})
            raise LoadError(f"reading {key!r} (from {recipe.sources[:4]} in {files[:2]}) failed: "
                            f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
