"""Sharded, atomic, resumable checkpoints of the training state.

`CheckpointManager` is the core; `save_ckpt` / `load_ckpt` / `save_model` are LightRFT's
function-style faces on it. Exports to plain Hugging Face directories live in `fullshard.hf`
(`export_hf`, `export_checkpoint`, `checkpoint_hf_weights` are still importable from here). One
module per concern:

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
import os
from pathlib import Path

_EXPORTS = {
    "CheckpointManager": ".manager", "UnreadableCheckpoint": ".read", "complete_checkpoints": ".layout",
    "resolve_checkpoint": ".layout", "export_hf": "..hf.export", "remember_source_dtype": "..hf.export",
    "source_dtype": "..hf.export", "checkpoint_hf_weights": "..hf.offline", "export_checkpoint": "..hf.offline",
}

__all__ = ["CheckpointManager", "UnreadableCheckpoint", "checkpoint_hf_weights", "complete_checkpoints",
           "export_checkpoint", "export_hf", "load_ckpt", "resolve_checkpoint", "remember_source_dtype", "save_ckpt",
           "save_model", "source_dtype"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def save_ckpt(model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
              optimizer=None, scheduler=None, states=None) -> Path:
    """LightRFT's save: rotation by count and by total size in MB; client_state is JSON run state,
    `states` Stateful objects saved with the weights (the strategy passes itself).

    The step is `client_state["global_step"]` (or "step"), 0 if neither; the tag defaults to
    "global_step{step}".
    """
    from .manager import CheckpointManager

    client_state = dict(client_state or {})
    step = int(client_state.get("global_step", client_state.get("step", 0)))
    manager = CheckpointManager(save_dir, max_num=max_num, max_mem=max_mem, save_latest=save_latest)
    return manager.save(step, model, optimizer=optimizer, scheduler=scheduler, states=states, extra_state=client_state,
                        tag=tag if tag is not None else f"global_step{step}")


def load_ckpt(model, load_dir, optimizer=None, scheduler=None, load_module_strict=True, load_optimizer_states=True,
              load_lr_scheduler_states=True, states=None) -> tuple[str, dict]:
    """LightRFT's load: `load_dir` is one checkpoint or a save dir (its newest complete checkpoint; a
    save interrupted while committing is finished first). Returns (the checkpoint loaded, its
    client_state with "step"). A missing directory raises CheckpointError.
    """
    from .manager import CheckpointManager

    manager = CheckpointManager(load_dir)
    client_state = manager.load(model, optimizer=optimizer, scheduler=scheduler, states=states,
                                path=os.fspath(load_dir), load_optimizer=load_optimizer_states,
                                load_scheduler=load_lr_scheduler_states, strict=load_module_strict)
    return manager.last_load_info["path"], client_state


def save_model(model, tokenizer, output_dir, dtype=None, max_shard_size="5GB") -> Path:
    """LightRFT's final save: a plain HF directory (weights, config, tokenizer), written by all ranks."""
    from ..hf.export import export_hf

    return export_hf(model, output_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)
