"""An async save that `save()` returned is committed, or the process says which step was lost.

DCP's background save runs collectives on the manager's own process group. A script that ends
with `dist.destroy_process_group()` and no `wait()` would destroy that group under the save: the
save fails, and afterwards `get_rank()` answers 0 on every rank, so no rank even knows whether it
should commit. Two guards:
- while a save is pending, `torch.distributed.destroy_process_group` first commits it (every rank
  calls destroy, so the commit's collectives line up); the wrapper is the only torch function
  fullshard replaces, and it only adds that wait;
- at exit, a save still pending (the script kept a reference to the original destroy, or never
  destroyed the group) is committed if it can be: with the group alive by `wait()`; with the group
  gone, by the rank that was rank 0 at save time, alone, if its DCP save finished (DCP's rank 0
  writes the index only after every rank wrote its shards). Otherwise the process prints which
  step was lost and exits with status 1: never silently lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..errors import CheckpointError

EXIT_WAIT_S = 120  # how long exit waits for a background save whose process group is gone


@dataclass
class PendingSave:
    future: object
    tmp: Path
    final: Path
    step: int
    rank: int  # at save time: after the group is destroyed, get_rank() says 0 everywhere
    world_size: int
    metadata: object = None  # the DCP index the save returned (every rank gets the global one)
    writer: object = None  # the DCP writer (`checksums.SummingWriter`): the shards' sums, on the coordinator


_pending: set = set()  # managers with a save in flight (held, so none is collected before it commits)
_original_destroy = None


def track(manager) -> None:
    """Guard `manager`'s pending save (see the module docstring)."""
    global _original_destroy
    if _original_destroy is None:
        _original_destroy = dist.destroy_process_group
        dist.destroy_process_group = _destroy_after_pending_saves
    if not _pending:
        atexit.register(_at_exit)
    _pending.add(manager)


def untrack(manager) -> None:
    _pending.discard(manager)
    if not _pending:
        atexit.unregister(_at_exit)


def saves_pending() -> bool:
    """Whether an async save of this process is still waiting to be committed."""
    return bool(_pending)


def _destroy_after_pending_saves(group=None):
    """`dist.destroy_process_group` that first commits the async saves pending on this process."""
    if group is None or any(group is m._async_group for m in list(_pending)):
        for manager in list(_pending):
            manager.wait()
    return _original_destroy(group)


def _at_exit() -> None:
    for manager in list(_pending):
        pending = manager._pending
        try:
            if dist.is_initialized():
                manager.wait()
            else:
                untrack(manager)
                _commit_without_group(manager, pending)
        except BaseException as err:  # noqa: BLE001 - exit is the last place to report it
            _lost(pending, f"{type(err).__name__}: {err}")


def _commit_without_group(manager, pending: PendingSave) -> None:
    """Every rank's DCP future returns the global index once all ranks wrote; a save that started
    after the group was gone ran as a one-process save and returns an index with gaps."""
    from .layout import index_gaps

    try:
        metadata = pending.future.result(timeout=EXIT_WAIT_S)
    except BaseException as err:  # noqa: BLE001
        raise CheckpointError(
            f"its background write failed once the process group was destroyed ({type(err).__name__})"
        ) from None
    gaps = index_gaps(metadata)
    if gaps:
        raise CheckpointError(f"the process group was destroyed before every rank wrote its shards (missing {gaps[0]})")
    pending.metadata = metadata
    if pending.rank == 0:
        manager.commit_files(pending)


def _lost(pending: PendingSave, reason: str) -> None:
    message = (f"fullshard: error: the async checkpoint save of step {pending.step} ({pending.final}) was lost on rank "
               f"{pending.rank}: {reason}. Call CheckpointManager.wait() before destroying the process group.")
    print(message, file=sys.stderr, flush=True)  # not the logger: this is the process's last word
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)
