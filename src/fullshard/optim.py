"""Optimizers, learning-rate schedules, gradient clipping, loss scaling and optimizer offload for sharded models.

Every piece here has to be right for parameters that are `DTensor`s on one mesh (FSDP), on a 2-D
mesh (HSDP) or plain tensors (a module left unsharded), in any mix: a norm taken per shard and
not summed across ranks, or a decision to skip a step made by one rank only, silently breaks
training or hangs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .float8 import register_scale_precompute
from .fsdp import reshard_all
from .parallel.ep_lists import unique_parameters
from .tensors import local_tensor

SCHEDULES = ("constant", "linear", "cosine")


# ---------------------------------------------------------------------------------------------- groups


def _placement_key(param: torch.Tensor) -> tuple:
    """Fused and foreach kernels need every tensor of a call on one mesh, placement and dtype."""
    if isinstance(param, DTensor):
        return (id(param.device_mesh), str(param.device_mesh), tuple(str(p) for p in param.placements), param.dtype)
    return (None, str(param.device), (), param.dtype)


def is_no_decay(name: str, param: torch.Tensor, embeddings: set[int]) -> bool:
    """Biases, norm weights (all 1-D) and, by choice, embedding tables are not decayed:
    decaying a norm's scale or a bias pulls it towards zero, which is not regularisation."""
    return param.ndim < 2 or name.endswith(".bias") or id(param) in embeddings


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = False, extra_no_decay: Iterable[str] = ()
) -> list[dict]:
    """Trainable parameters split by (weight decay or not, mesh, placement, dtype)."""
    embeddings: set[int] = set()
    if not decay_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                embeddings.add(id(module.weight))
    extra = tuple(extra_no_decay)
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        if not param.requires_grad:
            continue
        no_decay = is_no_decay(name, param, embeddings) or any(token in name for token in extra)
        key = (no_decay, *_placement_key(param))
        group = groups.setdefault(
            key, {"params": [], "param_names": [], "weight_decay": 0.0 if no_decay else weight_decay}
        )
        group["params"].append(param)
        group["param_names"].append(name)
    if not groups:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    return list(groups.values())


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def create_optimizer(
    model: nn.Module,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    name: str = "adamw",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    decay_embeddings: bool = False,
    **kwargs,
) -> torch.optim.Optimizer:
    """An optimizer over the model's sharded parameters, grouped so fused/foreach kernels apply.

    Every FSDP unit is resharded first: an optimizer built while a unit is still unsharded (after
    a `no_grad` forward) would hold the unsharded tensors and never update the real parameters.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    reshard_all(model)
    groups = param_groups(model, weight_decay, decay_embeddings)
    if name == "sgd":
        kwargs.setdefault("momentum", 0.0)
        optimizer = torch.optim.SGD(groups, lr=lr, **kwargs)
    else:
        optimizer = OPTIMIZERS[name](groups, lr=lr, betas=tuple(betas), eps=eps, **kwargs)
    register_scale_precompute(optimizer, model)  # float8 tensorwise: scales after every step
    return optimizer


# ---------------------------------------------------------------------------------------------- schedules


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """The multiplier of the base lr at each step: linear warmup from 0, then the named decay
    down to `min_lr_ratio` at `total_steps` (constant stays at 1)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return factor


def create_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 1,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup_steps, total_steps, min_lr_ratio))


# ---------------------------------------------------------------------------------------------- norms


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _unique_grads(params: list[torch.Tensor]) -> set[int]:
    """The ids of the gradients whose every element lives on one rank of the world whatever their
    placement says: per-expert modules under ep (`fullshard.parallel.ep_lists`)."""
    unique = unique_parameters(params)
    return {id(p.grad) for p in params if id(p) in unique and p.grad is not None}


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, across=None) -> torch.Tensor:
    """The norm of all gradients together, as one plain tensor equal on every rank.

    Gradients are grouped by mesh and placement; each group's norm is reduced over the mesh dims
    its gradients are split on (both dims of FSDP x TP, the shard dim of HSDP), and the groups'
    norms are then combined like one vector. `clip_grad_norm_` alone fails on a mix of meshes
    and returns a DTensor the caller must remember to reduce.
    `across` is a process group whose ranks hold different parameters (the stages of a
    pipeline): their norms are combined the same way, so every stage clips by the whole model's.
    """
    norm_type = float(norm_type)
    params = list(params)
    unique = _unique_grads(params)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in _grads(params):
        groups.setdefault((id(grad) in unique, *_placement_key(grad)[:3]), []).append(grad)
    norms = []
    for (one_rank, *_), grads in groups.items():
        pieces = [t for t in map(local_tensor, grads) if t.numel()]  # an uneven split leaves some ranks none
        norm = (torch.nn.utils.get_total_norm(pieces, norm_type=norm_type) if pieces
                else torch.zeros((), device=local_tensor(grads[0]).device))
        if one_rank:
            norm = _combine_over_world(norm.float(), norm_type)
        elif isinstance(grads[0], DTensor):
            norm = _combine_over_mesh(norm.float(), grads[0], norm_type)
        norms.append(norm.float())
    if not norms:
        norms = [torch.tensor(0.0)]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), ord=norm_type)
    if across is None:
        return total
    if math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=across)
        return total
    total = total.double() ** norm_type
    dist.all_reduce(total, group=across)
    return (total ** (1.0 / norm_type)).float()


def _combine_over_mesh(norm: torch.Tensor, like: DTensor, norm_type: float) -> torch.Tensor:
    """The norm of a group split over mesh dims, from each rank's norm of its own pieces: one
    reduction per split dim. DTensor's own reduction of a norm split over two dims runs the same
    collectives, and warns once per rank that it cannot merge them. Gradients are split or
    replicated (FSDP reduce-scatters them), never pending partial sums."""
    infinite = math.isinf(norm_type)
    value = norm if infinite else norm ** norm_type
    for dim, placement in enumerate(like.placements):
        if not placement.is_replicate():  # Shard, and FSDP x TP's _StridedShard
            dist.all_reduce(value, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                            group=like.device_mesh.get_group(dim))
    return value if infinite else value ** (1.0 / norm_type)


def _combine_over_world(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of pieces each held by one rank of the world, from each rank's norm of its own."""
    if math.isinf(norm_type):
        return _over_world(norm, dist.ReduceOp.MAX)
    return _over_world(norm.double() ** norm_type).pow(1.0 / norm_type).float()


def scale_grads_(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place; each rank touches only its own shards (no communication)."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for grad in _grads(params):
        local = local_tensor(grad)
        by_key.setdefault((local.device, local.dtype), []).append(local)
    for grads in by_key.values():
        torch._foreach_mul_(grads, factor)


def grad_norm_and_sum(params: Iterable[torch.Tensor], norm_type: float = 2.0, values: torch.Tensor | None = None,
                      across=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`global_grad_norm`, and `values` summed over every rank, in one all_reduce.

    Each rank adds up |g|^p over its local pieces, each piece divided by the number of ranks that
    hold that same piece (a Replicate dim of its mesh, a tp rank repeating a replicated weight, a
    plain tensor on every rank), so the sum over the world counts every element once; `values`
    (a step's loss sum, say) ride in the same buffer, so a step pays one small collective, not one
    per mesh plus one per logged number. Pipeline stages (`across`), a partial-sum gradient, a mesh
    that does not span the world, or the inf-norm take `global_grad_norm` and a collective of their
    own for `values`.
    """
    norm_type = float(norm_type)
    params = list(params)
    world = dist.get_world_size() if dist.is_initialized() else 1
    fusable = across is None and math.isfinite(norm_type)
    powers = _local_norm_powers(_grads(params), norm_type, world, _unique_grads(params)) if fusable else None
    if powers is None:
        return global_grad_norm(params, norm_type, across), None if values is None else _over_world(values)
    extra = [] if values is None else [values.detach().reshape(-1).to(powers.device, torch.float64)]
    buffer = torch.cat([powers.reshape(1).double(), *extra])
    buffer = _over_world(buffer)
    norm = buffer[0].pow(1.0 / norm_type).float()
    return norm, None if values is None else buffer[1:].to(values.device, values.dtype).reshape(values.shape)


def _over_world(value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=op)
    return value


def _local_norm_powers(grads: list[torch.Tensor], norm_type: float, world: int,
                       unique: set[int] = frozenset()) -> torch.Tensor | None:
    """This rank's share of the sum of |g|^p over every gradient element (see `grad_norm_and_sum`),
    or None where shares cannot say it (a partial-sum gradient, a mesh not spanning the world).
    The gradients in `unique` (ids) are held by one rank each, whatever their placements."""
    by_copies: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        copies = 1 if id(grad) in unique else world
        if isinstance(grad, DTensor) and id(grad) not in unique:
            mesh = grad.device_mesh
            if any(p.is_partial() for p in grad.placements) or mesh._get_root_mesh().size() != world:
                return None
            for dim, placement in enumerate(grad.placements):
                if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over a TP split
                    copies //= mesh.size(dim)
        local = local_tensor(grad)
        by_copies.setdefault((copies, local.device, local.dtype), []).append(local)
    total = None
    for (copies, _, dtype), tensors in by_copies.items():
        norms = torch._foreach_norm(tensors, norm_type, dtype=torch.promote_types(dtype, torch.float32))
        share = torch.stack(norms).to(torch.float64).pow(norm_type).sum() / copies
        total = share if total is None else total + share.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, across=None,
                    uncounted: Iterable[torch.Tensor] = ()) -> float:
    """Clip to `max_norm` by the global norm and return that norm (before clipping).

    `max_norm <= 0` means no clipping: the norm is still measured (it is logged), gradients are
    left exactly as they are. A non-finite norm leaves gradients alone too; the caller skips the step.
    `across` is passed to `global_grad_norm`; `uncounted` parameters are clipped but left out of
    the norm (the second copy of a weight two pipeline stages hold).
    """
    return _clip(list(params), max_norm, norm_type, across=across, uncounted=uncounted)[0]


clip_grad_norm = clip_grad_norm_  # the name without torch's trailing underscore (it clips in place), kept


def _clip(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, values: torch.Tensor | None = None,
          across=None, uncounted: Iterable[torch.Tensor] = ()) -> tuple[float, torch.Tensor | None]:
    """`clip_grad_norm_`, and `values` summed over every rank in the norm's collective."""
    skip = {id(p) for p in uncounted}
    norm, sums = grad_norm_and_sum([p for p in params if id(p) not in skip], norm_type, values, across)
    norm = float(norm)
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            scale_grads_(params, coef)
    return norm, sums


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------------------------------------- fp16


class ShardedGradScaler:
    """Dynamic loss scaling for fp16 that works on sharded gradients.

    `torch.amp.GradScaler` checks for infs per tensor on each rank; with sharded gradients one
    rank can see an inf the others do not and only that rank would skip its step. Here the
    check is the global gradient norm, which every rank computes identically, so all ranks skip
    (and back off) together.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        self.growth_tracker = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params: Iterable[torch.Tensor]) -> None:
        if self.enabled:
            scale_grads_(params, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# ---------------------------------------------------------------------------------------------- one step


@dataclass
class StepResult:
    """What one optimizer step did: the global grad norm (before clipping), whether it was skipped,
    and the `values` given to `clip_and_step` summed over every rank (None if none were given)."""

    grad_norm: float
    skipped: bool
    sums: torch.Tensor | None = None


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    max_norm: float = 0.0,
    scheduler=None,
    scaler: ShardedGradScaler | None = None,
    across=None,
    uncounted: Iterable[torch.Tensor] = (),
    values: torch.Tensor | None = None,
) -> StepResult:
    """Unscale (fp16), clip by the global norm, step, and zero the gradients.

    A non-finite norm (a NaN or inf on any rank reaches every rank through the reduction) skips
    the optimizer and scheduler step on all ranks alike; the gradients are dropped either way.
    `values` (the step's loss sum, say) are summed over every rank in the norm's own collective.
    """
    params = optimizer_params(optimizer)
    if scaler is not None:
        scaler.unscale_(params)
    norm, sums = _clip(params, max_norm, values=values, across=across, uncounted=uncounted)
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    if scaler is not None:
        scaler.update(found_inf=skipped)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(norm, skipped, sums)


# ---------------------------------------------------------------------------------------------- offload


def _move(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of `t` on `device` (a new storage, so the old one is freed), DTensor layout kept."""
    if isinstance(t, DTensor):
        local = _move(t.to_local(), device, pin)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    moved = t.to(device, copy=True)
    if pin and moved.device.type == "cpu":
        moved = moved.pin_memory()
    return moved


def _tensor_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _accelerator_allocated() -> int:
    if torch.accelerator.is_available():
        return torch.accelerator.memory_allocated()
    return 0


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device, pin: bool) -> dict:
    before = _accelerator_allocated()
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's `step` is a CPU scalar by design (capturable=False); leave it where it is
            if isinstance(value, torch.Tensor) and not (key == "step" and value.ndim == 0):
                state[key] = _move(value, device, pin)
                moved += _tensor_bytes(value)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
    return {"bytes_moved": moved, "accelerator_freed": before - _accelerator_allocated()}


def offload_optimizer(optimizer: torch.optim.Optimizer) -> dict:
    """Move the optimizer state to CPU (for a generation phase that needs the device memory).

    Returns the bytes moved and the accelerator memory freed (0 on a CPU-only host).
    """
    from .distributed import has_accelerator

    return _move_optimizer_state(optimizer, torch.device("cpu"), pin=has_accelerator())


def reload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> dict:
    """Move the optimizer state back next to its parameters (or to `device`)."""
    if device is None:
        params = optimizer_params(optimizer)
        device = local_tensor(params[0]).device if params else torch.device("cpu")
    return _move_optimizer_state(optimizer, torch.device(device), pin=False)


def _move_model(model: nn.Module, device: torch.device) -> dict:
    """Move every sharded parameter (and buffer) of a model, freeing the old storages.

    Gradients are dropped first: a generation phase does not need them and they would pin the
    memory. FSDP2 keeps its view of each sharded parameter in step with `module.to()`.
    """
    before = _accelerator_allocated()
    for param in model.parameters():
        param.grad = None
    moved = sum(_tensor_bytes(p) for p in model.parameters())
    reshard_all(model)
    model.to(device)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
    return {"bytes_moved": moved, "accelerator_freed": before - _accelerator_allocated()}


def offload_model(model: nn.Module) -> dict:
    return _move_model(model, torch.device("cpu"))


def reload_model(model: nn.Module, device: torch.device | str | None = None) -> dict:
    from .distributed import current_device

    return _move_model(model, torch.device(device) if device is not None else current_device())
