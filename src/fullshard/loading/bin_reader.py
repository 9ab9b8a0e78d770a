"""PyTorch `.bin` files, read with `weights_only=True`: a pickle can only rebuild tensors, never run code.

Files in the zip format are memory-mapped (`mmap=True`), so their tensors already are views of
the file and slicing touches only the requested rows; the old (pre-1.6) format cannot be mapped
and is read whole.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from ..errors import LoadError
from .readers import TensorInfo, TensorReader


class BinReader(TensorReader):
    def __init__(self, files: list[Path], weight_map: dict[str, Path] | None = None) -> None:
        super().__init__()
        self._tensors: dict[str, torch.Tensor] = {}
        for path in files:
            state = _load(path)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise LoadError(f"key {key!r} in {str(path)!r} is a {type(value).__name__}, not a tensor")
                if key in self._tensors:
                    raise LoadError(f"key {key!r} is stored twice: in {str(self.infos[key].file)!r} and {str(path)!r}")
                self._tensors[key] = value
                self.infos[key] = TensorInfo(tuple(value.shape), value.dtype, path)
        if weight_map:
            wrong = sorted(k for k, f in weight_map.items() if k not in self.infos or self.infos[k].file != f)
            if wrong:
                raise LoadError(f"the .bin index does not match its files for {len(wrong)} keys: {wrong[:10]}")

    def view(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def close(self) -> None:
        self._tensors.clear()


def _load(path: Path) -> dict:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format: no mmap
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoadError(
            f".bin file {str(path)!r} was refused: it holds objects other than tensors, and loading it would run "
            f"arbitrary code (weights_only=True): {first_line}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any other failure means a corrupt or truncated file
        raise LoadError(f".bin file {str(path)!r} is corrupt or truncated: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise LoadError(f".bin file {str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state
