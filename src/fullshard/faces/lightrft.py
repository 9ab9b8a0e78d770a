"""LightRFT's `FSDPV2Strategy` API (`FSDPStrategy`) and its checkpoint functions (`save_ckpt`,
`load_ckpt`, `save_model`), as thin faces over fullshard's core.

`FSDPStrategy` is a `TrainingSession` (`fullshard.train.session`, what the trainer runs on) taking
LightRFT's constructor arguments (`bf16` / `fp16` for the engine's `mixed_precision`, whose default
here is bf16 as LightRFT's), plus LightRFT's helpers: the meta-init context, offloading between
generation phases, checkpoints with the strategy's own state inside, rank-0 printing and
all-reduce. Nothing is reimplemented: each is a call into `train.session`, `optim`,
`checkpoint` or `hf`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .. import optim
from ..checkpoint.manager import CheckpointManager
from ..distributed import get_rank, get_world_size
from ..errors import ConfigError
from ..hf.export import export_hf
from ..loading import meta_init as loading_meta_init
from ..train.session import (  # the core's names, importable from here (their old home, fullshard.strategy)
    ACCUMULATION_POLICIES,
    TrainingSession,
    batch_arithmetic,
    describe_mesh,
    engine_config,
)


def resolve_precision(bf16: bool | None, fp16: bool, configured: str | None) -> str:
    """LightRFT's `bf16` / `fp16` flags and the engine config's `mixed_precision` are one setting:
    the flags may restate the config but not contradict it (which one would win is a guess)."""
    if bf16 and fp16:
        raise ConfigError("bf16=True and fp16=True are exclusive: pick one compute dtype")
    flagged = "fp16" if fp16 else "bf16" if bf16 else "fp32" if bf16 is False else None
    if configured is None:
        return flagged or "bf16"  # LightRFT's default
    if flagged is not None and flagged != configured:
        raise ConfigError(f"bf16={bf16}, fp16={fp16} ask for {flagged} compute but the engine config has "
                          f"mixed_precision={configured!r}: set one of them")
    return configured


class FSDPStrategy(TrainingSession):
    """Distributed training with FSDP2 behind LightRFT's `FSDPV2Strategy` methods.

    `config` is the engine's: an `EngineConfig` or LLaMA-Factory's dict; every field reaches the
    engines this strategy builds, and an unknown key is an error. `bf16` / `fp16` are LightRFT's
    spelling of `mixed_precision` (bf16 unless the config or a flag says otherwise); the rest is
    `TrainingSession`'s.
    """

    def __init__(self, seed: int = 42, max_norm: float = 0.0, micro_train_batch_size: int = 1,
                 train_batch_size: int = 1, bf16: bool | None = None, *, config=None, fp16: bool = False,
                 accumulation_policy: str = "reduce_scatter_every", adam_offload: bool = False):
        resolved, configured = engine_config(config)
        resolved = replace(resolved, mixed_precision=resolve_precision(bf16, fp16, configured))
        super().__init__(seed, max_norm, micro_train_batch_size, train_batch_size, config=resolved,
                         accumulation_policy=accumulation_policy, adam_offload=adam_offload)

    def init_model_context(self, meta_init: bool = False):
        """Build the model inside this context; with `meta_init` its parameters are not
        allocated, and `prepare_model` loads each rank's slice after sharding."""
        if not meta_init:
            return contextlib.nullcontext()
        return loading_meta_init()

    # ------------------------------------------------------------------ offload (generation phases)

    def maybe_offload_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.adam_offload:
            optim.offload_optimizer(optimizer)
        return optimizer

    def maybe_load_optimizer(self, optimizer: torch.optim.Optimizer, device=None) -> torch.optim.Optimizer:
        if self.adam_offload:
            optim.reload_optimizer(optimizer, device)
        return optimizer

    def offload_model(self, model: nn.Module) -> dict:
        return optim.offload_model(model)

    def reload_model(self, model: nn.Module, device=None) -> dict:
        return optim.reload_model(model, device)

    # ------------------------------------------------------------------ RL phases (fullshard.rl)

    def offload_states(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Parameters, gradients and optimizer state to the host while another phase (a colocated
        rollout engine) needs the device; the bytes moved (`fullshard.rl.offload`)."""
        from ..rl.phases import offload

        return offload(model, optimizer)

    def reload_states(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Back to the device after `offload_states`; the next step is the one without them."""
        from ..rl.phases import onload

        return onload(model, optimizer)

    def compute_logprobs(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         **kwargs) -> torch.Tensor:
        """Per-token log-probs without gradients (old policy, reference) in token-budget
        micro-batches (`fullshard.rl.sequence_logprobs`)."""
        from ..rl.phases import sequence_logprobs

        return sequence_logprobs(model, input_ids, attention_mask, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
                  optimizer=None, scheduler=None):
        """Sharded DCP checkpoint with rotation by count and total size (MB); the strategy's own
        state (step counter, loss scaler) is saved once, as the checkpoint's "strategy" state."""
        return save_ckpt(model, save_dir, tag=tag, max_num=max_num, max_mem=max_mem, client_state=client_state,
                         save_latest=save_latest, optimizer=optimizer, scheduler=scheduler, states={"strategy": self})

    def load_ckpt(self, model, load_dir, optimizer=None, scheduler=None, load_module_strict=True,
                  load_optimizer_states=True, load_lr_scheduler_states=True):
        """Returns `(load_dir, client_state)`, as LightRFT does; restores the strategy's own state."""
        return load_ckpt(model, load_dir, optimizer=optimizer, scheduler=scheduler,
                         load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                         load_lr_scheduler_states=load_lr_scheduler_states, states={"strategy": self})

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """A plain Hugging Face directory (safetensors, config, tokenizer), gathered without any
        rank holding more than one tensor at a time."""
        save_model(model, tokenizer, output_dir, **kwargs)

    # ------------------------------------------------------------------ LightRFT's small helpers

    def is_rank_0(self) -> bool:
        return get_rank() == 0

    def print(self, *args, **kwargs) -> None:
        """The training script's own output on rank 0, as LightRFT prints it (fullshard's own
        messages go through `fullshard.log`)."""
        if self.is_rank_0():
            print(*args, **kwargs)

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        import torch.distributed as dist

        tensor = torch.as_tensor(value, dtype=torch.float64).clone()
        if dist.is_initialized() and get_world_size() > 1:
            dist.all_reduce(tensor, op={"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
                                        "max": dist.ReduceOp.MAX}[op])
            if op == "mean":
                tensor /= get_world_size()
        return tensor


# ---------------------------------------------------------------------- LightRFT's checkpoint functions


def save_ckpt(model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
              optimizer=None, scheduler=None, states=None) -> Path:
    """The save: rotation by count and by total size in MB; client_state is JSON run state,
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
    """The load: `load_dir` is one checkpoint or a save dir (its newest complete checkpoint; a
    save interrupted while committing is finished first). Returns (the checkpoint loaded, its
    client_state with "step"). A missing directory raises CheckpointError.
    """
    manager = CheckpointManager(load_dir)
    client_state = manager.load(model, optimizer=optimizer, scheduler=scheduler, states=states,
                                path=os.fspath(load_dir), load_optimizer=load_optimizer_states,
                                load_scheduler=load_lr_scheduler_states, strict=load_module_strict)
    return manager.last_load_info["path"], client_state


def save_model(model, tokenizer, output_dir, dtype=None, max_shard_size="5GB") -> Path:
    """The final save: a plain HF directory (weights, config, tokenizer), written by all ranks."""
    return export_hf(model, output_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)


__all__ = ["ACCUMULATION_POLICIES", "FSDPStrategy", "batch_arithmetic", "describe_mesh", "load_ckpt",
           "resolve_precision", "save_ckpt", "save_model"]
