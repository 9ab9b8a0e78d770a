"""The Hugging Face layout: everything that writes or streams a model as the Hub lays it out.

- `export`: the export recipe (Hub name -> state key, the region of it, LoRA terms, fp32 keeps),
  the safetensors region writer and `export_hf`, the live export every rank writes into
- `lora`: the LoRA merge recipe, the adapter save in PEFT's format and the merged export
- `offline`: the recipe a checkpoint records (`model_meta.json`), `export_checkpoint` and
  `checkpoint_hf_weights`, the same files and tensors from a training checkpoint in one process
- `stream`: `hf_weights` / `hf_weight_buckets`, the export's tensors a bucket at a time

Names are resolved on first use, so a module of this package imports only what it needs.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **dict.fromkeys(["export_hf", "remember_source_dtype", "source_dtype"], ".export"),
    **dict.fromkeys(["export_merged", "merge_recipe", "save_adapter"], ".lora"),
    **dict.fromkeys(["checkpoint_hf_weights", "export_checkpoint"], ".offline"),
    **dict.fromkeys(["hf_weight_buckets", "hf_weights"], ".stream"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
