"""safetensors files (one or an indexed set), memory-mapped and handed out as zero-copy views.

The format is an 8-byte header length, a JSON header (dtype, shape, byte offsets of each tensor)
and the raw bytes. The header is parsed and checked here (a corrupt or truncated file fails
before any copy); the data is mapped copy-on-write, so a view of rows `a:b` of a tensor touches
only those pages and a `copy_` from it into a shard is the only copy made.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from ..dtypes import SAFETENSORS_DTYPES
from ..errors import LoadError
from .readers import TensorInfo, TensorReader

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class SafetensorsReader(TensorReader):
    """Parses every file's header up front, so a corrupt or truncated file fails before any copy."""

    def __init__(self, files: list[Path], weight_map: dict[str, Path] | None = None) -> None:
        super().__init__()
        self._maps: dict[Path, mmap.mmap] = {}
        self._offsets: dict[str, int] = {}
        for path in files:
            entries, data_start = _read_header(path)
            for key, (dtype, shape, begin) in entries.items():
                if key in self.infos:
                    raise LoadError(f"key {key!r} is stored twice: in {str(self.infos[key].file)!r} and {str(path)!r}")
                self.infos[key] = TensorInfo(shape, dtype, path)
                self._offsets[key] = data_start + begin
            self._maps[path] = _map(path)
        if weight_map:
            wrong = sorted(k for k, f in weight_map.items() if k not in self.infos or self.infos[k].file != f)
            if wrong:
                details = [f"{k} (index: {weight_map[k].name}, found in: "
                           f"{self.infos[k].file.name if k in self.infos else 'no file'})" for k in wrong[:10]]
                raise LoadError(f"the index of {str(next(iter(weight_map.values())).parent)!r} does not match "
                                f"its files for {len(wrong)} keys: {details}")

    def view(self, key: str) -> torch.Tensor:
        info = self.infos[key]
        count = math.prod(info.shape)
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(self._maps[info.file], dtype=info.dtype, count=count, offset=self._offsets[key])
        return flat.view(info.shape)

    def close(self) -> None:
        self._maps.clear()  # views still alive keep their mapping open until they go


def _read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int]], int]:
    """key -> (dtype, shape, offset in the data section), and where the data section starts."""
    def corrupt(why: str) -> LoadError:
        return LoadError(f"safetensors file {str(path)!r} is corrupt or truncated: {why}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0] if size >= 8 else size
            if size < 8 or length > min(MAX_HEADER, size - 8):
                raise corrupt(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise corrupt(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    data_size = size - 8 - length
    entries = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise corrupt(f"entry {key!r} is malformed: {exc}") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise LoadError(f"key {key!r} in {str(path)!r} has unsupported dtype {dtype_name}")
        if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= data_size:
            raise corrupt(f"{key!r} claims bytes {begin}:{end} for shape {list(shape)} {dtype_name}, "
                          f"the data section has {data_size}")
        entries[key] = (dtype, shape, begin)
    return entries, 8 + length


def _map(path: Path) -> mmap.mmap:
    """The whole file, mapped copy-on-write: writable for `torch.frombuffer`, never written."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
