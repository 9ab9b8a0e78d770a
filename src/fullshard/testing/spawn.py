"""Run one function on N gloo ranks in a single spawned process group.

Starting a group is the expensive part of a distributed test (seconds per rank for the imports),
so a test hands one function many checks. A failure on any rank comes back with that rank's
traceback; ranks still waiting in a collective for the failed one are killed after a short grace
period, so nothing hangs.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    pass


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, results) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        # serialised here: tensors sent as they are travel by file descriptor, which vanishes
        # with this process before the parent reads them
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600, grace: float = 20, **kwargs: Any) -> list:
    """Call `fn(*args, **kwargs)` on `world_size` CPU ranks; return the per-rank return values.

    `fn` must be importable by name (a module-level function). Raises `DistributedTestError`
    with every failed rank's traceback if any rank raises, dies, or the run exceeds `timeout`.
    """
    from ..distributed import find_free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, kwargs, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                failures.setdefault(-1, f"timed out after {timeout:.0f}s")
                break
            if first_failure_at is not None and now - first_failure_at > grace:
                break
            try:
                rank, ok, value = results.get(timeout=0.5)
                (values if ok else failures)[rank] = value
                if not ok and first_failure_at is None:
                    first_failure_at = time.monotonic()
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if not proc.is_alive() and rank not in values and rank not in failures:
                        # give the queue a moment: the value may be in flight
                        try:
                            r, ok, value = results.get(timeout=2)
                            (values if ok else failures)[r] = value
                        except queue.Empty:
                            failures[rank] = f"rank {rank} died with exit code {proc.exitcode}"
                        if first_failure_at is None and failures:
                            first_failure_at = time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    if failures:
        report = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(failures.items()))
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    import torch

    return [torch.load(io.BytesIO(values[r]), weights_only=False) for r in range(world_size)]


def reported_by_every_rank(message: str, world_size: int) -> bool:
    """Whether an agreed error (`all_ranks_agree_ok`) names the failure of every rank."""
    return "all ranks:" in message or all(f"rank {r}" in message for r in range(world_size))
