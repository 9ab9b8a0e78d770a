"""The training session: the state a training loop keeps besides model and optimizer, and the
batch arithmetic every entry point shares.

`TrainingSession` holds which micro-batch of the accumulation window this is (to defer or not
defer the gradient sync and to step only at the window's end), the loss scaler, the mesh and the
engines that shard models. The trainer runs on it; LightRFT's `FSDPStrategy`
(`fullshard.faces.lightrft`) is a thin face over it. Everything it does is a call into `engine`,
`optim` and `checkpoint`; nothing is reimplemented.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import optim
from ..checkpoint.rng import seed_everything
from ..distributed import ParallelDims, get_world_size, init_distributed
from ..engine import EngineConfig, FSDP2Engine
from ..errors import ConfigError
from ..log import warn_rank0

ACCUMULATION_POLICIES = ("reduce_scatter_every", "defer_sync")


def batch_arithmetic(train_batch_size: int, micro_batch_size: int, dp_size: int,
                     names: tuple[str, str] = ("train_batch_size", "micro_train_batch_size")) -> int:
    """Micro-batches per rank per optimizer step: the one place this is computed and checked.

    A train batch that does not split evenly is an error (a silent remainder would train on a
    batch size nobody asked for). `names` are the keys the caller knows the two sizes by, so the
    error names them as the user wrote them (`train.global_batch_size` in a config).
    """
    for key, value in zip(names, (train_batch_size, micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    per_step = micro_batch_size * dp_size
    if train_batch_size % per_step:
        raise ConfigError(f"{names[0]}={train_batch_size} is not divisible by {names[1]}={micro_batch_size} "
                          f"x data-parallel size {dp_size} = {per_step}")
    return train_batch_size // per_step


def describe_mesh(dims: ParallelDims) -> str:
    """One line for logs and `fullshard plan`: each mesh dim, and what the data and FSDP split over."""
    sizes = f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp} x tp {dims.tp}"
    if dims.pp > 1:
        sizes = f"pp {dims.pp} x {sizes}"
    return (f"mesh {sizes} = {dims.world_size} rank(s): data split {dims.dp_size} way(s), sharded over "
            f"{dims.fsdp_shard_size} rank(s)" + (f" x {dims.dp_replicate} replica(s)" if dims.hsdp else "")
            + (f"; experts split over ep {dims.ep}, each sharded over efsdp {dims.efsdp}" if dims.ep > 1 else ""))


def engine_config(config: EngineConfig | dict | None) -> tuple[EngineConfig, str | None]:
    """The engine config (unknown keys refused by name) and the precision it sets, if it sets one."""
    try:
        resolved = EngineConfig.from_any(config)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    return resolved, EngineConfig.values_of(config).get("mixed_precision")


class TrainingSession:
    """Distributed training with FSDP2: the mesh, the engines, the accumulation window and the step.

    `config` is the engine's: an `EngineConfig` (the trainer hands it `fsdp` whole) or its dict;
    every field reaches the engines this session builds, and an unknown key is an error.
    `max_norm=0.0` means no clipping (the norm is still measured); `accumulation_policy`
    "reduce_scatter_every" (the default) keeps gradients sharded between micro-batches, "defer_sync"
    reduces once per window, trading memory for communication (on HSDP only the cross-replica
    all-reduce is deferred); `adam_offload` moves the optimizer state to CPU between phases. The
    attribute names (`micro_train_batch_size`, `train_batch_size`, `accumulated_gradient`) are
    LightRFT's, which its face exposes as they are.
    """

    def __init__(self, seed: int = 42, max_norm: float = 0.0, micro_batch_size: int = 1, global_batch_size: int = 1,
                 *, config: EngineConfig | dict | None = None, accumulation_policy: str = "reduce_scatter_every",
                 adam_offload: bool = False):
        self.seed = seed
        self.max_norm = float(max_norm)
        self.micro_train_batch_size = micro_batch_size
        self.train_batch_size = global_batch_size
        if accumulation_policy not in ACCUMULATION_POLICIES:
            raise ConfigError(
                f"accumulation_policy must be one of {ACCUMULATION_POLICIES}, got {accumulation_policy!r}"
            )
        self.accumulation_policy = accumulation_policy
        self.config = engine_config(config)[0]
        self.bf16, self.fp16 = self.config.mixed_precision == "bf16", self.config.mixed_precision == "fp16"
        self.adam_offload = adam_offload
        self.scaler = optim.ShardedGradScaler() if self.fp16 else None
        self.engines: dict[tuple, FSDP2Engine] = {}
        self.dims: ParallelDims | None = None
        self.accumulated_gradient = 1
        self.last_step: optim.StepResult | None = None
        self.skipped_steps = 0
        self._micro_step = 0

    # ------------------------------------------------------------------ setup

    def setup_distributed(self, timeout: timedelta | float | None = None) -> None:
        """Start the process group (world 1 without a launcher) with the config's `timeout_s` (or
        `timeout`), seed every RNG, and check the batch arithmetic against the mesh."""
        seed_everything(self.seed)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.device = init_distributed(timeout_s=self.config.timeout_s if seconds is None else seconds)
        try:
            self.dims = ParallelDims(self.config.dp_replicate, self.config.dp_shard, get_world_size(),
                                     cp=self.config.cp_size, tp=self.config.tp_size, pp=self.config.pp_size,
                                     ep=self.config.ep_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.accumulated_gradient = batch_arithmetic(self.train_batch_size, self.micro_train_batch_size,
                                                     self.dims.dp_size)

    def _ensure_setup(self) -> None:
        if self.dims is None:
            self.setup_distributed()

    @property
    def parallel_dims(self) -> ParallelDims:
        """The mesh's layout (dp_replicate x dp_shard x cp x tp), setting the strategy up if needed."""
        self._ensure_setup()
        return self.dims

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the batch arithmetic's divisor (cp and tp ranks share a batch)."""
        return self.parallel_dims.dp_size

    def engine(self, shard_size: int = -1, reshard_after_forward: bool | int | None = None) -> FSDP2Engine:
        """The engine for the config, or for another shard group size / reshard policy (LightRFT's
        `prepare_model` options); one engine per such pair, built once."""
        self._ensure_setup()
        overrides = {}
        if shard_size != -1:  # the FSDP shard group: dp_shard x cp ranks, replicated over the rest but tp
            cp, tp = self.dims.cp, self.dims.tp
            if get_world_size() % (shard_size * tp) or shard_size % cp:
                raise ConfigError(f"shard_size={shard_size} x tp_size={tp} does not divide the world size "
                                  f"{get_world_size()}, or cp_size={cp} does not divide shard_size")
            overrides.update(dp_replicate=get_world_size() // (shard_size * tp), dp_shard=shard_size // cp)
        if reshard_after_forward is not None:
            overrides["reshard_after_forward"] = reshard_after_forward
        key = tuple(sorted(overrides.items()))
        if key not in self.engines:
            self.engines[key] = FSDP2Engine(replace(self.config, **overrides))
        return self.engines[key]

    def prepare_model(self, model: nn.Module, is_training: bool = False, shard_size: int = -1,
                      reshard_after_forward: bool | int | None = None) -> nn.Module:
        """Shard `model` (loading its weights if it was built on meta, or sending rank 0's when only
        rank 0 loaded them); eval mode unless training."""
        engine = self.engine(shard_size, reshard_after_forward)
        model = engine.shard_model(model)  # loaded, on meta, or loaded on rank 0 only: the engine tells
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
        on any rank) and zero the gradients. Returns the step's result, or None mid-window.
        `kwargs` reach `optim.clip_and_step` (a pipeline's `across` and `uncounted`; `values` to sum)."""
        last = self.is_last_micro_step()
        self._micro_step += 1
        if not last:
            return None
        result = optim.clip_and_step(optimizer, self.max_norm, scheduler, self.scaler, **kwargs)
        self.last_step = result
        self.skipped_steps += int(result.skipped)
        if result.skipped:
            warn_rank0(f"{name}: non-finite grad norm ({result.grad_norm}); step skipped on every rank", once=False)
        return result

    def state_dict(self) -> dict:
        return {"micro_step": self._micro_step, "window": self.accumulated_gradient,
                "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at the same optimizer step on any world size: the micro-step counter is kept in
        optimizer steps, since the window (micro-batches per step) changes with the dp size (once
        set up; before `setup_distributed` the window is not known and the count is kept as saved)."""
        window = state.get("window")
        if self.dims is not None and window:
            self._micro_step = state["micro_step"] // window * self.accumulated_gradient
        else:
            self._micro_step = state["micro_step"]
        self.skipped_steps = state["skipped_steps"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
