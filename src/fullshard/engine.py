"""`FSDP2Engine`: turns a plan into `fully_shard` calls with the precision, reshard and offload policies.

The engine owns the policies; `plan.py` owns which modules are units. Loading weights into a
model built on the meta device lives in `fullshard.loading`; the engine only calls it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from .dtypes import DTYPES
from .distributed import ParallelDims, detect_device_type, get_world_size, has_accelerator, init_distributed, shard_mesh
from .plan import ShardingPlan, build_plan, find_blocks



@dataclass
class EngineConfig:
    """Everything that decides how a model is sharded. The seed-000 `dist_config` dict maps onto it.

    mixed_precision: compute dtype of the all-gathered weights (bf16 / fp16 / fp32); the sharded
        master weights keep their own dtype and gradients are reduced in `reduce_dtype`.
    reshard_after_forward: True frees the full weight after each unit's forward (least memory),
        False keeps it until backward (no second all-gather), an int reshards to groups of that
        many ranks (inside a node, say).
    offload_params: keep sharded parameters, gradients and optimizer state on CPU.
    pin_memory: pin the offloaded CPU memory; only honoured where an accelerator exists.
    activation_checkpointing: recompute each block's activations in backward (non-reentrant).
    plan: "auto", a seed-003 `fsdp_plan` dict, or a `ShardingPlan`.
    dp_replicate / dp_shard: the mesh (HSDP when dp_replicate > 1).
    """

    mixed_precision: str = "fp32"
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool | int = True
    offload_params: bool = False
    pin_memory: bool = True
    activation_checkpointing: bool = False
    plan: Any = "auto"
    dp_replicate: int = 1
    dp_shard: int = -1
    dcp_path: str | None = None

    def __post_init__(self) -> None:
        for key in ("mixed_precision", "reduce_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"{key} must be one of {sorted(DTYPES)}, got {getattr(self, key)!r}")
        raf = self.reshard_after_forward
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
            raise ValueError(f"reshard_after_forward must be a bool or an int >= 1, got {raf!r}")

    @classmethod
    def from_any(cls, config: "EngineConfig | dict | None", **overrides) -> "EngineConfig":
        if isinstance(config, cls):
            values = asdict(config)
        elif config is None:
            values = {}
        elif isinstance(config, dict):
            values = dict(config)
        else:
            raise TypeError(f"dist_config must be a dict or EngineConfig, got {type(config).__name__}")
        values.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown dist_config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)


class FSDP2Engine:
    """Shards models with FSDP2 over a data-parallel mesh.

    `FSDP2Engine({"mixed_precision": "bf16", ...})` starts the process group when needed (world
    size 1 works without torchrun) and builds the mesh from `dp_replicate` / `dp_shard`, unless a
    `device_mesh` is given.
    """

    def __init__(self, dist_config: EngineConfig | dict | None = None, device_mesh: DeviceMesh | None = None, **overrides):
        self.config = EngineConfig.from_any(dist_config, **overrides)
        self.device_type = device_mesh.device_type if device_mesh is not None else detect_device_type()
        self.device = init_distributed(self.device_type)
        if device_mesh is None:
            dims = ParallelDims(self.config.dp_replicate, self.config.dp_shard, get_world_size())
            device_mesh = dims.build_mesh(self.device_type)
        self.mesh = device_mesh
        self.plan: ShardingPlan | None = None

    # ------------------------------------------------------------------ policies

    @property
    def shard_size(self) -> int:
        return shard_mesh(self.mesh).size()

    def get_mp_policy(self, enabled: bool | None = None) -> MixedPrecisionPolicy:
        """The mixed-precision policy; `enabled=True` on an fp32 engine means bf16 (seed 003's flag)."""
        name = self.config.mixed_precision
        if enabled is False or (enabled is None and name == "fp32"):
            return MixedPrecisionPolicy()
        param_dtype = DTYPES["bf16" if name == "fp32" else name]
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[self.config.reduce_dtype])

    def get_offload_policy(self, enabled: bool | None = None) -> OffloadPolicy:
        if not (self.config.offload_params if enabled is None else enabled):
            return OffloadPolicy()
        # pinning needs an accelerator; on a CPU-only host it fails with "Cannot access accelerator device"
        return CPUOffloadPolicy(pin_memory=self.config.pin_memory and has_accelerator())

    # ------------------------------------------------------------------ sharding

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Plan, checkpoint activations if asked, and `fully_shard` every unit, then the root.

        Parameters keep the device they are on: real tensors are sharded in place, meta tensors
        stay meta (to be materialised by the loader).
        """
        plan = build_plan(model, self.config.plan)
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(model)
        modules = dict(model.named_modules())
        for unit in plan.sharding_order():
            targets = [modules[name] for name in unit.modules]
            fully_shard(
                targets if len(targets) > 1 else targets[0],
                mesh=self.mesh,
                shard_placement_fn=self._placement,
                reshard_after_forward=self._reshard(unit.reshard_after_forward),
                mp_policy=self.get_mp_policy(unit.mixed_precision),
                offload_policy=self.get_offload_policy(unit.cpu_offload),
            )
        fully_shard(
            model,
            mesh=self.mesh,
            shard_placement_fn=self._placement,
            reshard_after_forward=self._reshard(None),
            mp_policy=self.get_mp_policy(),
            offload_policy=self.get_offload_policy(),
        )
        self.plan = plan
        model.fullshard_plan = plan
        return model

    def _placement(self, param: nn.Parameter) -> Shard | None:
        """Shard dim 0 unless it is shorter than the shard group (e.g. 8 experts over 16 ranks,
        which would leave half the ranks holding nothing); then the longest dim that is not.
        fully_shard splits dims other than 0 only evenly, so such a dim must divide by the group."""
        size = self.shard_size
        if param.dim() < 2 or param.shape[0] >= size:
            return None
        longest = max(range(param.dim()), key=lambda d: param.shape[d])
        return Shard(longest) if param.shape[longest] >= size and param.shape[longest] % size == 0 else None

    def _reshard(self, value: bool | int | None) -> bool | int:
        value = self.config.reshard_after_forward if value is None else value
        if isinstance(value, bool):
            return value
        if self.shard_size % value:
            raise ValueError(f"reshard_after_forward={value} does not divide the shard group size {self.shard_size}")
        # an int equal to the shard size is the same as True, and fully_shard wants it said so
        return True if value == self.shard_size else value

    def shard_model(self, model: nn.Module, hf_model_path: str | None = None, **load_kwargs) -> nn.Module:
        """Shard a model. A model with weights is sharded in place; one on the meta device is
        sharded and then loaded from `hf_model_path` (or the engine's `dcp_path`)."""
        if not is_on_meta(model):
            return self.prepare_model(model)
        source = hf_model_path or getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source and not self.config.dcp_path:
            raise ValueError(
                "the model is on the meta device and no weights were named: pass hf_model_path, "
                "or set dcp_path in the engine config"
            )
        return self.materialize_and_load(self.prepare_model(model), source, self.config.dcp_path, **load_kwargs)

    def materialize_and_load(self, model: nn.Module, hf_model_path: str | None, dcp_path: str | None = None, **kwargs):
        from .loading import materialize_and_load

        return materialize_and_load(model, hf_model_path, dcp_path=dcp_path, device=self.device, **kwargs)


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each outermost block in backward (non-reentrant checkpointing).

    The block's `forward` is wrapped in place, not the module, so parameter names and state-dict
    keys stay exactly those of the checkpoint on disk.
    """
    modules = dict(model.named_modules())
    for name in find_blocks(model):
        block = modules[name]
        if getattr(block, "_fullshard_checkpointed", False):
            continue
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        block._fullshard_checkpointed = True


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state.

    After a `no_grad` forward the root unit stays unsharded; an optimizer built then would hold
    the unsharded tensors and silently never update the real parameters.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def apply_fsdp2(model: nn.Module, device_mesh: DeviceMesh | None = None, fsdp_plan: dict | str | None = None, **config):
    """Seed 003's entry point: shard `model` over `device_mesh` following `fsdp_plan`."""
    return FSDP2Engine(dict(config, plan=fsdp_plan or "auto"), device_mesh=device_mesh).prepare_model(model)


def fsdp_units(model: nn.Module) -> dict[tuple[str, ...], list[nn.Parameter]]:
    """What `fully_shard` actually built: each unit's module names and the parameters it manages.

    Read back from FSDP's own state rather than from the plan, so tests can prove the plan was
    applied as printed.
    """
    names = {id(m): n for n, m in model.named_modules()}
    units: dict[tuple[str, ...], list[nn.Parameter]] = {}
    seen_groups: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit left with no parameters of its own (e.g. a root whose children took all)
            units[(names[id(module)],)] = []
            continue
        if id(group) in seen_groups:
            continue
        seen_groups.add(id(group))
        units[tuple(names[id(m)] for m in group.modules)] = [p.sharded_param for p in group.fsdp_params]
    return units
