"""Dtype names as users write them and as safetensors stores them, in one place for every module."""

from __future__ import annotations

import torch

# the short names of configs and CLIs (LLaMA-Factory's dist_config uses these)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# safetensors' header names; the writer uses the reverse map
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype, a short name (bf16), a torch name (bfloat16, torch.float32),
    or None / "auto" (keep what the source has)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return None
    if name in DTYPES:
        return DTYPES[name]
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16, fp32, a torch dtype name such as bfloat16, "
                         "a torch.dtype, or 'auto'")
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
