"""What a checkpoint directory holds, how to tell a complete one from the debris of a crash, and
the one place that finishes a save a crash interrupted.

```
<save_dir>/<tag>/
    state/                  DCP shards (.distcp) + .metadata: "model.<fqn>", "optim.state.<fqn>.<key>",
                            "optim.param_groups.<fqn>.<key>", "states.<name>.<...>"
    rng/rank_00000.pt       one file per rank (RNG cannot be resharded)
    trainer_state.json      step, world size, base seed, the caller's extra_state
    model_meta.json         class name, source dtype, the export recipe (output name -> state key, LoRA merges)
    config.json, generation_config.json, scheduler.pt, adapter/, tokenizer/   (when present)
    checksums.json          size and CRC32 of every other file (`checksums`), written just before COMPLETE
    COMPLETE                written last, after every rank finished: {"step", "time_ns", "world_size"}
<save_dir>/.fullshard-tmp-<tag>-<id>     a save in progress (or killed); with COMPLETE: killed while committing
<save_dir>/.fullshard-trash-*            a checkpoint being deleted (renamed first, so it is never half-there)
```
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path

from ..errors import CheckpointError
from ..log import warn_rank0

STATE_DIR = "state"
RNG_DIR = "rng"
TRAINER_STATE = "trainer_state.json"
MODEL_META = "model_meta.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SCHEDULER = "scheduler.pt"
ADAPTER_DIR = "adapter"
TOKENIZER_DIR = "tokenizer"
COMPLETE = "COMPLETE"
CHECKSUMS = "checksums.json"
LATEST = "latest"
TMP_PREFIX = ".fullshard-tmp-"
TRASH_PREFIX = ".fullshard-trash-"
FORMAT_VERSION = 2


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def read_json(path: Path, error_type: type[Exception] = CheckpointError) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error_type(f"{path} is missing: not a fullshard checkpoint, or a damaged one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error_type(f"{path} is unreadable ({type(err).__name__}: {err}): the checkpoint is damaged") from None


def write_durably(path: Path, data: bytes | str) -> None:
    """Write and fsync, so a marker or index that exists also has its bytes on disk."""
    data = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_file(path: Path, data: bytes | str) -> None:
    """Write without fsync: a side file of a checkpoint in progress, made durable by
    `fsync_side_files` just before the checkpoint is marked complete."""
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def fsync_side_files(tmp: Path) -> None:
    """fsync every file of a checkpoint in progress that DCP did not write (DCP fsyncs its own
    shards and index), and their directories. Rank 0 does this for all ranks once every rank's
    files are closed, so the ranks' saves never wait on the disk for a few small files, and an
    async save does it after the background write instead of holding the training loop."""
    for directory, _, files in os.walk(tmp):
        if Path(directory).is_relative_to(tmp / STATE_DIR):
            continue
        for name in files:
            fd = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tag_of_temp(path: Path) -> str:
    """The tag a temporary directory `.fullshard-tmp-<tag>-<id>` is being saved as."""
    return path.name[len(TMP_PREFIX):].rsplit("-", 1)[0]


def discard(checkpoint: Path, background: bool = False) -> None:
    """Delete a checkpoint (or an export's replaced files) by renaming it out of sight first, so a
    crash mid-delete never leaves a marked directory with missing shards. `background` deletes the
    renamed files in a thread: a save need not wait for them, and the process waits for the thread
    at exit (it is not a daemon), so a clean exit leaves no trash; what a crash leaves beside
    checkpoints is removed by `remove_debris`."""
    trash = checkpoint.parent / f"{TRASH_PREFIX}{checkpoint.name}-{uuid.uuid4().hex[:8]}"
    os.rename(checkpoint, trash)
    if background:
        thread = threading.Thread(target=shutil.rmtree, args=(trash, True), name="fullshard-discard")
        thread.start()
        for done in [path for path, running in _discarding.items() if not running.is_alive()]:
            del _discarding[done]  # a long run rotates thousands of times: keep only the live ones
        _discarding[trash] = thread
    else:
        shutil.rmtree(trash, ignore_errors=True)


_discarding: dict[Path, threading.Thread] = {}  # trash being deleted by this process, in the background


def wait_for_discards() -> None:
    """Block until this process's background deletions are done."""
    while _discarding:
        _discarding.popitem()[1].join()


def commit_step(checkpoint: Path) -> tuple[int, int]:
    """(step, commit time) from the COMPLETE marker: what checkpoints are ordered by."""
    marker = read_json(checkpoint / COMPLETE)
    return int(marker.get("step", -1)), int(marker.get("time_ns", 0))


def finish_interrupted(save_dir: Path) -> None:
    """Finish every save a crash interrupted after its COMPLETE marker: the marked temporary
    directory replaces the checkpoint of its tag (the older one, whose discard the crash may or may
    not have reached). Every resolver calls this first, so `auto` resume, `load_ckpt(dir)`,
    `export_checkpoint(dir)` and `latest()` see the same checkpoints. Unmarked temporary directories
    are left alone: they may be a save still running (writers remove them, see `remove_debris`).
    """
    if not save_dir.is_dir():
        return
    for temp in sorted(save_dir.glob(TMP_PREFIX + "*")):
        if not temp.is_dir() or not is_complete(temp):
            continue
        final = save_dir / tag_of_temp(temp)
        try:
            if final.exists():
                discard(final)
            os.rename(temp, final)
            fsync_dir(save_dir)
        except OSError as err:
            raise CheckpointError(f"cannot finish the interrupted save {temp} as {final}: {err}") from None
        warn_rank0(f"finished checkpoint {final}: its save was interrupted after it was complete")


def remove_debris(save_dir: Path) -> None:
    """What only a writer of `save_dir` may do: remove unmarked temporary directories (saves that
    were killed) and half-deleted checkpoints."""
    finish_interrupted(save_dir)
    for child in sorted(save_dir.glob(".fullshard-*")):
        if child in _discarding and _discarding[child].is_alive():
            continue  # this process is deleting it
        if child.name.startswith(TMP_PREFIX) and child.is_dir():
            warn_rank0(f"removing incomplete checkpoint {child} (its save was interrupted)")
        if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def complete_checkpoints(save_dir: Path) -> list[Path]:
    """Complete checkpoints under `save_dir`, newest step first (commit time breaks ties)."""
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not is_complete(child):
            continue
        try:
            found.append((commit_step(child), child.name, child))
        except CheckpointError:
            continue
    return [path for *_, path in sorted(found, reverse=True)]


def checkpoints_at(path: str | os.PathLike) -> list[Path]:
    """The complete checkpoints `path` names, newest first: `path` itself when it is one, else the
    ones inside it as a save directory. Interrupted saves are finished first (`finish_interrupted`),
    also when `path` is the checkpoint such a save was about to become."""
    path = Path(path)
    if path.name.startswith(TMP_PREFIX) and is_complete(path):
        path = path.parent / tag_of_temp(path)
    finish_interrupted(path.parent)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if is_complete(path):
        return [path]
    if (path / TRAINER_STATE).exists() or path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no {COMPLETE} marker): its save was interrupted")
    finish_interrupted(path)
    return complete_checkpoints(path)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint: `path` itself, or the newest one inside a save directory."""
    found = checkpoints_at(path)
    if not found:
        raise CheckpointError(f"{path} holds no complete checkpoint (no subdirectory with a {COMPLETE} marker)")
    return found[0]


def resolve_run_checkpoint(path: str | os.PathLike) -> Path:
    """`resolve_checkpoint`, also given a run's output directory (its newest checkpoint under
    `checkpoints/`, where `fullshard train` writes them)."""
    run_checkpoints = Path(path) / "checkpoints"
    if Path(path).is_dir() and not is_complete(Path(path)) and not complete_checkpoints(Path(path)) \
            and run_checkpoints.is_dir():
        return resolve_checkpoint(run_checkpoints)
    return resolve_checkpoint(path)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_storage_files(state_dir: Path, metadata, error_type: type[Exception] = CheckpointError) -> None:
    """Every shard file the DCP index points into exists and is long enough.

    DCP itself reports a truncated file as a bare unpickling or EOF error from deep inside a
    read; this names the file and the bytes missing before anything is read.
    """
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, need in sorted(needed.items()):
        file = state_dir / relative
        if not file.is_file():
            raise error_type(f"shard file {file} is missing (the checkpoint index needs it)")
        have = file.stat().st_size
        if have < need:
            raise error_type(f"shard file {file} is truncated: {have} bytes on disk, the checkpoint index needs {need}")


def index_gaps(metadata) -> list[str]:
    """Tensors of a DCP index whose saved chunks do not cover the whole tensor: what an index written
    by one rank alone (DCP falls back to a one-process save once the process group is gone) lacks."""
    import math

    gaps = []
    for key, item in metadata.state_dict_metadata.items():
        if hasattr(item, "chunks"):
            covered = sum(math.prod(chunk.sizes) for chunk in item.chunks)
            if covered != math.prod(item.size):
                gaps.append(f"{key} ({covered} of {math.prod(item.size)} elements)")
    return gaps
