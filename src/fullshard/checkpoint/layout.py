"""What a checkpoint directory holds and how to tell a complete one from the debris of a crash.

```
<save_dir>/<tag>/
    state/                  DCP shards (.distcp) + .metadata: "model.<fqn>", "optim.<...>"
    rng/rank_00000.pt       one file per rank (RNG cannot be resharded)
    trainer_state.json      step, world size, base seed, the caller's extra_state
    model_meta.json         class name, source dtype, state keys in order, tied aliases
    config.json, generation_config.json, scheduler.pt, scaler.pt   (when present)
    COMPLETE                written last, after every rank finished; no marker, no checkpoint
<save_dir>/.fullshard-tmp-*     a save in progress (or killed): never loaded, removed later
<save_dir>/.fullshard-trash-*   a checkpoint being deleted (renamed first, so it is never half-there)
```
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_DIR = "state"
RNG_DIR = "rng"
TRAINER_STATE = "trainer_state.json"
MODEL_META = "model_meta.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
COMPLETE = "COMPLETE"
LATEST = "latest"
TMP_PREFIX = ".fullshard-tmp-"
TRASH_PREFIX = ".fullshard-trash-"
FORMAT_VERSION = 1


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: not a fullshard checkpoint, or a damaged one") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the checkpoint is damaged") from None


def write_durably(path: Path, data: bytes | str) -> None:
    """Write and fsync, so a marker or index that exists also has its bytes on disk."""
    data = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


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


def complete_checkpoints(save_dir: Path) -> list[Path]:
    """Complete checkpoints under `save_dir`, newest commit first."""
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not is_complete(child):
            continue
        try:
            committed = int(read_json(child / COMPLETE)["time_ns"])
        except (ValueError, KeyError, FileNotFoundError):
            continue
        found.append((committed, child))
    return [path for _, path in sorted(found, reverse=True)]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint: `path` itself, or the newest one inside a save directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if is_complete(path):
        return path
    if (path / TRAINER_STATE).exists() or path.name.startswith(TMP_PREFIX):
        raise ValueError(f"{path} is an incomplete checkpoint (no {COMPLETE} marker): its save was interrupted")
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (no subdirectory with a {COMPLETE} marker)")
    return found[0]


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_storage_files(state_dir: Path, metadata) -> None:
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
            raise FileNotFoundError(f"shard file {file} is missing (the checkpoint index needs it)")
        have = file.stat().st_size
        if have < need:
            raise ValueError(f"shard file {file} is truncated: {have} bytes on disk, the checkpoint index needs {need}")


def read_dcp_metadata(state_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (state_dir / ".metadata").is_file():
        raise FileNotFoundError(f"{state_dir / '.metadata'} is missing: {state_dir.parent} is not a complete DCP checkpoint")
    return FileSystemReader(str(state_dir)).read_metadata()
