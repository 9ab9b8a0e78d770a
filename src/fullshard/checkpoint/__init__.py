"""Sharded, atomic, resumable checkpoints and export to plain Hugging Face directories.

`CheckpointManager` is the core; `save_ckpt` / `load_ckpt` / `save_model` are seed 001's
function-style faces on it, and `export_hf` / `export_checkpoint` write HF directories from a live
sharded model or, offline in one process, from a checkpoint. One module per concern:

- `layout`: what a checkpoint directory holds, ordering by step, finishing interrupted commits
- `read`: reading DCP state through `fullshard.safe_dcp`, one named error per failure
- `fit`: the checkpoint's keys against the model's, optimizer's and states': refused, fresh, or kept
- `manager`: save (sync / async), commit, rotation, load (with `auto` fallback)
- `async_exit`: an async save pending at `destroy_process_group` or at exit is committed or reported
- `export`: the live export (`export_hf`) in the Hub layout, the safetensors stream writer, the export recipe
- `offline`: the recipe a save records and the offline export that follows it (LoRA merged), and
  `checkpoint_hf_weights`, the same tensors one at a time
- `rng`: per-rank RNG state, restored or re-derived
"""

from __future__ import annotations

import os
from pathlib import Path

from .export import export_hf, remember_source_dtype, source_dtype
from .layout import complete_checkpoints, resolve_checkpoint
from .manager import CheckpointManager
from .offline import checkpoint_hf_weights, export_checkpoint
from .read import UnreadableCheckpoint

__all__ = ["CheckpointManager", "UnreadableCheckpoint", "checkpoint_hf_weights", "complete_checkpoints",
           "export_checkpoint", "export_hf", "load_ckpt", "resolve_checkpoint", "remember_source_dtype", "save_ckpt",
           "save_model", "source_dtype"]


def save_ckpt(model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
              optimizer=None, scheduler=None, states=None) -> Path:
    """Seed 001's save: rotation by count and by total size in MB; client_state is JSON run state,
    `states` Stateful objects saved with the weights (the strategy passes itself).

    The step is `client_state["global_step"]` (or "step"), 0 if neither; the tag defaults to
    "global_step{step}".
    """
    client_state = dict(client_state or {})
    step = int(client_state.get("global_step", client_state.get("step", 0)))
    manager = CheckpointManager(save_dir, max_num=max_num, max_mem=max_mem, save_latest=save_latest)
    return manager.save(step, model, optimizer=optimizer, scheduler=scheduler, states=states, extra_state=client_state,
                        tag=tag if tag is not None else f"global_step{step}")


def load_ckpt(model, load_dir, optimizer=None, scheduler=None, load_module_strict=True, load_optimizer_states=True,
              load_lr_scheduler_states=True, states=None) -> tuple[str, dict]:
    """Seed 001's load: `load_dir` is one checkpoint or a save dir (its newest complete checkpoint; a
    save interrupted while committing is finished first). Returns (the checkpoint loaded, its
    client_state with "step"). A missing directory raises CheckpointError.
    """
    manager = CheckpointManager(load_dir)
    client_state = manager.load(model, optimizer=optimizer, scheduler=scheduler, states=states,
                                path=os.fspath(load_dir), load_optimizer=load_optimizer_states,
                                load_scheduler=load_lr_scheduler_states, strict=load_module_strict)
    return manager.last_load_info["path"], client_state


def save_model(model, tokenizer, output_dir, dtype=None, max_shard_size="5GB") -> Path:
    """Seed 001's final save: a plain HF directory (weights, config, tokenizer), written by all ranks."""
    return export_hf(model, output_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)
