"""The counts global aggregation divides by: response tokens and sequences of a whole mini-batch.

Every micro-batch on every data-parallel rank normalises its loss by the same totals
(`policy_loss(..., global_tokens=, global_sequences=, dp_size=)`), so the sum of their gradients
is the one-process gradient of the whole mini-batch, whatever the split. One all_reduce of two
integers gives both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class GlobalCounts(NamedTuple):
    tokens: int  # response tokens (mask entries set) over the mini-batch
    sequences: int  # sequences with at least one response token


def global_counts(masks, *, group=None, repeats: int = 1) -> GlobalCounts:
    """Counts over this rank's micro-batches' `[batch, length]` response masks (a tensor or a
    list), summed over the ranks of `group` (default: every rank). Ranks that hold the same data
    (tensor-parallel ranks of one data rank) are counted once: `repeats` of them per data rank.
    A collective: every rank of `group` calls it."""
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    device = masks[0].device if masks else torch.device("cpu")
    local = torch.zeros(2, dtype=torch.int64, device=device)
    for mask in masks:
        local[0] += (mask != 0).sum()
        local[1] += ((mask != 0).sum(dim=-1) > 0).sum()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    tokens, sequences = (int(value) for value in local.cpu())
    if tokens % repeats or sequences % repeats:
        raise ValueError(f"counts {tokens}, {sequences} are not multiples of repeats={repeats}: "
                         "the ranks that repeat a data rank hold different batches")
    return GlobalCounts(tokens // repeats, sequences // repeats)
