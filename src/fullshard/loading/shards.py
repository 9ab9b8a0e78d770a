"""What this rank holds of each (possibly sharded) tensor, and what that may cost it to read."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import LoadError
from ..tensors import local_tensor


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `tensor` and the region of the global tensor it holds."""
    local = local_tensor(tensor)
    if not isinstance(tensor, DTensor):
        return local, tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise LoadError(f"local shard shape {tuple(local.shape)} is not the expected {tuple(shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def shard_count(model: nn.Module) -> int:
    """Into how many pieces the most-sharded parameter is cut (1 for a model that is not sharded)."""
    counts = [math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())
              for p in model.parameters() if isinstance(p, DTensor)]
    return max(counts, default=1)


def slice_bytes(target: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of one index along the dim `target` is sharded on: what an uneven split can add to a rank."""
    dims = [p.dim for p in target.placements if p.is_shard()] if isinstance(target, DTensor) else []
    if not target.shape:
        return dtype.itemsize
    dim = dims[0] if dims else 0
    return dtype.itemsize * math.prod(target.shape) // max(target.shape[dim], 1)
