"""Stopping a run cleanly: Ctrl-C, a scheduler's SIGTERM, or the launcher's stop file make every
rank stop after the same step, save a checkpoint and exit, so the same command resumes.

The trainer polls once per step:

    stop = StopRequest()
    for step in ...:
        ...
        if stop.requested():   # agreed: every rank sees the same answer at the same step
            break
    ...                        # the usual final save
    stop.finish(step, total, checkpoint)

A stop asked for before the first step (while the model loads, say) ends the run there: nothing
is trained and nothing saved. A first SIGINT / SIGTERM only sets a flag (a signal arrives on one
rank, or on the launcher, while the others are inside collectives: stopping there would leave them
waiting). A second
signal, when a stop is already under way, gets the signal's default action at once: the save is
skipped, and the checkpoint package's atomic commit keeps the half-written one from counting.

`fullshard train` runs the ranks in their own sessions (torchrun's), so a terminal's Ctrl-C reaches
only the launcher; it asks for the stop through the file named by `FULLSHARD_STOP_FILE` and kills
the ranks if they have not finished within `checkpoint.on_stop_timeout_s`.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import STOP_ASKED, get_rank
from ..log import log_rank0

STOP_FILE_ENV = "FULLSHARD_STOP_FILE"
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A stop asked for by a signal to this process or by the stop file; see the module docstring."""

    def __init__(self, stop_file: str | os.PathLike | None = None, install: bool = True) -> None:
        stop_file = stop_file or os.environ.get(STOP_FILE_ENV)
        self.stop_file = Path(stop_file) if stop_file else None
        self.signal: int | None = None
        self.stopped = False
        self._previous: dict[int, object] = {}
        if install and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        # a second signal, or one while the stop file exists (the launcher escalating): no save, the
        # signal's usual effect now
        if self.local():
            self.restore()
            signal.raise_signal(signum)
            return
        self.signal = signum
        STOP_ASKED.set()

    def local(self) -> bool:
        """Whether this process was asked to stop (no communication)."""
        return self.signal is not None or (self.stop_file is not None and self.stop_file.exists())

    def requested(self) -> bool:
        """Whether any rank was asked to stop: one tiny all-reduce, so all ranks break at the same step."""
        flag = torch.tensor([int(self.local())], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a CPU tensor: the gloo side of the process group
        self.stopped = self.stopped or bool(flag.item())
        if self.stopped and self.signal is None:
            self.signal = signal.SIGTERM  # from here on a signal to this rank means "now"
        return self.stopped

    def finish(self, step: int, total: int, checkpoint: str | os.PathLike | None, before_start: bool = False) -> None:
        """Restore the signal handlers and, after a stop, say in one line where the run stopped."""
        self.restore()
        if self.stopped and before_start:
            log_rank0(f"stopped before the first step (step {step} of {total}): nothing trained, nothing saved")
        elif self.stopped and get_rank() == 0:
            where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint was written"
            log_rank0(f"stopped at step {step} of {total}; {where}; run the same command to resume")

    def restore(self) -> None:
        """Put back the signal handlers this request replaced; the process-wide stop flag goes with them
        (a later run in the same process, a test's or a notebook's, starts unstopped)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        STOP_ASKED.clear()
