"""Starting, stopping and reporting the ranks of `fullshard train`.

The launcher is torchrun's parent: it starts torchrun (quietened, see `agent_main`) in a session
of its own, so a terminal's Ctrl-C reaches only the launcher, which then decides for everyone:

- first SIGINT / SIGTERM: write the stop file the ranks poll once per step (`train.stop`); they
  stop after the same step, save, and exit; the launcher waits `stop_timeout_s` for that;
- second signal, or the wait ran out: SIGTERM to torchrun, which passes it to the ranks (a second
  signal for them: they exit at once) and kills what is left after a short grace;
- whatever ends the launcher, `kill -9` included, ends torchrun and the ranks with it: torchrun
  and every rank ask Linux to kill them when their parent dies (`die_with_parent`), so nothing
  trains on into a directory whose lock (`train.rundir`) its holder no longer holds;
- a rank that fails writes its traceback to `<output_dir>/logs/rank<N>.log` and its message, with
  the time, to `rank<N>.error` (`run_rank`); the launcher prints one `fullshard: error:` line, the
  first failure by time naming its rank (the others' knock-on errors, such as a peer's closed
  connection, stay in the logs), and every traceback with `--debug` or FULLSHARD_DEBUG=1.
  torchrun's own failure report is not shown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .errors import FullshardError

LAUNCHED_ENV = "FULLSHARD_LAUNCHED"  # set for ranks started here: the launcher reports their errors
LOG_DIR_ENV = "FULLSHARD_LOG_DIR"
PARENT_PID_ENV = "FULLSHARD_PARENT_PID"  # the process torchrun, then each rank, must die with
DEBUG_ENV = "FULLSHARD_DEBUG"
KILL_GRACE_S = 15.0


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def error_line(message: str) -> str:
    return f"fullshard: error: {message}"


def describe(exc: BaseException) -> str:
    """A FullshardError already names what is wrong; anything else is a bug or a library's error."""
    text = " ".join(str(exc).split())  # one line, however the message was wrapped
    return text if isinstance(exc, FullshardError) else f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------------------------------------- ranks


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, whatever killed it. The parent the
    launcher meant (`PARENT_PID_ENV`) may already be gone by the time this runs (the imports before
    it take seconds): then this process was reparented and dies now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: torchrun's own shutdown still ends the ranks on a signal
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGKILL)


def run_rank(fn, log_dir: str | os.PathLike, debug: bool = False) -> int:
    """Run `fn` as one rank: 0 when it returns; on failure the traceback goes to
    `log_dir/rank<N>.log` and the one-line message to `rank<N>.error`, and 1 is returned.
    Outside our launcher (plain torchrun) the rank prints the line itself."""
    rank = os.environ.get("RANK", "0")
    try:
        fn()
        _close_process_groups(after_failure=False)
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C under plain torchrun: stop now, quietly
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the bugs' tracebacks logged
        message, log = describe(exc), Path(log_dir) / f"rank{rank}.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            failed_ns = time.time_ns()  # before the traceback is written: peers' knock-on errors come later
            log.write_text(traceback.format_exc())
            (log.parent / f"rank{rank}.error").write_text(json.dumps({"time_ns": failed_ns, "message": message}))
        except OSError:
            log = None  # the output directory itself is the problem; the message still reaches the user
        if os.environ.get(LAUNCHED_ENV) == "1" and log is not None:
            return 1  # the launcher prints the line (and, with --debug, these tracebacks)
        if debug_enabled(debug):
            traceback.print_exc()
        where = f" (traceback: {log})" if log else ""
        print(error_line(f"rank {rank}: {message}{where}"), file=sys.stderr, flush=True)
        return 1
    finally:
        _close_process_groups(after_failure=True)


def _close_process_groups(after_failure: bool) -> None:
    """Destroy the process groups before the interpreter exits (`distributed.close_process_groups`
    says why: a rank could die in C++'s terminate after a run that succeeded). After a failure
    with an async save pending, destroying would first wait on peers that may be gone: the exit
    handler reports that save instead."""
    from .checkpoint.async_exit import saves_pending
    from .distributed import close_process_groups

    if after_failure and saves_pending():
        return
    try:
        close_process_groups(drain=not after_failure)
    except Exception:  # noqa: BLE001 - the run's outcome is already decided; exit with it
        pass


# ---------------------------------------------------------------------------------------------- launcher


def launch(nproc: int, rank_args: list[str], log_dir: str | os.PathLike, stop_timeout_s: float,
           debug: bool = False, lock_file: str | os.PathLike | None = None) -> int:
    """Run `fullshard.cli <rank_args>` on `nproc` local ranks under torchrun; see the module docstring.
    `lock_file`: the run directory's lock, held by the caller for the ranks. Returns the exit status
    for the command line."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*log_dir.glob("rank*.error"), *log_dir.glob("rank*.log"), log_dir / "stop"]:
        stale.unlink(missing_ok=True)
    from .train.stop import STOP_FILE_ENV

    stop_file = log_dir / "stop"
    from .train.rundir import LOCK_HELD_ENV

    env = dict(os.environ, **{LAUNCHED_ENV: "1", LOG_DIR_ENV: str(log_dir), STOP_FILE_ENV: str(stop_file),
                              PARENT_PID_ENV: str(os.getpid())})
    if lock_file is not None:
        env[LOCK_HELD_ENV] = str(lock_file)
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "fullshard.launch", "--standalone", f"--nproc_per_node={nproc}",
               f"--shutdown_timeout={int(KILL_GRACE_S)}", "-m", "fullshard.cli", *rank_args]
    print(f"[fullshard] launching {nproc} process{'es' if nproc > 1 else ''}: torchrun --standalone "
          f"--nproc_per_node={nproc} -m fullshard.cli {' '.join(rank_args)}", flush=True)
    agent, received = _supervise(command, env, stop_file, stop_timeout_s)
    if received:
        if agent.returncode != 0:  # killed before they could save: say so, in one line
            print("[fullshard] stopped at once, without a new checkpoint; the same command resumes from the "
                  "last complete one", file=sys.stderr, flush=True)
        return 128 + received
    if agent.returncode != 0:
        print(error_line(_failure_message(log_dir, agent.returncode, debug)), file=sys.stderr, flush=True)
        return 1
    return 0


def _supervise(command: list[str], env: dict, stop_file: Path, stop_timeout_s: float) -> tuple[subprocess.Popen, int]:
    """Start torchrun and wait for it, turning the launcher's signals into a stop; returns it and
    the first signal's number (0: none). The handlers are in place before torchrun exists."""
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = terminated = killed = None
    try:
        agent = subprocess.Popen(command, env=env, start_new_session=True)
        while agent.poll() is None:
            if signals and deadline is None:
                stop_file.write_text(str(signals[0]))
                deadline = time.monotonic() + stop_timeout_s
                print(f"[fullshard] stopping: the ranks finish this step and save (up to {stop_timeout_s:g} s); "
                      "interrupt again to stop at once", file=sys.stderr, flush=True)
            now = time.monotonic()
            if deadline is not None and terminated is None and (len(signals) > 1 or now > deadline):
                agent.send_signal(signal.SIGTERM)  # torchrun passes it on, then kills after its grace
                terminated = now
            if terminated is not None and killed is None and now > terminated + 2 * KILL_GRACE_S:
                os.killpg(agent.pid, signal.SIGKILL)  # the ranks die with it (die_with_parent)
                killed = now
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return agent, signals[0] if signals else 0


def _failure_message(log_dir: Path, returncode: int, debug: bool) -> str:
    """The first failure by time, naming its rank unless every rank that failed said the same
    (an agreed error names its ranks itself), pointing at every rank's traceback."""
    failures = sorted(_read_failure(p) for p in log_dir.glob("rank*.error"))
    if debug_enabled(debug):
        for log in sorted(log_dir.glob("rank*.log")):
            print(f"----- {log}\n{log.read_text()}", file=sys.stderr)
    if not failures:
        return f"the ranks failed (torchrun exit status {returncode}) without a message"
    _, rank, message = failures[0]
    if len(failures) == 1 or len({m for *_, m in failures}) > 1:
        message = f"rank {rank}: {message}"
    return f"{message} (every rank's traceback: {log_dir}/rank*.log)"


def _read_failure(path: Path) -> tuple[int, int, str]:
    """(time_ns, rank, message) of a `rank<N>.error` file (`run_rank`)."""
    rank, text = int(path.stem[4:]), path.read_text()
    try:
        record = json.loads(text)
        return int(record["time_ns"]), rank, str(record["message"])
    except (ValueError, KeyError, TypeError):
        return path.stat().st_mtime_ns, rank, text.strip()


# ---------------------------------------------------------------------------------------------- torchrun


def agent_main(argv: list[str]) -> int:
    """torchrun with its failure report and shutdown warnings silenced: the launcher reports instead."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    die_with_parent()  # the launcher's death, even by SIGKILL, ends torchrun and so every rank
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # what each rank checks its parent against
    # elastic's loggers set their own level when created (at import): quieten each one
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
        return 0
    except ChildFailedError:
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
