"""Rank agreement for checkpoint I/O: a step that fails on one rank raises on all of them.

File operations fail per rank (a full disk, a missing file); a rank that raised alone would leave
the others waiting in the next collective. These helpers turn any rank's failure into the same
error on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed import all_ranks_agree_ok, get_rank, get_world_size


def run_agreed(fn: Callable, on_rank: int | None = None):
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
