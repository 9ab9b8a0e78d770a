"""One run per directory: the run that holds `train.output_dir`, the run whose checkpoints it keeps,
and write access to everything a run writes, all settled before a rank starts.

The rules, as the README states them:

- **One live run.** A run holds `<output_dir>/.fullshard-lock` (host, PID, start time, and an
  exclusive `flock` on the file while it lives). A second run into the same directory is refused,
  naming that host and PID. A lock whose holder is gone (same host: its `flock` was released or its
  PID no longer exists) is taken over with a warning; one naming another host is left to the user.
  `fullshard train` takes it in the launcher (its ranks are told so through `LOCK_HELD_ENV`); under
  plain torchrun, on any number of nodes, global rank 0 takes it for the whole job.
- **One run's checkpoints.** `checkpoint.resume: auto` continues the run whose checkpoints the
  directory holds (its newest complete one). A run that would start something else there
  (`resume: none`, or a checkpoint from elsewhere, or an older step than the newest) is refused
  before launch, unless `checkpoint.overwrite: true`, which deletes the old run first: its
  checkpoint directory leaves in one rename (after it, nothing of the old run can be resumed),
  then its export, metrics, plot and precomputed reference log-probs.
- **A restarted run is the same run.** Under `torchrun --max-restarts`, workers restarted after a
  failure find the checkpoints their own run wrote; each checkpoint names its run (`run_identity`:
  torchrun's run id, kept over restarts), so a restart continues them (its newest one), whatever
  `checkpoint.resume` says, instead of being refused as another run or deleting them.
- **Writable outputs.** Every directory a run writes (or, where it does not exist yet, the parent
  it will be made in) takes a probe file before launch, so a read-only `checkpoint.dir` is one line
  naming the key, not a run lost at its first save.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint import layout
from ..errors import CheckpointError, ConfigError
from ..log import warn_rank0

LOCK_FILE = ".fullshard-lock"
LOCK_HELD_ENV = "FULLSHARD_RUN_LOCK"  # the lock file the launcher holds for its ranks
REFERENCE_DIR = "reference"  # preference.reference=precompute: the table the run trains against
RUN_FILES = ("hf", "adapter", "tensorboard", "metrics.jsonl", "loss.png", REFERENCE_DIR)  # besides the checkpoints


# ---------------------------------------------------------------------------------------------- the lock


class RunLock:
    """The lock of one output directory; `with RunLock(dir):` holds it for the block."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, exclusive = self._open_locked()
        try:
            holder = _read_holder(self.path)
            if holder:
                self._check_holder(holder, exclusive)
            me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _open_locked(self) -> tuple[int, bool]:
        """The lock file, open and `flock`ed; (fd, False) where the file system has no flock."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(self._in_use(_read_holder(self.path) or {"host": "?", "pid": "?"})) from None
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                return fd, False  # the host and PID in the file decide alone
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    return fd, True
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder released (removed) the file between our open and our flock: again

    def _check_holder(self, holder: dict, exclusive: bool) -> None:
        """A lock file naming a run: refused while that run may live, taken over when it is gone."""
        same_host = holder.get("host") == socket.gethostname()
        if not same_host or (not exclusive and _alive(holder.get("pid"))):
            gone = "" if same_host else f"; if that run is gone, delete {self.path}"
            raise ConfigError(self._in_use(holder) + gone)
        warn_rank0(f"{self.path.parent}: taking over the lock of a run that is gone (host {holder.get('host')}, "
                   f"PID {holder.get('pid')})")

    def _in_use(self, holder: dict) -> str:
        return (f"train.output_dir={str(self.path.parent)!r} is in use by another run (host {holder.get('host')}, "
                f"PID {holder.get('pid')}, since {holder.get('since', '?')}): wait for it or stop it, or write to "
                "another train.output_dir")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's process, or a file we cannot read: assume it lives
    return True


def lock_for_this_process(output_dir: Path) -> RunLock | None:
    """The lock a job must take itself: none under `fullshard train`, whose launcher holds it.
    Only global rank 0 acquires it, for every rank of the job."""
    held = os.environ.get(LOCK_HELD_ENV)
    if held and Path(held).resolve() == (output_dir / LOCK_FILE).resolve():
        return None
    return RunLock(output_dir)


# ---------------------------------------------------------------------------------------------- the run's checkpoints


def run_identity() -> str | None:
    """This run, the same over torchrun's restarts of its workers: torchrun's run id (a fresh one per
    `--standalone` job, the `--rdzv-id` given otherwise), or, where it is torchrun's default "none",
    the agent process that restarts them (host and PID). None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    return run_id if run_id not in ("", "none") else f"{socket.gethostname()}:{os.getppid()}"


def written_by_this_run(checkpoint: Path) -> bool:
    """Whether `checkpoint` was saved by this very run, before torchrun restarted its workers."""
    me = run_identity()
    if me is None:
        return False
    try:
        saved = layout.read_json(checkpoint / layout.TRAINER_STATE).get("extra_state", {}).get("run")
    except (CheckpointError, AttributeError):
        return False
    return saved == me


def claim_run_directory(config) -> str:
    """Enforce "one run's checkpoints per directory" for `config` (see the module docstring);
    with `checkpoint.overwrite`, delete the old run. Call it holding the lock. Returns the
    `checkpoint.resume` to follow: "auto" for workers torchrun restarted, whose run wrote the
    directory's checkpoints, else the config's."""
    save_dir, resume = config.checkpoint_dir, config.checkpoint.resume
    for debris in config.output_dir.glob(f"{layout.TRASH_PREFIX}*"):  # an overwrite that was killed midway
        shutil.rmtree(debris, ignore_errors=True) if debris.is_dir() else debris.unlink(missing_ok=True)
    layout.finish_interrupted(save_dir)
    existing = layout.complete_checkpoints(save_dir)
    if not existing or resume == "auto":
        return resume
    newest = existing[0]
    if written_by_this_run(newest):
        warn_rank0(f"{newest} was saved by this run before torchrun restarted its workers: resuming it")
        return "auto"
    key = "checkpoint.dir" if config.checkpoint.dir else "train.output_dir"
    where = f"{key}={config.checkpoint.dir or config.train.output_dir!r}"
    if resume != "none":
        try:
            resumed = layout.resolve_checkpoint(resume).resolve()
        except CheckpointError:
            return resume  # preflight names it
        if resumed == newest.resolve():
            return resume  # continuing the run the directory holds
        if resumed.parent == save_dir.resolve():
            raise ConfigError(f"checkpoint.resume={resume!r} is an older step of the run in {save_dir}, whose newest "
                              f"checkpoint is {newest}: resuming it there would mix two runs' checkpoints; copy it "
                              "out and resume it into another train.output_dir, or use checkpoint.resume=auto")
    if not config.checkpoint.overwrite:
        starts = ("checkpoint.resume=none starts a new run" if resume == "none"
                  else f"checkpoint.resume={resume!r} starts a new run from another checkpoint")
        raise ConfigError(f"{where} holds the checkpoints of another run (newest: {newest}) and {starts}: continue it "
                          "with checkpoint.resume=auto, write to another train.output_dir, or set "
                          "checkpoint.overwrite=true to delete that run first")
    remove_run(save_dir, config.output_dir)
    warn_rank0(f"checkpoint.overwrite: deleted the previous run in {config.output_dir} (its newest checkpoint was "
               f"{newest.name})")
    return resume


def remove_run(save_dir: Path, output_dir: Path) -> None:
    """Delete a run: its checkpoint directory first, in one rename (from then on nothing of it can be
    resumed), then its export, metrics and plot; each renamed out of sight before it is deleted."""
    trash = []
    for path in (save_dir, *(output_dir / name for name in RUN_FILES)):
        if path.exists():
            hidden = path.parent / f"{layout.TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, hidden)
            trash.append(hidden)
    layout.fsync_dir(save_dir.parent)
    for hidden in trash:
        shutil.rmtree(hidden, ignore_errors=True) if hidden.is_dir() else hidden.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- write access


@contextmanager
def made_only_if_accepted(directory: Path):
    """The directories of `directory`'s path that do not exist yet are removed again if the block
    raises (a run refused under the lock), each only while empty: a refused run leaves nothing."""
    missing = [p for p in (directory.absolute(), *directory.absolute().parents) if not p.exists()]
    try:
        yield
    except BaseException:
        for path in missing:  # deepest first
            try:
                path.rmdir()
            except OSError:
                break
        raise



def output_paths(config) -> list[tuple[str, Path]]:
    """(key, directory) for everything a run writes."""
    out = config.output_dir
    paths = [("train.output_dir", out), ("checkpoint.dir", config.checkpoint_dir), ("train.output_dir", out / "logs")]
    if config.checkpoint.export:
        paths.append(("checkpoint.export", out / "hf"))
    if config.lora.enabled and config.lora.save_adapter:
        paths.append(("lora.save_adapter", out / "adapter"))
    if config.data.cache_dir:
        paths.append(("data.cache_dir", Path(config.data.cache_dir)))
    return paths


def check_output_paths(config) -> None:
    """Each output directory takes a new file, or, where it does not exist yet, its nearest existing
    parent does (nothing is created for a run that is then refused): one `ConfigError` naming the
    key otherwise."""
    for key, path in output_paths(config):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}={str(path)!r} is an existing file, not a directory")
        existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file")
            fd, probe = tempfile.mkstemp(prefix=".fullshard-probe-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise ConfigError(f"{key}={str(path)!r} is not writable: {err.strerror or err}") from None
