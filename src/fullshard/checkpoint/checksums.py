"""A CRC32 of every file a checkpoint holds, recorded at commit and checked where it is read.

A shard overwritten in place at its own size passes every check of sizes and indexes, and DCP
reads whatever bytes are there (torch.load does not check its zip records' CRCs either): the
export then wrote NaN weights and reported success. `checksums.json` (written durably just before
`COMPLETE`) maps each file's path inside the checkpoint to its size and CRC32. The DCP shards' CRCs
are summed while DCP writes them (`SummingWriter`: no second read); side files, small, are read once
at commit. Readers verify before they read (`verify`), each rank a share of the files when several
read one checkpoint; a checkpoint saved without the file (older fullshard) reads unverified.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ..errors import CheckpointError
from . import layout

CHUNK = 8 * 2**20
CHECKSUMS = layout.CHECKSUMS


class _SummingStream:
    """A file opened for writing whose CRC32 and length follow every write; a seek (never done by
    DCP's writer today) makes the sum unknown, and the file is then read back once closed."""

    def __init__(self, raw) -> None:
        self._raw, self.crc, self.size, self.linear = raw, 0, 0, True

    def write(self, data) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view[:written] if written is not None else view, self.crc)
        self.size += len(view) if written is None else written
        return written

    def seek(self, *args):
        self.linear = False
        return self._raw.seek(*args)

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _SummingFileSystem(FileSystem):
    """DCP's local file system, summing each file it creates (by path, renames followed)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _SummingStream(raw)
            yield stream
        linear = (stream.size, stream.crc) if stream.linear else None
        self.sums[str(path)] = linear or file_checksum(Path(path))

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if str(path) in self.sums:
            self.sums[str(new_path)] = self.sums.pop(str(path))


class SummingWriter(FileSystemWriter):
    """DCP's `FileSystemWriter` that sums every file as it writes it. Each rank's shard sums travel
    to the coordinator in its write results (an attribute DCP's index never stores); the
    coordinator's `files` then holds every file of `state/` after `finish`."""

    def __init__(self, path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _SummingFileSystem()
        self.files: dict[str, tuple[int, int]] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # written by the time it returns
        for result in future.value():
            result.storage_data.fullshard_sum = self._sum_of(result.storage_data.relative_path)
        return future

    def _sum_of(self, relative_path: str) -> tuple[int, int]:
        return self.fs.sums[str(self.fs.concat_path(self.path, relative_path))]

    def finish(self, metadata, results) -> None:
        files = {}
        for result in (r for rank in results for r in rank):
            info = result.storage_data
            # the index keeps DCP's own fields only
            summed = info.__dict__.pop("fullshard_sum", None)
            if summed is not None:
                files[info.relative_path] = summed
        super().finish(metadata, results)
        files[".metadata"] = self._sum_of(".metadata")
        self.files = {f"{layout.STATE_DIR}/{name}": value for name, value in files.items()}


def file_checksum(path: Path) -> tuple[int, int]:
    """(size, CRC32) of a file, read in chunks into one buffer."""
    crc, size, buffer = 0, 0, bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            crc, size = zlib.crc32(view[:read], crc), size + read
    return size, crc


def write_manifest(checkpoint: Path, state_files: dict[str, tuple[int, int]]) -> None:
    """`checksums.json` for a checkpoint about to be marked complete: the DCP files' sums as they
    were written, every other file read and summed now (rank 0, after every rank has written)."""
    files = dict(state_files)
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            relative = (Path(directory) / name).relative_to(checkpoint).as_posix()
            if relative.startswith(f"{layout.STATE_DIR}/") or relative in (CHECKSUMS, layout.COMPLETE):
                continue
            files[relative] = file_checksum(Path(directory) / name)
    record = {"algorithm": "crc32", "files": {k: list(v) for k, v in sorted(files.items())}}
    layout.write_durably(checkpoint / layout.CHECKSUMS, json.dumps(record, indent=1))


def recorded(checkpoint: Path, error_type: type[Exception] = CheckpointError
             ) -> dict[str, tuple[int, int]] | None:
    """The sums a checkpoint recorded, or None for one saved without them."""
    if not (checkpoint / layout.CHECKSUMS).exists():
        return None
    record = layout.read_json(checkpoint / layout.CHECKSUMS, error_type)
    try:
        assert record["algorithm"] == "crc32"
        return {name: (int(size), int(crc)) for name, (size, crc) in record["files"].items()}
    except (AssertionError, KeyError, TypeError, ValueError):
        raise error_type(f"{checkpoint / layout.CHECKSUMS} is not a checksum record: "
                         "the checkpoint is damaged") from None


INDEX = f"{layout.STATE_DIR}/.metadata"


def verify(checkpoint: Path, error_type: type[Exception] = CheckpointError,
           share: tuple[int, int] = (0, 1), only_index: bool = False) -> None:
    """Check the recorded files of `checkpoint`: the `share[0]`-th of every `share[1]` files in name
    order, so ranks reading the same checkpoint each read a part (the DCP index, which every
    reader unpickles, is checked by each: `only_index`). A file missing, of another size or another
    CRC32 is one error naming it; a missing per-rank RNG file is not (its rank re-derives its RNG, as
    on a resume at another world size), while one that is there must hold its bytes."""
    files = recorded(checkpoint, error_type)
    if files is None:
        return
    names = [INDEX] if only_index and INDEX in files else [] if only_index else \
        [n for n in sorted(files) if n != INDEX][share[0]::share[1]]
    for name in names:
        size, crc = files[name]
        path = checkpoint / name
        try:
            actual = file_checksum(path)
        except FileNotFoundError:
            if name.startswith(f"{layout.RNG_DIR}/"):
                continue
            raise error_type(f"{path} is missing (the checkpoint's {CHECKSUMS} lists it)") from None
        except OSError as err:
            raise error_type(f"{path} is unreadable: {err}") from None
        if actual[0] < size:
            raise error_type(f"{path} is truncated: {actual[0]} bytes on disk, {size} when saved")
        if actual[0] != size:
            raise error_type(f"{path} has {actual[0]} bytes, {size} when it was saved: "
                             "the checkpoint is damaged")
        if actual[1] != crc:
            raise error_type(f"{path} does not hold the bytes it was saved with (CRC32 "
                             f"{actual[1]:08x}, saved {crc:08x}): the checkpoint is damaged "
                             "(overwritten or corrupted on disk)")
