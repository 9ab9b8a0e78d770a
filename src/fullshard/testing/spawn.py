"""Run one function on N ranks in a single spawned process group: CPU and gloo unless asked for GPUs.

Starting a group is the expensive part of a distributed test (seconds per rank for the imports),
so a test hands one function many checks. A failure on any rank comes back with that rank's
traceback; ranks still waiting in a collective for the failed one are killed after a short grace
period, so nothing hangs. On a machine with GPUs the CPU ranks are not shown them, so the suite
does the same on any machine; a test that wants GPUs asks (`device="cuda"`) and is skipped where
there are fewer than it has ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    pass


# what hides every GPU from a CPU rank (CUDA and ROCm read these when they start, in the child)
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def _worker(rank: int, world_size: int, port: int, device: str, init: bool, fn: Callable, args: tuple, kwargs: dict,
            results) -> None:
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
        if init:
            from ..distributed import init_distributed

            init_distributed(device)
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


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600, grace: float = 20,
                    device: str = "cpu", init: bool = True, **kwargs: Any) -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank return values.

    `fn` must be importable by name (a module-level function). Ranks run on CPU with gloo and
    see no GPU; `device="cuda"` gives rank k GPU k (the test is skipped with fewer GPUs than
    ranks). `init=False` leaves starting the process group to `fn` (to test how it is started).
    Raises `DistributedTestError` with every failed rank's traceback if any rank raises, dies,
    or the run exceeds `timeout`.
    """
    from ..distributed import find_free_port

    if device != "cpu":
        _skip_without_devices(device, world_size)
    for attempt in range(2):
        try:
            return _spawn(fn, world_size, find_free_port(), device, init, args, kwargs, timeout, grace)
        except DistributedTestError as error:
            # the free port was taken by another process before rank 0's store bound it: `fn` ran on
            # no rank (the group starts before it), so running again on another port is safe
            if attempt or not init or "EADDRINUSE" not in str(error):
                raise


def _spawn(fn: Callable, world_size: int, port: int, device: str, init: bool, args: tuple, kwargs: dict,
           timeout: float, grace: float) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, device, init, fn, args, kwargs, results), daemon=True)
        for rank in range(world_size)
    ]
    with _environment(HIDE_GPUS if device == "cpu" else {}):  # a spawned child copies the environment at start
        for proc in procs:
            proc.start()
    try:
        values, failures = _collect(procs, results, timeout, grace)
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


def _collect(procs: list, results, timeout: float, grace: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Each rank's (serialised) value or failure, until all are in, `timeout` passes, or `grace`
    seconds after the first failure (ranks still waiting for the failed one then are killed)."""
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(values) + len(failures) < len(procs):
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
    return values, failures


def _skip_without_devices(device: str, world_size: int) -> None:
    import pytest
    import torch

    accelerator = torch.accelerator.current_accelerator()
    found = torch.accelerator.device_count() if accelerator is not None and accelerator.type == device else 0
    if found < world_size:
        pytest.skip(f"needs {world_size} {device} devices, this machine has {found}")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def reported_by_every_rank(message: str, world_size: int) -> bool:
    """Whether an agreed error (`all_ranks_agree_ok`) names the failure of every rank."""
    return "all ranks:" in message or all(f"rank {r}" in message for r in range(world_size))
