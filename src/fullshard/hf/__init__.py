"""The Hugging Face layout: everything that writes or streams a model as the Hub lays it out.

- `recipe`: the export recipe (Hub name -> state key, the region of it or the parts fused into it,
  LoRA terms, fp32 keeps), which every way out below follows
- `export`: the safetensors region writer and `export_hf`, the live export every rank writes into
- `lora`: the LoRA merge recipe, the adapter save in PEFT's format and the merged export
- `offline`: the recipe a checkpoint records (`model_meta.json`), `export_checkpoint` and
  `checkpoint_hf_weights`, the same files and tensors from a training checkpoint in one process
- `stream`: `hf_weights` / `hf_weight_buckets`, the export's tensors a bucket at a time
- `api`: the weights-out family under one rule (`export_hf(source, dir, lora=)`, `hf_weights(source,
  lora=)`), the older names as aliases

Names are resolved on first use, so a module of this package imports only what it needs.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **dict.fromkeys(["checkpoint_hf_weights", "export_checkpoint", "export_hf", "export_merged", "hf_weight_buckets",
                     "hf_weights", "save_adapter"], ".api"),
    **dict.fromkeys(["remember_source_dtype", "source_dtype"], ".recipe"),
    **dict.fromkeys(["merge_recipe"], ".lora"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
