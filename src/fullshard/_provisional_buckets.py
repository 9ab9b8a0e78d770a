"""PROVISIONAL stand-in for `fullshard.hf_weight_buckets` (issue 31 part 1, built on branch hubexport):
same contract, one gather per tensor. Deleted when that branch is merged."""

from __future__ import annotations

import torch

from .checkpoint.export import alias_names, gather_full
from .dtypes import resolve_dtype
from .fsdp import reshard_all


def hf_weight_buckets(model, *, dtype=None, bucket_bytes=256 * 2**20, lora="merge"):
    reshard_all(model)
    dtype = resolve_dtype(dtype)
    aliases = alias_names(model)
    bucket, size = [], 0
    for name, tensor in model.state_dict().items():
        if name in aliases:
            continue
        full = gather_full(tensor)
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += nbytes
    if bucket:
        yield bucket
