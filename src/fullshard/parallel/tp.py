"""Tensor parallelism with torch's DTensor styles, planned from transformers' own TP plans.

A TP plan maps module globs to style names (transformers' vocabulary: `colwise`, `rowwise`, ...).
Each name becomes a torch `ParallelStyle` and `parallelize_module` applies it on the tp mesh,
before FSDP shards the resulting DTensors over the data-parallel dims. Nothing here is a home-made
layer: the one style torch lacks (a replicated weight applied to per-rank data, whose gradient
must be summed over tp) is a `distribute_module` call.
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ..errors import PlanError
from ..log import log_rank0
from ..plan.towers import find_towers, glob_regex
from ..tensors import tensor_aliases


class ReplicatedWithGradAllreduce(ParallelStyle):
    """A weight kept whole on every tp rank but applied to that rank's own part of the data.

    Qwen3's per-head `q_norm` / `k_norm` see only the heads of their rank, so each rank's weight
    gradient is a partial sum: left alone, the tp ranks' copies drift apart. The input is viewed
    as a DTensor sharded on dim 0 (a norm treats every row alike, so stacking the ranks' rows is
    a faithful global view); autograd then sums the weight gradient over tp, as one process would.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False) for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


# style name -> (factory, which weight dim it splits: None for none, "in"/"out" for a Linear's features).
# No `sequence_parallel`: torch's SequenceParallel assumes its input is already split by sequence,
# which holds only if the neighbouring rowwise / colwise layers and the decoder layer's inputs are
# re-laid out with it; a plan naming it alone would silently train on a wrong sequence.
TP_STYLES: dict[str, tuple[Callable[[], ParallelStyle], str | None]] = {
    "colwise": (ColwiseParallel, "out"),
    "rowwise": (RowwiseParallel, "in"),
    "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=Replicate()), "out"),
    "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), "out"),
    "replicated_with_grad_allreduce": (ReplicatedWithGradAllreduce, None),
}


def resolve_tp_plan(model: nn.Module, tp_plan: str | dict | None) -> dict[str, str]:
    """The plan as full-name glob -> style name, from "auto" (the model's transformers plan) or a dict.

    "auto" takes `config.base_model_tp_plan` under the model's `base_model_prefix`: the decoder
    layers; a VLM's is its language tower's (`text_config`'s), under that tower. Embeddings and the
    LM head stay whole over tp (FSDP still shards them): a tied pair would otherwise need one
    DTensor for two styles, and a vocabulary split needs a parallel loss.
    Entries with styles torch has no counterpart for (transformers' fused-expert `packed_colwise`,
    `moe_tp_experts`) are left out with everything under them: experts stay replicated over tp.
    """
    if tp_plan is None or tp_plan == {}:
        return {}
    if isinstance(tp_plan, dict):
        return dict(tp_plan)
    if tp_plan != "auto":
        raise PlanError(f"tp_plan must be 'auto' or a dict of module glob -> style, got {tp_plan!r}")
    inner, wrapper_prefix = _unwrapped(model)
    base, prefix = _transformers_plan(inner)
    if not base:
        raise PlanError(f"{type(inner).__name__} has no transformers TP plan (config.base_model_tp_plan); "
                        "pass tp_plan as a dict of module glob -> style")
    plan = {wrapper_prefix + prefix + pattern: style for pattern, style in base.items()}
    dropped = [p for p, s in plan.items() if s not in TP_STYLES]
    names = [n for n, _ in model.named_modules() if n]
    kept = {}
    for pattern, style in plan.items():
        under_dropped = any(pattern == d or pattern.startswith(d + ".") for d in dropped)
        if style in TP_STYLES and not under_dropped and _matches(names, pattern):
            kept[pattern] = style
    if not kept:
        raise PlanError(f"tp_plan auto: no entry of {type(model).__name__}'s TP plan matches a module "
                        f"(patterns {sorted(plan)}); pass tp_plan as a dict of module glob -> style")
    if dropped:
        log_rank0(
            f"tp_plan auto: {dropped} stay replicated over tp (no torch style for {sorted({plan[d] for d in dropped})})"
        )
    return kept


def _transformers_plan(model: nn.Module) -> tuple[dict | None, str]:
    """transformers' base-model TP plan of `model` and the prefix of the module names it is relative
    to: the model's own under its `base_model_prefix`, else, for a VLM, its language tower's (the
    vision tower has none and stays whole over tp)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if plan:
        prefix = getattr(model, "base_model_prefix", "")
        return plan, f"{prefix}." if prefix and hasattr(model, prefix) else ""
    for name in find_towers(model).language:  # the text model (the head beside it has no config)
        plan = getattr(getattr(model.get_submodule(name), "config", None), "base_model_tp_plan", None)
        if plan:
            return plan, name + "."
    return None, ""


def _unwrapped(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model under a PEFT wrapper and the prefix of its module names
    (`base_model.model.`); the model itself and "" when it is not wrapped."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    if inner is model:
        return model, ""
    return inner, next(f"{name}." for name, module in model.named_modules() if module is inner)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: str | dict | None) -> dict[str, str]:
    """Validate the plan against the model and apply it on `tp_mesh`; returns module name -> style."""
    assignments = plan_assignments(model, resolve_tp_plan(model, tp_plan), tp_mesh.size())
    apply_tp_styles(model, tp_mesh, assignments)
    return assignments


def apply_tp_styles(model: nn.Module, tp_mesh: DeviceMesh, assignments: dict[str, str]) -> None:
    """`parallelize_module` with each module's style (a collective over tp: every rank must call it)."""
    if assignments:
        parallelize_module(model, tp_mesh, {name: TP_STYLES[style][0]() for name, style in assignments.items()})
    modules = dict(model.named_modules())
    for name in assignments:
        if any(f".{factor}." in name for factor in LORA_SPLIT.values()):
            modules[name].register_forward_hook(_own_output)


def _own_output(module: nn.Module, inputs, output):
    """A split LoRA factor's output as a tensor of its own: TP hands back a view of its DTensor
    result, and FSDP, which makes the adapters their own unit, warns on every rank about any view a
    unit returns (PEFT adds the output out of place, so the view was harmless). One elementwise copy."""
    return output.clone()


def plan_assignments(model: nn.Module, plan: dict[str, str], tp_size: int) -> dict[str, str]:
    """Module name -> style for every module the plan matches; `PlanError` naming the entry otherwise.

    Refused: an unknown style, a pattern that matches no module, a module matched twice, a split
    dim (or the attention heads) not divisible by tp, and a split of a tied weight.
    """
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    assignments: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise PlanError(f"tp_plan entry {pattern!r}: unknown style {style!r}; known: {sorted(TP_STYLES)}")
        matches = _matches(names, pattern)
        if not matches:
            raise PlanError(f"tp_plan entry {pattern!r}: pattern matches no module of {type(model).__name__}")
        for name in matches:
            for part, part_style in _through_lora(pattern, style, name, modules[name]).items():
                if part in assignments:
                    raise PlanError(
                        f"tp_plan entry {pattern!r}: module {part!r} already has style {assignments[part]!r}"
                    )
                _check_split(pattern, part_style, part, modules[part], tp_size)
                assignments[part] = part_style
    if assignments:
        _check_heads(model, tp_size)
        _check_ties(model, assignments)
    return assignments


# a LoRA layer y = W x + B(A x): the adapter factor that shares W's split dim is split with it, the
# other stays whole on every tp rank. colwise: B's outputs split like W's, A sees the whole input
# (its gradient arrives summed over tp through B's input). rowwise: A's inputs split like W's,
# the sum over tp comes before B, which sees the whole (replicated) product.
LORA_SPLIT = {"colwise": "lora_B", "rowwise": "lora_A"}


def _through_lora(pattern: str, style: str, name: str, module: nn.Module) -> dict[str, str]:
    """Module name -> style for one plan match: the module itself, or, for a layer PEFT wrapped,
    its base layer and the adapter factor split with it."""
    if not hasattr(module, "base_layer") or not hasattr(module, "lora_A"):
        return {name: style}
    if style not in LORA_SPLIT:
        raise PlanError(f"tp_plan entry {pattern!r}: {name!r} carries LoRA adapters, which split only with "
                        f"colwise or rowwise, not {style!r}; leave it out of lora.target_modules or of the tp plan")
    split = {f"{name}.base_layer": style}
    for adapter in getattr(module, LORA_SPLIT[style]):
        dropout = getattr(module.lora_dropout[adapter], "p", 0.0) if adapter in module.lora_dropout else 0.0
        if style == "colwise" and dropout:
            raise PlanError(f"tp_plan entry {pattern!r}: LoRA dropout {dropout} on {name!r} would drop other "
                            "inputs on each tp rank, so the tp copies of its lora_A drift apart; set lora.dropout=0")
        split[f"{name}.{LORA_SPLIT[style]}.{adapter}"] = style
    return split


def _matches(names: list[str], pattern: str) -> list[str]:
    regex = glob_regex(pattern)
    return [n for n in names if regex.match(n)]


def _check_split(pattern: str, style: str, name: str, module: nn.Module, tp_size: int) -> None:
    side = TP_STYLES[style][1]
    if side is None:
        return
    weight = getattr(module, "weight", None)
    if not isinstance(module, (nn.Linear, nn.Embedding)) or weight is None:
        raise PlanError(f"tp_plan entry {pattern!r}: style {style!r} needs an nn.Linear or nn.Embedding, "
                        f"{name!r} is {type(module).__module__}.{type(module).__name__}")
    dim = 1 if side == "in" and isinstance(module, nn.Linear) else 0
    if weight.shape[dim] % tp_size:
        raise PlanError(f"tp_plan entry {pattern!r} ({style}): {name}.weight dim {dim} is {weight.shape[dim]}, "
                        f"not divisible by tp_size={tp_size}")


def _check_heads(model: nn.Module, tp_size: int) -> None:
    """Each tp rank must get whole attention heads: the projections reshape into (heads, head_dim)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size:
            raise PlanError(f"tp_plan: {key}={heads} is not divisible by tp_size={tp_size}")


def _check_ties(model: nn.Module, assignments: dict[str, str]) -> None:
    for names in tensor_aliases(model).values():
        modules = {n.rsplit(".", 1)[0] for n in names}
        split = sorted(m for m in modules if m in assignments and TP_STYLES[assignments[m]][1] is not None)
        if len(names) > 1 and split:
            raise PlanError(f"tp_plan entry for {split[0]!r} ({assignments[split[0]]}) would split the tied weight "
                            f"{' = '.join(names)}; leave tied modules out of the tp plan (FSDP still shards them)")
