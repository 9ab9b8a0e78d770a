"""Pretrained weights from a torch Distributed Checkpoint (DCP) directory.

DCP stores each tensor as chunks with their global offsets, so every rank reads the chunks that
overlap its own shard, at any world size. The model's entries may sit at the top level (a plain
model state dict) or under `model.` (a training checkpoint that also holds optimizer state).
Nothing in the checkpoint can run code: metadata goes through `safe_dcp.read_dcp_metadata`
(a restricted unpickler), data through `SafeFileSystemReader` and `SafeLoadPlanner`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from ..errors import LoadError
from ..safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from ..tensors import local_tensor
from .source import SourcePlan

PREFIXES = ("", "model.")


def stored_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor entry of the checkpoint -> (global shape, dtype): a thin view of DCP `Metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path, LoadError)
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def choose_prefix(stored: dict, model_keys) -> str:
    """The prefix under which the model's keys are stored: the one that matches the most keys."""
    counts = {p: sum(f"{p}{k}" in stored for k in model_keys) for p in PREFIXES}
    return max(PREFIXES, key=lambda p: counts[p])


class DCPSource:
    def __init__(self, path: str | Path) -> None:
        self.location, self.format, self.prefix = str(path), "dcp", ""
        self.dtypes: dict[str, torch.dtype] = {}

    def plan(self, names: dict[str, torch.Tensor]) -> SourcePlan:
        stored = stored_tensors(self.location)
        self.prefix = choose_prefix(stored, names)
        mine = {k[len(self.prefix):]: v for k, v in stored.items() if k.startswith(self.prefix)}
        present = {k: v for k, v in mine.items() if k in names}
        self.dtypes = {k: dtype for k, (_, dtype) in present.items()}
        return SourcePlan(shapes={k: shape for k, (shape, _) in present.items()}, dtypes=dict(self.dtypes),
                          unexpected=sorted(set(mine) - set(names)),
                          checkpoint_bytes=sum(math.prod(s) * d.itemsize for s, d in present.values()),
                          dtype=None)

    def read(self, targets: dict[str, torch.Tensor]) -> int:
        """Every rank plans and reads its own chunks (`no_dist`): no collective while reading."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": here it means per rank
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({f"{self.prefix}{k}": t for k, t in targets.items()},
                     storage_reader=SafeFileSystemReader(self.location, LoadError),
                     planner=SafeLoadPlanner(error_type=LoadError), no_dist=True)
        return sum(local_tensor(t).numel() * self.dtypes[k].itemsize for k, t in targets.items())

    def close(self) -> None:
        pass
