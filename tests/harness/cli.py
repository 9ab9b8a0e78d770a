"""`fullshard` command lines run in one spawned process group, through the command's own code.

A real launch costs a launcher, torchrun's agent and every rank's imports (about 20 s of CPU on
this suite's machine); the checks that need the launch itself (self-launch, signals, one-line
errors from inside the ranks, `make demo`) keep theirs. Everything else a command does runs here:
`fullshard.cli.main` on the first rank as in a shell (parsing, every check before launch, the
run directory), with `launch` recording the ranks' command line instead of starting torchrun; then
that line on every rank, as torchrun would run it (`main` under a launcher), the process group
kept for the next command.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from unittest import mock


def commands_in_group(work: str, argvs: list[list[str]]) -> list[dict]:
    """`fullshard <argv>` for each argv in turn, in directory `work`, on every rank of the group:
    {"code": exit status (the largest over the ranks), "launched": whether it started ranks,
    "output": what this rank printed and logged}. Stops after the first command that fails (the
    next ones may build on its run)."""
    import torch.distributed as dist

    from fullshard import cli, launch, log

    rank, world, out, cwd = dist.get_rank(), dist.get_world_size(), [], os.getcwd()
    os.chdir(work)
    try:
        for argv in argvs:
            printed, launched = io.StringIO(), []

            def record(nproc, rank_args, *args, **kwargs):
                if nproc != world:
                    raise AssertionError(f"the command launches {nproc} ranks; this group has {world}")
                launched.append(rank_args)
                return 0

            with _captured(printed):
                code = 0
                if rank == 0:
                    with mock.patch.object(cli, "under_launcher", lambda: False), \
                            mock.patch.object(cli, "launch", record):
                        code = cli.main(argv)
                shared = [(code, launched)]
                dist.broadcast_object_list(shared, src=0)
                code, launched = shared[0]
                if code == 0 and launched:
                    log._seen.clear()  # a message logged once per process is logged once per launch
                    with mock.patch.object(launch, "_close_process_groups", lambda after_failure: None):
                        code = cli.main(launched[0])
                    codes = [None] * world
                    dist.all_gather_object(codes, code)
                    code = max(codes)
            out.append({"code": code, "launched": bool(launched), "output": printed.getvalue()})
            if code:
                break
    finally:
        os.chdir(cwd)
    return out


@contextlib.contextmanager
def _captured(sink: io.StringIO):
    """stdout, stderr and fullshard's log (whose handler holds the stream it was made with) into `sink`."""
    from fullshard import log

    handler = logging.StreamHandler(sink)
    log._ensure_handler()
    log.logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        log.logger.removeHandler(handler)
