"""Where a checkpoint lives: a local directory or a Hub id, and which weight files it holds.

A Hub id is downloaded once per node: the first local rank fetches the snapshot while the
others wait, then every rank resolves the same snapshot from the local cache. Offline mode and
an already-cached snapshot therefore need no network at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..distributed import all_ranks_agree_ok, get_local_rank
from ..errors import HubUnreachableError, LoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# config and tokenizer files are small and wanted beside the weights; the weights come in a second
# pass, .bin only when the repository has no safetensors
METADATA_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken"]


@dataclass
class CheckpointFiles:
    """The weight files of one checkpoint directory and which file holds each key (when indexed)."""

    directory: Path
    format: str  # "safetensors" or "bin"
    files: list[Path]
    weight_map: dict[str, Path] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def resolve_checkpoint_dir(name_or_path: str | os.PathLike, revision: str | None = None,
                           cache_dir: str | os.PathLike | None = None) -> Path:
    """A local directory for `name_or_path`, downloading a Hub id on the first local rank of each node.

    Called on every rank; failures are raised on every rank together.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoadError(f"checkpoint path {str(path)!r} is a file; pass the directory that holds it")
    repo_id = str(name_or_path)
    downloader = get_local_rank() == 0
    result, error, unreachable = None, "", False
    if downloader:
        result, error, unreachable = _snapshot(repo_id, revision, cache_dir, local_files_only=False)
    # the others wait here until the download is done (or failed)
    all_ranks_agree_ok(error == "", error, HubUnreachableError if unreachable else LoadError)
    if not downloader:
        result, error, unreachable = _snapshot(repo_id, revision, cache_dir, local_files_only=True)
    all_ranks_agree_ok(error == "", error, LoadError)
    return result


def _snapshot(repo_id: str, revision: str | None, cache_dir,
              local_files_only: bool) -> tuple[Path | None, str, bool]:
    """(directory, "", False), or (None, what went wrong, whether it is that the Hub cannot be
    reached: the client's own connection error is no news to the user, and is left out)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fetch(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns,
                                      local_files_only=local_files_only))

    try:
        directory = fetch([*METADATA_PATTERNS, "*.safetensors"])
        if not any(directory.glob("*.safetensors")):
            directory = fetch([*METADATA_PATTERNS, "*.bin"])
        return directory, "", False
    except LocalEntryNotFoundError:  # not cached, and the Hub not asked (offline) or not answering
        if local_files_only:
            return None, f"{repo_id!r} is not a local directory and not in the local cache", False
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        return None, (f"{repo_id!r} is not a local directory, not in the local cache, and the Hub is "
                      f"unreachable{offline}"), True
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        where = "in the local cache (offline)" if local_files_only else "on the Hub or in the local cache"
        return None, (f"{repo_id!r} is not a local directory and could not be found {where}: "
                      f"{type(exc).__name__}: {exc}"), False


def find_checkpoint_files(directory: str | os.PathLike) -> CheckpointFiles:
    """The weight files of a checkpoint directory: safetensors (indexed or single) first, then .bin."""
    directory = Path(directory)
    for index_name, fmt in ((SAFETENSORS_INDEX, "safetensors"), (BIN_INDEX, "bin")):
        index = directory / index_name
        if index.is_file():
            return _from_index(index, fmt)
    single = directory / SAFETENSORS_SINGLE
    if single.is_file():
        return CheckpointFiles(directory, "safetensors", [single])
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return CheckpointFiles(directory, "safetensors", others)
    single = directory / BIN_SINGLE
    if single.is_file():
        return CheckpointFiles(directory, "bin", [single])
    raise LoadError(
        f"no weights in {str(directory)!r}: looked for {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, *.safetensors, "
        f"{BIN_INDEX} and {BIN_SINGLE}"
    )


def _from_index(index: Path, fmt: str) -> CheckpointFiles:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"index {str(index)!r} is unreadable: {type(exc).__name__}: {exc}") from None
    paths = {name: index.parent / name for name in sorted(set(weight_map.values()))}
    absent = [str(p) for p in paths.values() if not p.is_file()]
    if absent:
        raise LoadError(f"index {str(index)!r} names files that do not exist: {absent}")
    return CheckpointFiles(index.parent, fmt, list(paths.values()), {k: paths[v] for k, v in weight_map.items()})
