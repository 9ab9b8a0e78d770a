"""`FSDPStrategy`: seed 001's strategy-object API (LightRFT `FSDPV2Strategy`) on fullshard's core.

The strategy keeps the state a training loop written against that API expects to be hidden:
which micro-batch of the accumulation window this is (to defer or not defer the gradient sync
and to step only at the window's end), the loss scaler, and the engine that shards models.
Everything it does is a call into `engine`, `optim` and `checkpoint`; nothing is reimplemented.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import optim
from .distributed import ParallelDims, get_rank, get_world_size, init_distributed
from .checkpoint.rng import seed_everything
from .engine import FSDP2Engine, is_on_meta

ACCUMULATION_POLICIES = ("reduce_scatter_every", "defer_sync")


def batch_arithmetic(train_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step; a train batch that does not split evenly is an error
    (a silent remainder would train on a batch size nobody asked for)."""
    for key, value in (("train_batch_size", train_batch_size), ("micro_train_batch_size", micro_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    per_step = micro_batch_size * dp_size
    if train_batch_size % per_step:
        raise ValueError(
            f"train_batch_size={train_batch_size} is not divisible by micro_train_batch_size={micro_batch_size} "
            f"x data-parallel size {dp_size} = {per_step}"
        )
    return train_batch_size // per_step


class FSDPStrategy:
    """Distributed training with FSDP2 behind seed 001's methods.

    `max_norm=0.0` means no clipping (the gradients are left untouched; the norm is still
    measured). `args` (a dict or namespace) carries the rest: `accumulation_policy`
    ("reduce_scatter_every", the default, keeps gradients sharded between micro-batches;
    "defer_sync" reduces once per window, trading memory for communication; on HSDP only the
    cross-replica all-reduce is deferred), `fp16`, `adam_offload`, `dp_replicate`,
    `activation_checkpointing`, `offload_params`, `reduce_dtype`.
    """

    def __init__(self, seed: int = 42, max_norm: float = 0.0, micro_train_batch_size: int = 1,
                 train_batch_size: int = 1, bf16: bool = True, args: Any = None):
        self.seed = seed
        self.max_norm = float(max_norm)
        self.micro_train_batch_size = micro_train_batch_size
        self.train_batch_size = train_batch_size
        self.bf16 = bf16
        self.args = SimpleNamespace(**args) if isinstance(args, dict) else (args or SimpleNamespace())
        self.accumulation_policy = self._arg("accumulation_policy", "reduce_scatter_every")
        if self.accumulation_policy not in ACCUMULATION_POLICIES:
            raise ValueError(f"accumulation_policy must be one of {ACCUMULATION_POLICIES}, got {self.accumulation_policy!r}")
        self.fp16 = bool(self._arg("fp16", False))
        if self.fp16 and self.bf16:
            raise ValueError("bf16=True and fp16=True are exclusive: pick one compute dtype")
        self.adam_offload = bool(self._arg("adam_offload", False))
        self.scaler = optim.ShardedGradScaler() if self.fp16 else None
        self.engines: dict[int, FSDP2Engine] = {}
        self.dims: ParallelDims | None = None
        self.accumulated_gradient = 1
        self.last_step: optim.StepResult | None = None
        self.skipped_steps = 0
        self._micro_step = 0

    def _arg(self, name: str, default: Any) -> Any:
        return getattr(self.args, name, default)

    # ------------------------------------------------------------------ setup

    def setup_distributed(self, timeout=None) -> None:
        """Start the process group (world 1 without a launcher), seed every RNG, check the batch arithmetic."""
        seed_everything(self.seed)
        self.device = init_distributed(timeout_s=timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout)
        self.dims = ParallelDims(dp_replicate=self._arg("dp_replicate", 1), dp_shard=-1, world_size=get_world_size())
        self.accumulated_gradient = batch_arithmetic(self.train_batch_size, self.micro_train_batch_size, self.dims.dp_size)

    def _ensure_setup(self) -> None:
        if self.dims is None:
            self.setup_distributed()

    @property
    def dp_size(self) -> int:
        self._ensure_setup()
        return self.dims.dp_size

    def engine(self, shard_size: int = -1, reshard_after_forward: bool | int = True) -> FSDP2Engine:
        self._ensure_setup()
        world = get_world_size()
        if shard_size == -1:
            dp_replicate, shard_size = self.dims.dp_replicate, self.dims.dp_shard
        else:
            if world % shard_size:
                raise ValueError(f"shard_size={shard_size} does not divide the world size {world}")
            dp_replicate = world // shard_size
        key = (shard_size, reshard_after_forward)
        if key not in self.engines:
            precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
            self.engines[key] = FSDP2Engine({
                "mixed_precision": precision,
                "reduce_dtype": self._arg("reduce_dtype", "fp32"),
                "reshard_after_forward": reshard_after_forward,
                "offload_params": bool(self._arg("offload_params", False)),
                "activation_checkpointing": bool(self._arg("activation_checkpointing", False)),
                "plan": self._arg("plan", "auto"),
                "dp_replicate": dp_replicate,
                "dp_shard": shard_size,
            })
        return self.engines[key]

    def init_model_context(self, meta_init: bool = False):
        """Build the model inside this context; with `meta_init` its parameters are not
        allocated, and `prepare_model` loads each rank's slice after sharding."""
        if not meta_init:
            return contextlib.nullcontext()
        from .loading import meta_init

        return meta_init()

    def prepare_model(self, model: nn.Module, is_training: bool = False, shard_size: int = -1,
                      reshard_after_forward: bool | int = True) -> nn.Module:
        """Shard `model` (loading its weights if it was built on meta); eval mode unless training."""
        engine = self.engine(shard_size, reshard_after_forward)
        model = engine.shard_model(model) if is_on_meta(model) else engine.prepare_model(model)
        model.train(is_training)
        return model

    def create_optimizer(self, model: nn.Module, **kwargs) -> torch.optim.Optimizer:
        """AdamW over groups split by weight decay, mesh, placement and dtype (see `optim.create_optimizer`)."""
        return optim.create_optimizer(model, **kwargs)

    # ------------------------------------------------------------------ the step

    def is_last_micro_step(self) -> bool:
        return (self._micro_step + 1) % self.accumulated_gradient == 0

    def _set_gradient_sync(self, model: nn.Module, last: bool) -> None:
        if self.accumulation_policy != "defer_sync" or not isinstance(model, FSDPModule):
            return
        if self.dims.hsdp:
            # reduce-scatter inside the shard group every time (gradients stay sharded), all-reduce
            # across replicas once
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last)

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer,
                 normalized: bool = False, **kwargs) -> None:
        """Backward one micro-batch's loss.

        By default the loss is a per-micro-batch mean and is divided by the number of
        micro-batches in the window. `normalized=True` says the caller already normalised it
        (by the global target-token count: see `fullshard.train.loss`), so it is used as is.
        """
        self._ensure_setup()
        self._set_gradient_sync(model, self.is_last_micro_step())
        if not normalized:
            loss = loss / self.accumulated_gradient
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: nn.Module, scheduler=None,
                       name: str = "model", **kwargs) -> optim.StepResult | None:
        """Count a micro-batch; at the end of the window clip, step (or skip on a non-finite norm
        on any rank) and zero the gradients. Returns the step's result, or None mid-window."""
        last = self.is_last_micro_step()
        self._micro_step += 1
        if not last:
            return None
        result = optim.clip_and_step(optimizer, self.max_norm, scheduler, self.scaler)
        self.last_step = result
        self.skipped_steps += int(result.skipped)
        if result.skipped and get_rank() == 0:
            print(f"[fullshard] {name}: non-finite grad norm ({result.grad_norm}); step skipped on every rank")
        return result

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

    # ------------------------------------------------------------------ checkpoints

    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True,
                  optimizer=None, scheduler=None):
        """Sharded DCP checkpoint with rotation by count and total size (GB); the step counter and
        the loss scaler ride along in the client state."""
        from .checkpoint import save_ckpt

        state = dict(client_state or {})
        state["fullshard_strategy"] = self.state_dict()
        return save_ckpt(model, save_dir, tag=tag, max_num=max_num, max_mem=max_mem, client_state=state,
                         save_latest=save_latest, optimizer=optimizer, scheduler=scheduler)

    def load_ckpt(self, model, load_dir, optimizer=None, scheduler=None, load_module_strict=True,
                  load_optimizer_states=True, load_lr_scheduler_states=True):
        """Returns `(load_dir, client_state)`, as seed 001 does; restores the strategy's own state."""
        from .checkpoint import load_ckpt

        load_path, client_state = load_ckpt(
            model, load_dir, optimizer=optimizer if load_optimizer_states else None,
            scheduler=scheduler if load_lr_scheduler_states else None, load_module_strict=load_module_strict)
        if client_state and "fullshard_strategy" in client_state:
            self.load_state_dict(client_state.pop("fullshard_strategy"))
        return load_path, client_state

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """A plain Hugging Face directory (safetensors, config, tokenizer), gathered without any
        rank holding more than one tensor at a time."""
        from .checkpoint import save_model

        save_model(model, tokenizer, output_dir, **kwargs)

    def state_dict(self) -> dict:
        return {"micro_step": self._micro_step, "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self._micro_step = state["micro_step"]
        self.skipped_steps = state["skipped_steps"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    # ------------------------------------------------------------------ small helpers of seed 001

    def is_rank_0(self) -> bool:
        return get_rank() == 0

    def print(self, *args, **kwargs) -> None:
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
