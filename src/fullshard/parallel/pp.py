"""Pipeline parallelism for Hugging Face decoder-only causal LMs, on `torch.distributed.pipelining`.

A model is cut at decoder-layer boundaries, found from its structure (the repeated blocks, the
input and output embeddings, the final norm), not from a table of families. Each stage is a
pruned deep copy of the whole model: its own layers are real, the others are `SkippedLayer`s that
pass the hidden states through, the input embedding is kept on the first stage, the final norm
and head on the last. Nothing else changes, so every tensor keeps the name it has in the full
model (checkpoints and exports need no renaming) and each stage runs the model's own forward:
the first with `input_ids`, the others with the received hidden states as `inputs_embeds`, so
the rotary embeddings, the masks and the position ids are made on every stage exactly as the
model makes them, and the last stage's head runs through the model's own `forward` (logit
soft-capping and scaling included). A tied embedding and head stay one parameter in meaning: the
first and last stages both hold it, their gradients are summed before the step, so both apply
the same update.

The stages run `torch.distributed.pipelining.PipelineStage` under one of its schedules; each
stage is sharded by the engine like a whole model (TP, CP, FSDP units and root) over its own
sub-mesh of `pp x dp_replicate x dp_shard x cp x tp`.
"""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import agreed
from ..errors import ConfigError, FullshardError, PlanError
from ..plan.blocks import find_blocks, find_final_norm
from ..tensors import mark_held_elsewhere, parameter_counts, state_names

# schedules with one stage per rank, and those that loop over several (stage s on pp rank s % pp)
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# InterleavedZeroBubble is left out: with FSDP stages its split weight gradients came out wrong here
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS")
PP_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
MAX_SCHEDULES = 4  # schedules a pipeline keeps, one per mode and input shape (`Pipeline.schedule`)


def check_pipeline_config(pp_size: int, schedule: str, microbatches: int | None, virtual_stages: int,
                          layers_per_stage: list[int] | None) -> None:
    """The pipeline settings against each other, before any model or process group exists."""
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"pp_schedule={schedule!r} must be one of {list(PP_SCHEDULES)}")
    if virtual_stages > 1 and schedule in SINGLE_STAGE_SCHEDULES:
        raise ConfigError(f"pp_virtual_stages={virtual_stages} needs a schedule that runs several stages per rank "
                          f"({', '.join(MULTI_STAGE_SCHEDULES)}); pp_schedule={schedule!r} runs one")
    if pp_size == 1:
        raise ConfigError(f"pp_virtual_stages={virtual_stages} needs pp_size > 1")
    if virtual_stages == 1 and schedule in MULTI_STAGE_SCHEDULES:
        raise ConfigError(f"pp_schedule={schedule!r} runs several stages per rank: set pp_virtual_stages >= 2")
    stages = pp_size * virtual_stages
    if layers_per_stage is not None and len(layers_per_stage) != stages:
        raise ConfigError(f"pp_layers_per_stage has {len(layers_per_stage)} entries for pp_size={pp_size} x "
                          f"pp_virtual_stages={virtual_stages} = {stages} stages")
    n = microbatches_of(pp_size, microbatches)
    if schedule == "1F1B" and n < stages:
        raise ConfigError(f"pp_microbatches={n} is fewer than the {stages} pipeline stages pp_schedule='1F1B' needs "
                          "(it keeps every stage busy with one micro-batch each)")
    if schedule in MULTI_STAGE_SCHEDULES and n > pp_size and n % pp_size:
        raise ConfigError(f"pp_microbatches={n} must be a multiple of pp_size={pp_size} for pp_schedule={schedule!r} "
                          f"(or at most pp_size)")


def microbatches_of(pp_size: int, microbatches: int | None) -> int:
    """Pipeline micro-batches per trainer micro-batch: as given, else one per pp rank."""
    return microbatches if microbatches is not None else pp_size


# --------------------------------------------------------------------------- the model's parts


@dataclass
class DecoderParts:
    """Where the pieces of a decoder-only causal LM sit, by module name (in the model given: under
    PEFT's wrapper, every name has the wrapped model's prefix, `base_model.model.`)."""

    base: str  # the decoder stack whose forward takes input_ids or inputs_embeds ("model")
    layers: str  # its ModuleList of decoder layers ("model.layers")
    embed: str  # the input embedding ("model.embed_tokens")
    head: str  # the output head ("lm_head")
    norm: str | None  # the final norm ("model.norm")
    num_layers: int
    tied: bool  # the head's weight is the embedding's
    lm: str = ""  # the causal LM itself: "" for the model given, "base_model.model" inside a PEFT wrapper


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The parts of `model` a pipeline cut needs, or a `PlanError` saying why it cannot be cut. A
    PEFT model (LoRA) is seen through: the causal LM it wraps is cut, its adapters inside their layers."""
    lm = wrapped_lm(model)
    if lm is not model:
        prefix = next(n for n, m in model.named_modules() if m is lm)
        parts = decoder_parts(lm)
        names = {k: f"{prefix}.{getattr(parts, k)}" for k in ("base", "layers", "embed", "head")}
        return DecoderParts(**names, norm=f"{prefix}.{parts.norm}" if parts.norm else None,
                            num_layers=parts.num_layers, tied=parts.tied, lm=prefix)
    name = type(model).__name__
    blocks = find_blocks(model)
    lists = {b.rpartition(".")[0] for b in blocks}
    if not blocks or len(lists) != 1:
        raise PlanError(f"cannot split {name} into pipeline stages: it has no single list of decoder layers "
                        f"(found {sorted(lists) or 'none'})")
    layers = lists.pop()
    container = model.get_submodule(layers)
    if not isinstance(container, nn.ModuleList) or [f"{layers}.{i}" for i in range(len(container))] != blocks:
        raise PlanError(f"cannot split {name} into pipeline stages: {layers} is not a ModuleList of its decoder layers")
    base = layers.rpartition(".")[0]
    modules = {m: n for n, m in model.named_modules()}
    embed = modules.get(_safe(model.get_input_embeddings) if hasattr(model, "get_input_embeddings") else None)
    head = modules.get(_safe(model.get_output_embeddings) if hasattr(model, "get_output_embeddings") else None)
    if not base or embed is None or head is None:
        raise PlanError(f"cannot split {name} into pipeline stages: pipelining needs a causal LM with an input "
                        "embedding, a decoder stack and an output head")
    norm = find_final_norm(model, blocks)
    owned = {base: {embed, layers, norm}, "": {base, head}}
    for parent, expected in owned.items():
        for child, module in model.get_submodule(parent).named_children():
            full = f"{parent}.{child}" if parent else child
            if full not in expected and any(True for _ in module.parameters()):
                raise PlanError(f"cannot split {name} into pipeline stages: {full} holds parameters but is neither the "
                                "input embedding, a decoder layer, the final norm nor the head, so no stage can "
                                "run it where the model's forward does")
    if embed.rpartition(".")[0] != base or "." in head:
        raise PlanError(f"cannot split {name} into pipeline stages: its embedding ({embed}) is not part of the "
                        f"decoder stack {base}, or its head ({head}) is not beside it")
    if "inputs_embeds" not in inspect.signature(type(model.get_submodule(base)).forward).parameters:
        raise PlanError(f"cannot split {name} into pipeline stages: {base}'s forward takes no inputs_embeds, so a "
                        "later stage cannot hand it the hidden states")
    tied = model.get_submodule(embed).weight is model.get_submodule(head).weight
    return DecoderParts(base, layers, embed, head, norm, len(container), tied)


def wrapped_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (`get_base_model`), or `model` itself."""
    get_base = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base) else model


def _safe(fn):
    try:
        return fn()
    except (NotImplementedError, AttributeError):
        return None


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def stage_layers(model: nn.Module, parts: DecoderParts, num_stages: int,
                 layers_per_stage: list[int] | None = None) -> list[range]:
    """The decoder layers of each stage: as given, or contiguous ranges balanced by parameter count
    (the embedding counted on the first stage, the norm and head on the last)."""
    n = parts.num_layers
    if num_stages > n:
        raise ConfigError(f"{num_stages} pipeline stages (pp_size x pp_virtual_stages) but {type(model).__name__} "
                          f"has {n} decoder layers: every stage needs at least one")
    if layers_per_stage is not None:
        if sum(layers_per_stage) != n or min(layers_per_stage) < 1:
            raise ConfigError(f"pp_layers_per_stage={list(layers_per_stage)} must give every stage >= 1 layer and "
                              f"sum to the model's {n} decoder layers")
        counts = list(layers_per_stage)
    else:
        layers = model.get_submodule(parts.layers)
        costs = [_numel(layer) for layer in layers]
        costs[0] += _numel(model.get_submodule(parts.embed))
        costs[-1] += _numel(model.get_submodule(parts.head))
        costs[-1] += _numel(model.get_submodule(parts.norm)) if parts.norm else 0
        counts = _balanced(costs, num_stages)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def _balanced(costs: list[int], parts: int) -> list[int]:
    """Contiguous counts over `costs` minimising the largest part's sum (a small dynamic program;
    among equal maxima the earliest cut points win, so every rank computes the same split)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


# --------------------------------------------------------------------------- stages


class SkippedLayer(nn.Module):
    """Stands in for a decoder layer another stage runs: returns the hidden states it is given.
    It keeps the layer's plain attributes (`attention_type`, `layer_idx`), which the model's loop
    may read to pick a mask."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and isinstance(value, (str, int, float, bool)):
                setattr(self, key, value)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@dataclass
class StageInfo:
    index: int
    num_stages: int
    layers: range
    base: str
    lm: str = ""  # the causal LM inside the stage module ("" for the stage itself)
    # on the last stage: (causal LM, its forward call, targets, **loss inputs) -> what the stage
    # returns (a summed loss, or per-token log-probs), set by whoever runs the pipeline
    # (`fullshard.train.pp_step`: the chunked loss); the stage returns logits without one
    loss: Callable | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


TARGETS = "fullshard_targets"  # the keyword argument that hands the last stage its targets
LOSS_INPUTS = "fullshard_loss_inputs"  # per-row tensors the last stage's loss reads, beside targets


def _stage_forward(self, inputs: torch.Tensor, **kwargs) -> torch.Tensor:
    """One stage: token ids on the first, received hidden states (as `inputs_embeds`) on the others;
    the causal LM's own forward on the last (its head and whatever it does to the logits), the
    decoder stack's elsewhere, whose final norm is an identity before the last stage. Given its
    targets (`TARGETS`) and a loss, the last stage returns the summed loss instead of the logits,
    so the loss can go through the head inside the model's call (the chunked loss); `LOSS_INPUTS`
    (a dict of per-row tensors, split with the rows) reach that loss as keyword arguments."""
    info: StageInfo = self.fullshard_stage
    targets = kwargs.pop(TARGETS, None)
    loss_inputs = kwargs.pop(LOSS_INPUTS, None) or {}
    kwargs = {**kwargs, "input_ids" if info.first else "inputs_embeds": inputs, "use_cache": False}
    if not info.last:
        return self.get_submodule(info.base)(**kwargs).last_hidden_state
    lm = self.get_submodule(info.lm) if info.lm else self

    def call():  # the class's forward: the stage's own `forward` attribute is this function
        return type(lm).forward(lm, **kwargs)

    if targets is not None and info.loss is not None:
        return info.loss(lm, call, targets, **loss_inputs)
    return call().logits


def held_ends(parts: DecoderParts, index: int, num_stages: int) -> dict[str, bool]:
    """Which of the embedding, head and final norm stage `index` holds: the embedding on the first
    stage, the norm and head on the last, and a tied embedding / head on both ends."""
    first, last = index == 0, index == num_stages - 1
    return {parts.embed: first or (last and parts.tied), parts.head: last or (first and parts.tied),
            **({parts.norm: last} if parts.norm else {})}


def _pruned_copy(model: nn.Module, parts: DecoderParts, kept: dict[int, nn.Module | None]) -> nn.Module:
    """A deep copy of `model` without the decoder layers, embedding, head and final norm missing from
    `kept` (a `SkippedLayer`, None, an identity in their place: never copied). `kept` maps the id
    of each module kept to what stands for it in the copy: None to copy it along with the rest."""
    memo: dict[int, object] = {key: module for key, module in kept.items() if module is not None}
    for layer in model.get_submodule(parts.layers):
        if id(layer) not in kept:
            memo[id(layer)] = SkippedLayer(layer)
    for name in (parts.embed, parts.head):
        if id(model.get_submodule(name)) not in kept:
            memo[id(model.get_submodule(name))] = None
    if parts.norm and id(model.get_submodule(parts.norm)) not in kept:
        memo[id(model.get_submodule(parts.norm))] = nn.Identity()
    return copy.deepcopy(model, memo)


def build_stage(model: nn.Module, parts: DecoderParts, ranges: list[range], index: int) -> nn.Module:
    """Stage `index` of `model`: a deep copy holding only its own layers (and the embedding / norm /
    head where `held_ends` puts them), every kept tensor under its full-model name."""
    layers = model.get_submodule(parts.layers)
    kept: dict[int, nn.Module | None] = {id(layers[i]): None for i in ranges[index]}
    kept.update({id(model.get_submodule(name)): None
                 for name, held in held_ends(parts, index, len(ranges)).items() if held})
    stage = _pruned_copy(model, parts, kept)
    stage.fullshard_stage = StageInfo(index, len(ranges), ranges[index], parts.base, parts.lm)
    stage.forward = types.MethodType(_stage_forward, stage)
    _mark_held_elsewhere(stage, model, parts)
    return stage


def _mark_held_elsewhere(part: nn.Module, model: nn.Module, parts: DecoderParts) -> None:
    """What other ranks hold of `model`, marked on the part this rank holds, and on the causal LM
    inside a PEFT wrapper too (a merged export writes that model's tensors)."""
    for name in ("", parts.lm) if parts.lm else ("",):
        whole = model.get_submodule(name)
        mark_held_elsewhere(part.get_submodule(name), state_names(whole),
                            getattr(whole, "_keys_to_ignore_on_load_unexpected", None))


def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The stages a pp rank runs: s, s + pp, s + 2pp, ... (the loop placement torch's multi-stage schedules use)."""
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def rank_module(model: nn.Module, parts: DecoderParts, stages: list[nn.Module]) -> nn.Module:
    """One module for what this rank holds, for the optimizer, checkpoints and exports: the stage
    itself, or a copy of the model sharing every module its stages hold (names unchanged). Built
    before the stages are sharded: sharding then swaps the parameters of the shared modules for both."""
    if len(stages) == 1:
        return stages[0]
    layers = model.get_submodule(parts.layers)
    kept: dict[int, nn.Module | None] = {}
    for stage in stages:
        info: StageInfo = stage.fullshard_stage
        for i in info.layers:
            kept[id(layers[i])] = stage.get_submodule(parts.layers)[i]
        for name, held in held_ends(parts, info.index, info.num_stages).items():
            if held:
                kept[id(model.get_submodule(name))] = stage.get_submodule(name)
    holder = _pruned_copy(model, parts, kept)
    _mark_held_elsewhere(holder, model, parts)
    return holder


# --------------------------------------------------------------------------- the pipeline a rank runs


@dataclass
class Pipeline:
    """What one rank runs of the pipeline: its stage modules (sharded), the schedule over them, and
    the process groups that join the stages (`pp_group`) and the two ends of a tied weight."""

    stages: list[nn.Module]
    num_stages: int
    schedule_name: str
    microbatches: int
    pp_group: object
    device: torch.device
    parts: DecoderParts
    ranges: list[range]
    dims: object  # the ParallelDims of the run
    tie_group: object = None
    loss_fn: Callable | None = None
    _schedules: dict = field(default_factory=dict)

    @property
    def has_first(self) -> bool:
        return any(s.fullshard_stage.first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.fullshard_stage.last for s in self.stages)

    def schedule(self, key=None):
        """The schedule for `key` (a mode and the shape of its inputs), built on its first use; its
        loss function is `self.loss_fn`, read at each call.

        torch's stages size their receive buffers by a metadata pass (a real forward and backward)
        on their first step, re-run when a schedule switches between training and forward-only,
        and that pass drops the gradients accumulated so far. So each mode and input shape keeps a
        schedule of its own, made when no gradient is pending (every caller keeps its shapes fixed
        within an optimizer step), and the ranks agree on `key` (the same shapes, the same
        calls)."""
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class

            stages = [PipelineStage(s, s.fullshard_stage.index, self.num_stages, self.device,
                                    group=self.pp_group) for s in self.stages]
            cls = get_schedule_class(self.schedule_name)
            target = stages[0] if self.schedule_name in SINGLE_STAGE_SCHEDULES else stages
            if len(self._schedules) >= MAX_SCHEDULES:  # the oldest shape's buffers go
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[key] = cls(target, n_microbatches=self.microbatches, loss_fn=self._loss,
                                       scale_grads=False)
        return self._schedules[key]

    @property
    def last_rank(self) -> int:
        """The global rank of this rank's pp peer that runs the last stage (pp rank pp - 1: stage
        s runs on pp rank s % pp)."""
        return dist.get_global_rank(self.pp_group, dist.get_world_size(self.pp_group) - 1)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    def set_stage_loss(self, loss: Callable | None) -> None:
        """The loss the last stage computes itself from its targets (see `_stage_forward`)."""
        for stage in self.stages:
            if stage.fullshard_stage.last:
                stage.fullshard_stage.loss = loss

    def tied_parameter(self) -> nn.Parameter | None:
        """This rank's end of a tied embedding / head (on the first and the last stage), or None."""
        if not self.parts.tied:
            return None
        for stage in self.stages:
            if stage.fullshard_stage.first or stage.fullshard_stage.last:
                return stage.get_submodule(self.parts.embed).weight
        return None


def tie_group(world_mesh, pp_size: int):
    """The group of the first and last pp ranks of this rank's column (where a tied weight's two ends
    are): the pp group itself at pp 2, else one new group per column, made in the same order everywhere."""
    if pp_size == 2:
        return world_mesh["pp"].get_group()
    columns = world_mesh.mesh.reshape(pp_size, -1)
    mine = None
    for j in range(columns.shape[1]):
        ranks = [int(columns[0, j]), int(columns[-1, j])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def prepare_pipeline(model: nn.Module, engine) -> nn.Module:
    """Cut `model` into stages, keep this rank's, shard each with `engine.prepare_stage`, and return
    what this rank holds (`rank_module`) with its `Pipeline` as `.fullshard_pipeline`.

    The cut is decided on every rank from the model alone and agreed on, so a model that cannot be
    cut, or more stages than layers, is one named error on every rank."""
    config, dims, meshes = engine.config, engine.dims, engine.meshes
    with agreed(FullshardError, f"splitting {type(model).__name__} into pipeline stages"):
        parts = decoder_parts(model)
        ranges = stage_layers(model, parts, dims.pp * config.pp_virtual_stages, config.pp_layers_per_stage)
    indices = stage_indices(meshes.pp.get_local_rank(), dims.pp, config.pp_virtual_stages)
    stages = [build_stage(model, parts, ranges, index) for index in indices]
    module = rank_module(model, parts, stages)
    module.whole_model_parameter_counts = parameter_counts(model)
    stages = [engine.prepare_stage(stage) for stage in stages]
    module.fullshard_pipeline = Pipeline(
        stages, len(ranges), config.pp_schedule, microbatches_of(dims.pp, config.pp_microbatches),
        meshes.pp.get_group(), engine.device, parts, ranges, dims,
        tie_group=tie_group(meshes.world, dims.pp) if parts.tied else None)
    return module


def pipeline_of(model) -> Pipeline | None:
    """The pipeline a model runs under, or None for a model that is not cut into stages."""
    return getattr(model, "fullshard_pipeline", None)
