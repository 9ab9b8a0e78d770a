"""Run one function on N ranks in a single spawned process group: CPU and gloo unless asked for GPUs.

Starting a group is the expensive part of a distributed test (seconds per rank for the imports),
so a test hands one function many checks, and CPU ranks are forked from a server process that has
imported torch, transformers and fullshard once (multiprocessing's forkserver, preloaded): a rank
then starts in a fraction of a second instead of repeating those imports. Each rank still gets the
caller's environment as it is at the call, and `fresh=True` starts new interpreters instead (for
what a process reads only at its start, such as glibc's MALLOC_* settings).

A failure on any rank comes back with that rank's traceback; ranks still waiting in a collective
for the failed one are killed after a short grace period, so nothing hangs. On a machine with GPUs
the CPU ranks are not shown them, so the suite does the same on any machine; a test that wants
GPUs asks (`device="cuda"`) and is skipped where there are fewer than it has ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    pass


# what hides every GPU from a CPU rank (CUDA and ROCm read these when they start, in the child)
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
# imported once by the fork server, so the CPU ranks forked from it start with them; nothing here
# starts a thread or touches a device. transformers resolves its names on first use: its model base
# (modeling_utils, about 1 s of CPU), a model family's shared parts (through Llama's) and PEFT would
# otherwise be imported again by every rank that builds a model
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.distributed.pipelining", "transformers",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "peft", "fullshard",
           "fullshard.testing.zoo", "harness.compare", "fullshard.train.trainer", "fullshard.cli"]


def _context(device: str, fresh: bool):
    """Forked from the preloaded server for CPU ranks; new interpreters for GPUs (the server must
    never see a device) and where asked."""
    if device != "cpu" or fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first group)
    return ctx


def stop_fork_server() -> None:
    """Stop the preloaded server, if this process started one, and wait for it: the CPU time of the
    ranks it forked then counts among this process's children (the suite's total reports it)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


def _worker(rank: int, world_size: int, port: int, device: str, init: bool, fn: Callable, args: tuple, kwargs: dict,
            results, environment: dict | None = None, output: str | None = None) -> None:
    if environment is not None:  # the caller's, now: a forked rank would have the server's, from its start
        os.environ.clear()
        os.environ.update(environment)
    if output is not None:  # a forked rank's stdout and stderr are the server's: write where the caller reads
        sink = os.open(output, os.O_WRONLY | os.O_APPEND)
        for fd in (1, 2):
            os.dup2(sink, fd)
        os.close(sink)
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
                    device: str = "cpu", init: bool = True, fresh: bool = False, **kwargs: Any) -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank return values.

    `fn` must be importable by name (a module-level function). Ranks run on CPU with gloo and
    see no GPU; `device="cuda"` gives rank k GPU k (the test is skipped with fewer GPUs than
    ranks). `init=False` leaves starting the process group to `fn` (to test how it is started);
    `fresh=True` starts each rank as a new interpreter rather than a fork of the preloaded server.
    Raises `DistributedTestError` with every failed rank's traceback if any rank raises, dies,
    or the run exceeds `timeout`.
    """
    from ..distributed import find_free_port

    if device != "cpu":
        _skip_without_devices(device, world_size)
    for attempt in range(2):
        try:
            return _spawn(fn, world_size, find_free_port(), device, init, args, kwargs, timeout, grace, fresh)
        except DistributedTestError as error:
            # the free port was taken by another process before rank 0's store bound it: `fn` ran on
            # no rank (the group starts before it), so running again on another port is safe
            if attempt or not init or "EADDRINUSE" not in str(error):
                raise


def _spawn(fn: Callable, world_size: int, port: int, device: str, init: bool, args: tuple, kwargs: dict,
           timeout: float, grace: float, fresh: bool = False) -> list:
    ctx = _context(device, fresh)
    results = ctx.Queue()
    output = None
    if ctx.get_start_method() == "forkserver":
        handle, output = tempfile.mkstemp(prefix="fullshard-ranks-", suffix=".log")
        os.close(handle)
    with _environment(HIDE_GPUS if device == "cpu" else {}):  # a spawned child copies the environment at start
        environment = dict(os.environ)
        # not daemonic: a rank may start processes of its own, as torchrun's workers may (rollout
        # engines, `rl.engines`); the `finally` below kills and joins every rank however it ends
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, device, init, fn, args, kwargs, results,
                                              environment, output), daemon=False)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
    try:
        values, failures = _collect(procs, results, timeout, grace)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        if output is not None:  # what the ranks printed, into this process's (pytest's per-test capture)
            sys.stderr.write(Path(output).read_text(errors="replace"))
            os.unlink(output)
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
