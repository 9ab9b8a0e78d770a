"""Loading parameters from a torch Distributed Checkpoint (DCP) directory.

DCP stores each tensor as chunks with their global offsets, so every rank reads the chunks that
overlap its own shard, at any world size. The model's entries may sit at the top level (a plain
model state dict) or under `model.` (a training checkpoint that also holds optimizer state).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from .errors import CheckpointError

PREFIXES = ("", "model.")


def read_dcp_metadata(path: str | Path) -> dict[str, tuple[int, ...] | None]:
    """Every stored key with its global shape (None for non-tensor entries)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{str(path)!r} is not a DCP checkpoint: no .metadata file")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"DCP metadata in {str(path)!r} is unreadable: {type(exc).__name__}: {exc}") from None
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def choose_prefix(stored: dict, model_keys: list[str]) -> str:
    """The prefix under which the model's keys are stored: the one that matches the most keys."""
    counts = {p: sum(f"{p}{k}" in stored for k in model_keys) for p in PREFIXES}
    return max(PREFIXES, key=lambda p: counts[p])


def load_dcp(path: str | Path, targets: dict[str, torch.Tensor], prefix: str) -> int:
    """Read `targets` (model key -> this rank's tensor) from the checkpoint in place; a collective.

    Returns the bytes this rank asked for: the sizes of its local shards.
    """
    import torch.distributed.checkpoint as dcp

    dcp.load({f"{prefix}{k}": t for k, t in targets.items()}, checkpoint_id=str(path))
    local = [t.to_local() if isinstance(t, DTensor) else t for t in targets.values()]
    return sum(t.numel() * t.element_size() for t in local)
