"""The weights-out family, one rule: what comes out is in the name, where from is the first
argument, and `lora=` says what a LoRA model gives, the same everywhere.

- `export_hf(source, output_dir)`: a Hugging Face directory; `hf_weights(source)` /
  `hf_weight_buckets(model)`: the same tensors as a stream.
- `source` is a sharded model (every rank calls) or a training checkpoint's path (one process).
- `lora="merge"`: the base model with the adapters merged in; `lora="adapter"`: the adapter alone,
  in PEFT's format; None (directories): the model as it is.

The older names stay, as the same calls: `export_merged(m, d)` is `export_hf(m, d, lora="merge")`,
`save_adapter(m, d)` is `export_hf(m, d, lora="adapter")`, `export_checkpoint(c, d)` is
`export_hf(c, d)`, `checkpoint_hf_weights(c)` is `hf_weights(c)`, and LightRFT's
`save_model(m, tokenizer, d)` is `export_hf(m, d, tokenizer=tokenizer)`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ConfigError
from . import export, lora as hf_lora, offline
from .stream import hf_weight_buckets, hf_weights

LORA_CHOICES = (None, "merge", "adapter")


def export_hf(source: torch.nn.Module | str | os.PathLike, output_dir: str | os.PathLike, tokenizer=None,
              dtype: torch.dtype | str | None = None, max_shard_size: int | str = export.DEFAULT_SHARD_SIZE, *,
              lora: str | None = None) -> Path:
    """A Hugging Face directory from a sharded model (call on every rank) or from a training
    checkpoint (one process: its tokenizer and a LoRA run's adapter travel along, merged)."""
    if lora not in LORA_CHOICES:
        raise ConfigError(f"lora must be one of {LORA_CHOICES}, got {lora!r}")
    if isinstance(source, (str, os.PathLike)):
        if lora == "adapter" or tokenizer is not None:
            raise ConfigError("a checkpoint exports merged with its adapter and tokenizer beside it: "
                              "lora='adapter' and tokenizer= are for a live model")
        return offline.export_checkpoint(source, output_dir, dtype=dtype, max_shard_size=max_shard_size)
    if lora is None:
        return export.export_hf(source, output_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)
    if not hf_lora.is_peft_model(source):
        raise ConfigError(f"lora={lora!r} needs a peft.PeftModel, got {type(source).__name__}")
    if lora == "adapter":
        return hf_lora.save_adapter(source, output_dir)
    return hf_lora.export_merged(source, output_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)


export_checkpoint = offline.export_checkpoint
export_merged = hf_lora.export_merged
save_adapter = hf_lora.save_adapter
checkpoint_hf_weights = offline.checkpoint_hf_weights

__all__ = ["checkpoint_hf_weights", "export_checkpoint", "export_hf", "export_merged", "hf_weight_buckets",
           "hf_weights", "save_adapter"]
