"""What every checkpoint reader offers the loader: tensor metadata up front, then slice reads.

Readers count the bytes of every slice they return, which is what the per-rank byte budget in
the load report is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


class TensorReader:
    """Base class: `infos` maps every checkpoint key to its metadata; `read` returns one slice."""

    def __init__(self) -> None:
        self.infos: dict[str, TensorInfo] = {}
        self.bytes_read = 0

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        tensor = self._read(key, index)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


