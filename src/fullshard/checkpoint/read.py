"""Reading a checkpoint's DCP state without running code from it, and with one named error.

Everything goes through `fullshard.safe_dcp` (metadata through a restricted unpickler, byte
entries with `weights_only=True`). DCP reports a failure on any rank as a `CheckpointException`
(a BaseException holding every rank's traceback); it is turned back into one `UnreadableCheckpoint`
naming the checkpoint and the file, raised on every rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from ..errors import CheckpointError
from ..safe_dcp import SafeFileSystemReader, SafeLoadPlanner, load_pt, read_dcp_metadata
from . import checksums, layout


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (missing, truncated, corrupt or refused), as opposed to
    one that reads fine but does not fit the model: `auto` resume falls back past the former only."""


class _IndexedReader(SafeFileSystemReader):
    """A safe reader that reads the index once, however many loads it serves (export reads tensor by tensor)."""

    def __init__(self, state_dir: Path, metadata) -> None:
        super().__init__(state_dir, UnreadableCheckpoint)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class CheckpointReader:
    """The DCP state of one checkpoint: its index, checked against the shard files, and `read` into
    a state dict. Every rank plans and reads its own chunks (DCP's `no_dist`): DCP's load plan
    needs no coordination (each rank's reads follow from the index alone), so the collective
    exchange of plans and the gather after reading are skipped; callers agree on failure."""

    def __init__(self, checkpoint: Path, share: tuple[int, int] | None = (0, 1)) -> None:
        """`share` (index, count): this process checks every `count`-th of the checkpoint's files
        against their recorded sums (`checksums.verify`), the others' share checked by the other
        ranks reading it; None checks none (the index alone is wanted)."""
        self.checkpoint = checkpoint
        self.state_dir = checkpoint / layout.STATE_DIR
        if share is not None:
            checksums.verify(checkpoint, UnreadableCheckpoint, only_index=True)
        self.metadata = read_dcp_metadata(self.state_dir, UnreadableCheckpoint)
        layout.check_storage_files(self.state_dir, self.metadata, UnreadableCheckpoint)
        if share is not None:
            checksums.verify(checkpoint, UnreadableCheckpoint, share)
        self._reader = _IndexedReader(self.state_dir, self.metadata)

    def read(self, state: dict, partial: bool = False) -> None:
        """Read `state` in place; `partial` leaves keys the checkpoint lacks as they are (for state
        the caller has already judged optional)."""
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": per rank
                warnings.simplefilter("ignore", UserWarning)
                planner = SafeLoadPlanner(error_type=UnreadableCheckpoint, allow_partial_load=partial)
                dcp.load(state, storage_reader=self._reader, planner=planner, no_dist=True)
        except CheckpointException as err:
            raise UnreadableCheckpoint(f"reading checkpoint {self.checkpoint} failed: {failure_summary(err)}") from None
        except CheckpointError as err:
            raise type(err)(one_line(str(err))) from None
        except Exception as err:  # noqa: BLE001 - whatever DCP raised, name the checkpoint
            raise UnreadableCheckpoint(
                one_line(f"reading checkpoint {self.checkpoint} failed: {type(err).__name__}: {err}")
            ) from None


def read_side_file(path: Path):
    """A `.pt` side file (scheduler, RNG) through `safe_dcp.load_pt`: tensors and plain values only."""
    try:
        return load_pt(path, UnreadableCheckpoint)
    except UnreadableCheckpoint as err:
        raise UnreadableCheckpoint(one_line(str(err))) from None


def one_line(message: str) -> str:
    """The first line of an error, without torch's unpickling advice (a paragraph that ends in
    "re-run with weights_only=False": never the thing to do with a damaged or crafted file)."""
    lines = message.strip().splitlines()
    return (lines[0] if lines else "").split(" In PyTorch 2.6,", 1)[0].rstrip()


def failure_summary(err: CheckpointException) -> str:
    """The distinct messages of the ranks' failures, one each, labelled with their ranks."""
    by_message: dict[str, list[int]] = {}
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
        text = one_line(str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
        by_message.setdefault(text, []).append(rank)
    if len(by_message) == 1:
        return next(iter(by_message))
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {m}" for m, r in by_message.items())
