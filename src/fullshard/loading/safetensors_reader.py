"""safetensors files (one or an indexed set) read slice by slice with `get_slice`.

Only the bytes of the requested rows are touched: `get_slice(name)[start:stop]` maps just that
region of the file, so a rank holding 1/N of a tensor reads 1/N of its bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..dtypes import SAFETENSORS_DTYPES
from .errors import CheckpointError
from .readers import TensorInfo, TensorReader



class SafetensorsReader(TensorReader):
    """Opens every file's header up front, so a corrupt or truncated file fails before any copy."""

    def __init__(self, files: list[Path], weight_map: dict[str, Path] | None = None) -> None:
        super().__init__()
        self._handles = {}
        self._files: dict[str, Path] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"safetensors file {str(path)!r} is corrupt or truncated: {exc}") from None
            self._handles[path] = handle
            for key in keys:
                if key in self._files:
                    raise CheckpointError(f"key {key!r} is stored twice: in {str(self._files[key])!r} and {str(path)!r}")
                self._files[key] = path
                view = handle.get_slice(key)
                dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"key {key!r} in {str(path)!r} has unsupported dtype {view.get_dtype()}")
                self.infos[key] = TensorInfo(tuple(view.get_shape()), dtype, path)
        if weight_map:
            wrong = sorted(k for k, f in weight_map.items() if self._files.get(k) != f)
            if wrong:
                details = [f"{k} (index: {weight_map[k].name}, found in: "
                           f"{self._files[k].name if k in self._files else 'no file'})" for k in wrong[:10]]
                raise CheckpointError(f"the index of {str(next(iter(weight_map.values())).parent)!r} does not match "
                                      f"its files for {len(wrong)} keys: {details}")

    def _read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        handle = self._handles[self._files[key]]
        if not self.infos[key].shape:  # a scalar has no rows to slice
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]

    def close(self) -> None:
        self._handles.clear()
