"""Sharded, atomic, resumable checkpoints of the training state.

`CheckpointManager` is the core; LightRFT's function-style faces on it (`save_ckpt` / `load_ckpt` /
`save_model`) live in `fullshard.faces.lightrft`, the exports to plain Hugging Face directories
(`export_hf`, `export_checkpoint`, `checkpoint_hf_weights`) in `fullshard.hf`; both are importable
from here too. One module per concern:

- `layout`: what a checkpoint directory holds, ordering by step, finishing interrupted commits
- `read`: reading DCP state through `fullshard.safe_dcp`, one named error per failure
- `fit`: the checkpoint's keys against the model's, optimizer's and states': refused, fresh, or kept
- `manager`: save (sync / async), commit, rotation, load (with `auto` fallback)
- `async_exit`: an async save pending at `destroy_process_group` or at exit is committed or reported
- `rng`: per-rank RNG state, restored or re-derived

Names are resolved on first use, so `checkpoint.layout` and `checkpoint.read` (which the export
reads checkpoints with) import without the manager.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointManager": ".manager", "UnreadableCheckpoint": ".read", "complete_checkpoints": ".layout",
    "resolve_checkpoint": ".layout", "export_hf": "..hf.export", "remember_source_dtype": "..hf.recipe",
    "source_dtype": "..hf.recipe", "checkpoint_hf_weights": "..hf.offline", "export_checkpoint": "..hf.offline",
    "load_ckpt": "..faces.lightrft", "save_ckpt": "..faces.lightrft", "save_model": "..faces.lightrft",
}

__all__ = ["CheckpointManager", "UnreadableCheckpoint", "checkpoint_hf_weights", "complete_checkpoints",
           "export_checkpoint", "export_hf", "load_ckpt", "resolve_checkpoint", "remember_source_dtype", "save_ckpt",
           "save_model", "source_dtype"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
