"""`FSDP2Engine`: turns a plan into `fully_shard` calls with the precision, reshard and offload policies.

The engine owns the policies; `plan.py` owns which modules are units. Loading weights into a
model built on the meta device lives in `fullshard.loading`; the engine only calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from .activation_offload import apply_activation_offload
from .compile import compile_blocks, set_block_prefetch
from .distributed import (
    Meshes,
    ParallelDims,
    agreed,
    detect_device_type,
    get_world_size,
    has_accelerator,
    init_distributed,
    shard_mesh,
)
from .dtypes import DTYPES
from .errors import ConfigError, PlanError
from .float8 import check_float8_config, check_float8_device, convert_to_float8
from .fsdp import ac_mode, apply_activation_checkpointing, keep_output_capturing, needs_weight_in_backward
from .loading import materialize_and_load
from .loading.materialize import tie_declared_weights
from .loading.rank0 import LOADED, RANK0, agree_on_layout, init_from_rank0
from .log import warn_rank0
from .parallel.cp import check_context_parallel, enable_context_parallel
from .parallel.ep import apply_expert_parallel, check_expert_parallel, global_router_loss
from .parallel.ep_lists import agree_on_expert_calls, apply_expert_lists
from .parallel.images import agree_on_images
from .parallel.pp import check_pipeline_config, prepare_pipeline
from .parallel.tp import apply_tp_styles, plan_assignments, resolve_tp_plan
from .plan.build import ShardingPlan, build_plan
from .plan.towers import freeze


@dataclass
class EngineConfig:
    """Everything that decides how a model is sharded, each setting documented under its field (what
    `fullshard train --help` prints for `fsdp.*`). LLaMA-Factory's FSDP2 `dist_config` dict maps onto it."""

    mixed_precision: str = "fp32"
    """compute dtype of the all-gathered weights (bf16 / fp16 / fp32); the sharded master weights keep their own dtype
    and gradients are reduced in `reduce_dtype`"""
    reduce_dtype: str = "fp32"
    """dtype gradients are reduced in"""
    reshard_after_forward: bool | int = True
    """True frees the full weight after each unit's forward (least memory), False keeps it until backward (no second
    all-gather), an int reshards to groups of that many ranks (inside a node, say)"""
    offload_params: bool = False
    """keep sharded parameters, gradients and optimizer state on CPU"""
    pin_memory: bool = True
    """pin the offloaded CPU memory; only honoured where an accelerator exists"""
    activation_checkpointing: bool | str = False
    """recompute activations in backward (non-reentrant): `full` (or true) every block whole, `selective` every block
    with the outputs of attention and of every other matmul kept (torchtitan's per-op policy), `every_n` every
    `ac_every`-th block whole, `none` (or false) nothing"""
    ac_every: int = 2
    """with `every_n`, checkpoint the ac_every-th, 2 x ac_every-th, ... block"""
    activation_offload: bool = False
    """move the tensors each block saves for backward to host memory during forward and back one block ahead in
    backward (`fullshard.activation_offload`); with checkpointing only the checkpoints move"""
    float8: str = "none"
    """none, tensorwise or rowwise: the blocks' Linear layers compute in float8 through torchao (`fullshard.float8`;
    needs `fullshard[float8]` and an SM 8.9+ GPU or the CPU); tensorwise also all-gathers their weights in float8.
    Weights stay in the model's dtype"""
    float8_skip: list[str] = field(default_factory=list)
    """globs of further Linear layers to keep in high precision"""
    plan: Any = "auto"
    """auto, a transformers `fsdp_plan` dict, or a `ShardingPlan`"""
    dp_replicate: int = 1
    """replicas of the sharded model over the mesh (HSDP when > 1)"""
    dp_shard: int = -1
    """ranks each replica is sharded over; -1: the rest of the world"""
    tp_size: int = 1
    """tensor-parallel ranks per layer; the mesh is dp_replicate x dp_shard x cp x tp"""
    tp_plan: Any = "auto"
    """auto (the model's transformers TP plan) or a dict of module glob -> style name"""
    cp_size: int = 1
    """context-parallel ranks per sequence; FSDP shards over dp_shard x cp"""
    ep_size: int = 1
    """expert-parallel ranks per MoE layer: each holds num_experts / ep_size whole experts, sharded further over the
    dp_shard x cp / ep_size ranks holding the same ones (`parallel/ep.py`)"""
    dcp_path: str | None = None
    """a DCP checkpoint to load the weights from instead of model.name_or_path"""
    compile: bool | str = False
    """`torch.compile` each block in place before sharding (`fullshard.compile`); True uses inductor, a string names
    another `torch.compile` backend (torchtitan's `compile.backend`)"""
    prefetch: int = 0
    """explicit all-gather prefetch depth across block units (0: FSDP's default order;
    `fullshard.compile.set_block_prefetch`)"""
    timeout_s: float = 1800.0
    """how long a collective waits for a rank that stopped calling it before every rank fails (the process group's
    timeout), so a stalled rank ends the run instead of hanging it"""
    pp_size: int = 1
    """pipeline stages over ranks; the mesh is pp x dp_replicate x dp_shard x cp x tp, each stage sharded over its own
    sub-mesh (`fullshard.parallel.pp`)"""
    pp_schedule: str = "1F1B"
    """GPipe, 1F1B, Interleaved1F1B or LoopedBFS (the last two need pp_virtual_stages >= 2)"""
    pp_microbatches: int | None = None
    """pipeline micro-batches per trainer micro-batch, dividing it (unset: pp_size)"""
    pp_virtual_stages: int = 1
    """stages per pp rank (stage s runs on pp rank s mod pp_size)"""
    pp_layers_per_stage: list[int] | None = None
    """decoder layers of each stage, in order; unset: balanced by parameter count"""
    freeze: Any = "auto"
    """parts left untrained, set before sharding (no gradients, no optimizer state): the words vision / audio /
    projector / language, or globs over module and parameter names; "auto" freezes a VLM's vision (and an Omni
    model's audio) tower and nothing of other models; [] or "none" trains everything (`fullshard.plan.towers`)"""

    def __post_init__(self) -> None:
        for key in ("mixed_precision", "reduce_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"{key} must be one of {sorted(DTYPES)}, got {getattr(self, key)!r}")
        raf = self.reshard_after_forward
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
            raise ValueError(f"reshard_after_forward must be a bool or an int >= 1, got {raf!r}")
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise ConfigError(f"compile must be a bool or a torch.compile backend name, got {self.compile!r}")
        self.activation_checkpointing = ac_mode(self.activation_checkpointing)
        every = self.ac_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"ac_every must be an int >= 1, got {self.ac_every!r}")
        check_float8_config(self.float8, self.float8_skip, self.tp_size)
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        for key in ("tp_size", "cp_size", "ep_size", "pp_size", "pp_virtual_stages"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        if self.pp_microbatches is not None and (not isinstance(self.pp_microbatches, int) or self.pp_microbatches < 1):
            raise ConfigError(f"pp_microbatches must be an int >= 1 or unset, got {self.pp_microbatches!r}")
        if self.pp_size > 1 or self.pp_virtual_stages > 1:
            check_pipeline_config(self.pp_size, self.pp_schedule, self.pp_microbatches, self.pp_virtual_stages,
                                  self.pp_layers_per_stage)

    @classmethod
    def from_any(cls, config: "EngineConfig | dict | None", **overrides) -> "EngineConfig":
        """An `EngineConfig` from itself, a dict, or a config object (a dataclass such as
        LLaMA-Factory's `FSDP2Params`, or a mapping such as its `PluginConfig`). Keys of LLaMA-Factory's
        set that fullshard has no use for are named once in a warning and dropped, `bf16` is read
        as `mixed_precision`; any other unknown key is refused."""
        values = cls.values_of(config)
        values.update(overrides)
        if "bf16" in values:  # LLaMA-Factory's `FSDP2Engine(dist_config, bf16=...)` spelling of the precision
            wanted = "bf16" if values.pop("bf16") else "fp32"
            if values.setdefault("mixed_precision", wanted) != wanted:
                raise ValueError(f"bf16 asks for {wanted} but mixed_precision={values['mixed_precision']!r}: "
                                 "set one of them")
        unused = sorted(k for k in values if k in SEED_ONLY_KEYS)
        if unused:
            why = ", ".join(SEED_ONLY_KEYS[k] for k in unused)
            warn_rank0(f"dist_config keys {unused} are LLaMA-Factory's ({why}); fullshard does not use them")
            values = {k: v for k, v in values.items() if k not in SEED_ONLY_KEYS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown dist_config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def values_of(cls, config: "EngineConfig | dict | None") -> dict:
        """The keys a config sets, whatever form it came in."""
        if config is None:
            return {}
        if isinstance(config, Mapping):
            return dict(config)
        if is_dataclass(config) and not isinstance(config, type):
            return asdict(config)
        raise TypeError(f"dist_config must be a dict, a dataclass or an EngineConfig, got {type(config).__name__}")


# the keys of LLaMA-Factory's FSDP2 plugin (its `dist_config` / `FSDP2Params`) that fullshard accepts and ignores
SEED_ONLY_KEYS = {"name": "its distributed plugin's name"}


class FSDP2Engine:
    """Shards models with FSDP2 over the data-parallel dims of a mesh, after tensor parallelism on its tp dim.

    `FSDP2Engine({"mixed_precision": "bf16", ...})` starts the process group when needed (world
    size 1 works without torchrun) and builds the mesh from `dp_replicate` / `dp_shard` /
    `cp_size` / `tp_size`, unless a `device_mesh` is given (one with a "tp" dim gives TP that dim
    and FSDP the others). `self.mesh` is the mesh FSDP shards over.
    """

    def __init__(
        self, dist_config: EngineConfig | dict | None = None, device_mesh: DeviceMesh | None = None, **overrides
    ):
        self.config = EngineConfig.from_any(dist_config, **overrides)
        self.device_type = device_mesh.device_type if device_mesh is not None else detect_device_type()
        self.device = init_distributed(self.device_type, timeout_s=self.config.timeout_s)
        if device_mesh is None:
            self.dims = ParallelDims(dp_replicate=self.config.dp_replicate, dp_shard=self.config.dp_shard,
                                     world_size=get_world_size(), cp=self.config.cp_size, tp=self.config.tp_size,
                                     pp=self.config.pp_size, ep=self.config.ep_size)
            self.meshes = self.dims.build_meshes(self.device_type)
        else:
            self.meshes, self.dims = meshes_of(device_mesh, self.config)
        self.mesh = self.meshes.fsdp
        self.plan: ShardingPlan | None = None
        self.tp_assignments: dict[str, str] = {}
        self._ignored_params: set[nn.Parameter] = set()  # experts no FSDP unit manages (`_shard_experts`)

    # ------------------------------------------------------------------ policies

    @property
    def shard_size(self) -> int:
        return shard_mesh(self.mesh).size()

    def get_mp_policy(self, enabled: bool | None = None) -> MixedPrecisionPolicy:
        """The mixed-precision policy; `enabled=True` on an fp32 engine means bf16 (transformers' flag)."""
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
        stay meta (to be materialised by the loader). Under pipeline parallelism this rank's
        stages are cut out of the model and each is prepared so (`fullshard.parallel.pp`).
        """
        if self.dims.pp > 1:
            return prepare_pipeline(model, self)
        return self.prepare_stage(model)

    def prepare_stage(self, model: nn.Module) -> nn.Module:
        """`prepare_model` for one whole model or one pipeline stage."""
        freeze(model, self.config.freeze)  # before the plan: a frozen tower's units hold no gradients
        plan = build_plan(model, self.config.plan)
        self._ignored_params = set()
        self.apply_float8(model)
        self.apply_tensor_parallel(model)
        self.apply_context_parallel(model)
        self.apply_expert_parallel(model)
        apply_activation_checkpointing(model, self.config.activation_checkpointing,
                                       self.config.ac_every)
        if self.config.compile:  # after checkpointing, before sharding: torchtitan's order
            compile_blocks(model, **({"backend": self.config.compile} if isinstance(self.config.compile, str) else {}))
        if self.config.activation_offload:  # after compiling: hooks around a compiled block's graph
            apply_activation_offload(model, self.device)
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
                ignored_params=self._ignored_params or None,
            )
            if not any(needs_weight_in_backward(module) for module in targets):
                targets[0].set_unshard_in_backward(False)
        fully_shard(
            model,
            mesh=self.mesh,
            shard_placement_fn=self._placement,
            reshard_after_forward=self._reshard(None),
            mp_policy=self.get_mp_policy(),
            offload_policy=self.get_offload_policy(),
            ignored_params=self._ignored_params or None,
        )
        if self.config.prefetch:
            set_block_prefetch(model, self.config.prefetch)
        keep_output_capturing(model)
        agree_on_images(model, self.mesh)  # a VLM: ranks without images run the vision path when others have them
        self.plan = plan
        return model

    def apply_float8(self, model: nn.Module) -> None:
        """The blocks' Linear layers to torchao's float8 ones, before any sharding (a no-op with
        float8 none); tp is refused here too, for a caller's mesh with a tp dim."""
        if self.config.float8 == "none":
            return
        with agreed(ConfigError, "float8"):
            check_float8_config(self.config.float8, self.config.float8_skip, self.dims.tp)
            check_float8_device(self.device)
        convert_to_float8(model, self.config.float8, self.config.float8_skip)

    def apply_tensor_parallel(self, model: nn.Module) -> None:
        """Split the layers the TP plan names over the tp mesh (a no-op without one).

        The plan is checked on every rank first, so a bad entry is one agreed `PlanError` rather
        than some ranks waiting in `parallelize_module`'s collectives for ones that raised.
        """
        if self.meshes.tp is None:
            return
        with agreed(PlanError, "tensor parallel plan"):
            plan = resolve_tp_plan(model, self.config.tp_plan)
            assignments = plan_assignments(model, plan, self.meshes.tp.size())
        apply_tp_styles(model, self.meshes.tp, assignments)
        self.tp_assignments = assignments

    def apply_context_parallel(self, model: nn.Module) -> None:
        """Route attention through the all-to-all over the cp mesh (a no-op without one); batches
        must then be split with `fullshard.parallel.cp.context_parallel_batch`."""
        if self.meshes.cp is None:
            return
        with agreed(PlanError, "context parallel"):
            check_context_parallel(model, self.dims.tp, self.dims.cp)
        enable_context_parallel(model, self.meshes.cp)

    def apply_expert_parallel(self, model: nn.Module) -> None:
        """Split every MoE experts module over the ep mesh and make each its own FSDP unit over the
        efsdp ranks (a no-op without ep). What cannot be split is one agreed `PlanError` first.
        With or without ep, a MoE's load-balancing loss becomes that of the whole batch (tp ranks
        share their tokens, pp ranks hold other stages: so only without either)."""
        if get_world_size() > 1 and self.dims.tp == 1 and self.dims.pp == 1:
            global_router_loss(model, dist.group.WORLD)
        if self.meshes.ep is None:
            agree_on_expert_calls(model, self.mesh)  # per-expert lists: the same experts get gradients on every rank
            return
        with agreed(PlanError, "expert parallel"):
            experts = check_expert_parallel(model, self.dims.ep)
        apply_expert_parallel(model, experts, self.meshes.ep, shard=self._shard_experts)
        apply_expert_lists(model, self.meshes.ep, shard=self._shard_experts)

    def _shard_experts(self, module: nn.Module) -> float:
        """Make an experts module its own FSDP unit over the efsdp ranks; returns the factor its dispatch
        must divide the experts' gradients by itself (1 where FSDP does it).

        An expert's gradient already sums its ep group's tokens: it is divided by every data-parallel
        rank, as the dense gradients are, not by efsdp alone. Over several ranks FSDP sums then divides
        (gloo has no pre-multiplied sum). Experts no other rank holds (efsdp = 1) stay out of FSDP: as a
        unit of one rank it would still copy them whole for every forward and backward and hold their
        gradient three times over (unsharded, reduce-scatter in and out); the other units are told to
        leave them alone (`ignored_params`) and the dispatch divides their gradient and casts them to
        the compute dtype. (Not where parameters are offloaded: that is FSDP's to do.)
        """
        divisor = float(self.dims.fsdp_shard_size)
        if self.dims.efsdp == 1 and not self.config.offload_params:
            self._ignored_params.update(module.parameters())
            return divisor
        raf = self._reshard(None)
        fully_shard(module, mesh=self.meshes.efsdp, reshard_after_forward=raf if isinstance(raf, bool) else True,
                    mp_policy=self.get_mp_policy(), offload_policy=self.get_offload_policy())
        module.set_gradient_divide_factor(divisor)
        module.set_force_sum_reduction_for_comms(self.dims.efsdp > 1)
        return 1.0

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
        sharded and then loaded from `hf_model_path` (or the engine's `dcp_path`); a model loaded
        on rank 0 and on meta elsewhere is sharded and filled from rank 0 (`loading.rank0`).

        Weights the config declares tied but that were built apart on meta (accelerate's
        `init_empty_weights`) are tied first, so the plan keeps them in one unit.
        """
        tie_declared_weights(model)
        tp = "with tensor parallelism (tp_size > 1)" if self.meshes.tp is not None else None
        layout = agree_on_layout(model, supported=tp)
        if layout == RANK0:
            return init_from_rank0(model, self.prepare_model, self.device)
        if layout == LOADED:
            return self.prepare_model(model)
        source = hf_model_path or getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source and not self.config.dcp_path:
            raise ValueError(
                "the model is on the meta device and no weights were named: pass hf_model_path, "
                "or set dcp_path in the engine config"
            )
        return self.materialize_and_load(self.prepare_model(model), source, self.config.dcp_path, **load_kwargs)

    def materialize_and_load(self, model: nn.Module, hf_model_path: str | None, dcp_path: str | None = None, **kwargs):
        return materialize_and_load(model, hf_model_path, dcp_path=dcp_path, device=self.device, **kwargs)


def meshes_of(device_mesh: DeviceMesh, config: EngineConfig) -> tuple[Meshes, ParallelDims]:
    """Split a caller's mesh: a dim named "tp" is tensor parallel, the others (one, or two for HSDP)
    are FSDP's, as in transformers' ("fsdp", "tp") mesh. A tp dim of size 1 still applies the plan."""
    names = device_mesh.mesh_dim_names or ()
    for key in ("cp_size", "pp_size", "ep_size"):
        if getattr(config, key) > 1:
            raise ConfigError(f"{key} > 1 needs the engine to build its own mesh; do not pass device_mesh")
    if "tp" not in names:
        if config.tp_size > 1:
            raise ConfigError(f"tp_size={config.tp_size} but the given device_mesh has no 'tp' dim (dims: {names})")
        meshes = Meshes(world=device_mesh, fsdp=device_mesh)
    else:
        tp = device_mesh["tp"]
        if config.tp_size not in (1, tp.size()):
            raise ConfigError(f"tp_size={config.tp_size} but the device_mesh's 'tp' dim has {tp.size()} ranks")
        rest = tuple(n for n in names if n != "tp")
        meshes = Meshes(world=device_mesh, fsdp=device_mesh[rest] if len(rest) > 1 else device_mesh[rest[0]], tp=tp)
    shape = tuple(meshes.fsdp.shape)
    dims = ParallelDims(dp_replicate=shape[0] if len(shape) > 1 else 1, dp_shard=shape[-1],
                        world_size=device_mesh.size(), tp=meshes.tp.size() if meshes.tp is not None else 1)
    return meshes, dims


def __getattr__(name: str):
    if name == "apply_fsdp2":  # transformers' entry point, now a face of its own (its old home was here)
        import importlib

        return importlib.import_module("fullshard.faces.transformers").apply_fsdp2
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
