"""What every weight-file reader offers the loader: tensor metadata up front, then zero-copy views.

A reader maps its files and hands out each stored tensor as a view of the mapping, so reading a
slice is one `copy_` from the page cache straight into the shard's storage, casting on the way
when the dtypes differ: no intermediate tensor, and only the pages of the requested rows are
touched. Readers count the bytes of every region they copy (thread-safe: slices are read from a
thread pool), which is what the per-rank byte budget in the load report is checked against.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


class TensorReader:
    """Base class: `infos` maps every checkpoint key to its metadata; `view(key)` is the whole
    stored tensor as a view of the mapped file (no bytes are read until it is indexed and copied)."""

    def __init__(self) -> None:
        self.infos: dict[str, TensorInfo] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()

    def view(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, key: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy region `index` of `key` into `out` (same shape; cast if the dtypes differ)."""
        region = self.view(key)[index]
        out.copy_(region)
        with self._lock:
            self.bytes_read += region.numel() * region.element_size()

    def close(self) -> None:
        pass
