"""Which modules become FSDP units, and with what policy: decided and checked before any `fully_shard`.

A plan is a list of units; each unit is one `fully_shard` call over one or more modules, whose
parameters are all-gathered together. Everything no unit claims falls to the root unit (the
model itself). The plan is plain data, so it can be printed, compared in tests and validated
against the model before a single collective runs, which is what lets every rank raise the
same error instead of hanging.

Rules the auto plan follows, each for a reason:
- one unit per transformer block (the repeated layer): the memory/communication sweet spot;
  only the outermost block when blocks nest (an MoE sparse block inside a decoder layer); blocks
  are those the model declares, else the largest ModuleList of identical modules (XLNet, XLM);
  a reversible block (Reformer) is sharded by its children, which its backward calls;
- the input embedding is its own unit when untied, so its (often largest) weight is freed
  during the layers;
- the final norm (beside the last trainable block) and the output head form a tail unit that
  keeps its full weight after forward, because backward needs it immediately;
- a weight shared by several modules (tied embedding / head) lives in exactly one unit, else the
  two ends are sharded into two different tensors and drift apart from the second step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..tensors import tensor_aliases
from .blocks import find_blocks, find_final_norm, head_modules, module_name_of, parameter_count
from .towers import WORDS, find_towers, glob_regex

POLICIES = {
    "free_full_weight": ("reshard_after_forward", True),
    "keep_full_weight": ("reshard_after_forward", False),
    "cpu_offload": ("cpu_offload", True),
    "no_cpu_offload": ("cpu_offload", False),
    "mixed_precision": ("mixed_precision", True),
    "full_precision": ("mixed_precision", False),
}





@dataclass(frozen=True)
class UnitSpec:
    """One `fully_shard` call. `None` policies take the engine's defaults."""

    modules: tuple[str, ...]
    reshard_after_forward: bool | int | None = None
    mixed_precision: bool | None = None
    cpu_offload: bool | None = None
    source: str = ""  # the plan entry this unit came from, for error messages

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class ShardingPlan:
    """The units to shard, innermost first; the root unit (the whole model) is implicit and last."""

    units: list[UnitSpec] = field(default_factory=list)
    _roots: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (units' modules, root -> unit)

    def unit_index_of(self, module_name: str) -> int | None:
        """The innermost unit that holds `module_name` (itself or an ancestor); None means the root.
        Walks the name's ancestors through a root -> unit map: a call per module stays cheap on
        models with thousands of modules."""
        key = tuple(unit.modules for unit in self.units)
        if self._roots is None or self._roots[0] != key:
            roots: dict[str, int] = {}
            for index, modules in enumerate(key):
                for root in modules:
                    roots.setdefault(root, index)
            self._roots = (key, roots)
        roots, name = self._roots[1], module_name
        while name is not None:
            if name in roots:
                return roots[name]
            name = name.rpartition(".")[0] if "." in name else None
        return None

    def sharding_order(self) -> list[UnitSpec]:
        """The units in an order `fully_shard` accepts: a unit nested inside another goes first."""
        remaining, ordered = list(self.units), []
        while remaining:
            for unit in remaining:
                if not any(other is not unit and _contains(unit, other) for other in remaining):
                    ordered.append(unit)
                    remaining.remove(unit)
                    break
            else:
                raise PlanError(f"units {[u.name for u in remaining]} nest inside each other; no order can shard them")
        return ordered

    def unit_index_of_parameter(self, param_name: str) -> int | None:
        return self.unit_index_of(_module_of(param_name))

    def unit_names(self) -> list[str]:
        return [unit.name for unit in self.units]

    def parameter_units(self, model: nn.Module) -> dict[str, str]:
        """Each parameter's unit ("<root>" for the root), by its first (canonical) name."""
        owners = tensor_aliases(model)
        return {
            names[0]: self._unit_label(self.unit_index_of_parameter(names[0])) for names in owners.values()
        }

    def _unit_label(self, index: int | None, short: bool = False) -> str:
        if index is None:
            return "<root>"
        modules = self.units[index].modules
        if short and len(modules) > 3:
            return f"{modules[0]} (+{len(modules) - 1} more)"
        return self.units[index].name

    def validate(self, model: nn.Module) -> None:
        """Raise `PlanError` naming the entry for anything `fully_shard` would get wrong or reject."""
        modules = dict(model.named_modules())
        claimed: dict[str, str] = {}
        for unit in self.units:
            if not unit.modules:
                raise PlanError(f"plan entry {unit.source or unit.name!r} has no modules")
            for name in unit.modules:
                if name not in modules:
                    raise PlanError(f"plan entry {unit.source or name!r}: model has no module {name!r}")
                if name == "":
                    raise PlanError("the root module is always the last unit; do not list it in the plan")
                if isinstance(modules[name], (nn.ModuleList, nn.ModuleDict)):
                    raise PlanError(
                        f"plan entry {unit.source or name!r}: {name!r} is a container whose forward never runs, "
                        "so its unit would never be gathered; name its children (e.g. with '.*')"
                    )
                if name in claimed:
                    raise PlanError(
                        f"module {name!r} is claimed by two plan entries: {claimed[name]!r} and "
                        f"{unit.source or unit.name!r}"
                    )
                claimed[name] = unit.source or unit.name
            if isinstance(unit.reshard_after_forward, int) and not isinstance(unit.reshard_after_forward, bool):
                if unit.reshard_after_forward < 1:
                    raise PlanError(f"plan entry {unit.name!r}: reshard_after_forward must be >= 1")

        for names in tensor_aliases(model).values():
            units = {self.unit_index_of_parameter(n) for n in names}
            if len(units) > 1:
                labels = sorted(self._unit_label(u) for u in units)
                raise PlanError(
                    f"parameter {names[0]!r} is shared by {names[1:]} and would be claimed by two units "
                    f"{labels}; put the modules that share it in one unit"
                )

        by_unit: dict[int | None, list[tuple[str, nn.Parameter]]] = {}
        for name, param in model.named_parameters():
            by_unit.setdefault(self.unit_index_of_parameter(name), []).append((name, param))
        for index, params in by_unit.items():
            label = self._unit_label(index)
            dtypes = sorted({str(p.dtype) for _, p in params})
            if len(dtypes) > 1:
                examples = {str(p.dtype): n for n, p in params}
                raise PlanError(
                    f"unit {label!r} mixes parameter dtypes {dtypes} (e.g. {examples}); "
                    "one unit is all-gathered as one buffer, so give each dtype its own unit"
                )
            trainable = {p.requires_grad for _, p in params}
            if len(trainable) > 1:
                warnings.warn(
                    f"unit {label!r} holds both frozen and trainable parameters; it works, but gradients "
                    "are reduce-scattered for the whole unit. Give frozen modules their own unit to save memory.",
                    stacklevel=2,
                )

    def describe(self, model: nn.Module, shard_size: int = 1) -> str:
        """A table: unit, policies, parameter count and bytes each rank holds of it; then each tied
        parameter's names and the one unit that holds it."""
        rows = [("unit", "reshard", "mp", "offload", "params", "bytes/rank")]
        totals: dict[int | None, list[int]] = {}
        for name, param in model.named_parameters():
            numel, per_rank = shard_bytes(param, shard_size)
            acc = totals.setdefault(self.unit_index_of_parameter(name), [0, 0])
            acc[0] += numel
            acc[1] += per_rank
        for index in [*range(len(self.units)), None]:
            unit = self.units[index] if index is not None else None
            count, per_rank = totals.get(index, [0, 0])
            rows.append(
                (
                    self._unit_label(index, short=True),
                    _fmt(unit.reshard_after_forward if unit else None),
                    _fmt(unit.mixed_precision if unit else None),
                    _fmt(unit.cpu_offload if unit else None),
                    f"{count:,}",
                    f"{per_rank:,}",
                )
            )
        total_count = sum(v[0] for v in totals.values())
        total_bytes = sum(v[1] for v in totals.values())
        rows.append(("total", "", "", "", f"{total_count:,}", f"{total_bytes:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        towers = find_towers(model)
        if towers:
            blocks = find_blocks(model)
            for word in [w for w in WORDS if w != "audio" or towers.audio]:
                trains = {t: any(p.requires_grad for n, p in model.named_parameters() if _is_within(_module_of(n), t)
                                 and not any(_is_within(_module_of(n), q) for q in towers.projector if q != t))
                          for t in towers.of(word)}
                parts = [f"{t} ({sum(_is_within(b, t) for b in blocks)} blocks{'' if trains[t] else ', frozen'})"
                         for t in towers.of(word)]
                lines.append(f"{word}: {', '.join(parts) or '-'}")
        for names in tensor_aliases(model).values():  # the guarantee a plan keeps, said where it is kept
            if len(names) > 1:
                unit = self._unit_label(self.unit_index_of_parameter(names[0]), short=True)
                lines.append(f"tied: {' = '.join(names)}: one tensor, in unit {unit}")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "default" if value is None else str(value)


def shard_bytes(param: torch.Tensor, shard_size: int) -> tuple[int, int]:
    """(numel, bytes of the largest per-rank shard): FSDP2 shards dim 0, rounding up."""
    if param.dim() == 0:
        return 1, param.element_size()
    rows = -(-param.shape[0] // shard_size)
    return param.numel(), rows * (param.numel() // max(param.shape[0], 1)) * param.element_size()


def _is_within(module_name: str, root: str) -> bool:
    return module_name == root or module_name.startswith(root + ".")


def _contains(outer: UnitSpec, inner: UnitSpec) -> bool:
    return any(_is_within(i, o) and i != o for i in inner.modules for o in outer.modules)


def _module_of(param_name: str) -> str:
    return param_name.rpartition(".")[0]


# --------------------------------------------------------------------------- plans


def auto_plan(model: nn.Module, cpu_offload: bool | None = None, mixed_precision: bool | None = None) -> ShardingPlan:
    """The default plan (see the module docstring for the rules)."""
    blocks = find_blocks(model)
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = module_name_of(model, _safe_call(get_in))
    head = module_name_of(model, _safe_call(get_out))
    norm = find_final_norm(model, blocks)

    def unit(names, reshard=None, source="auto"):
        names = tuple(n for n in names if n is not None)
        return UnitSpec(names, reshard, mixed_precision, cpu_offload, source) if names else None

    units = []
    if embed is not None and embed != "" and not _shares_parameters(model, embed, head):
        units.append(unit([embed], source="auto: input embeddings"))
    units += [unit([b], source=f"auto: block {b}") for b in _block_unit_roots(model, blocks)]
    towers = find_towers(model)  # a VLM: what its towers hold beside their blocks (patch embedding, merger)
    units += [unit([t], source=f"auto: vision tower {t}") for t in towers.vision]
    units += [unit([t], source=f"auto: audio tower {t}") for t in towers.audio]
    named = dict(model.named_modules())
    units += [unit([m], source=f"auto: projector {t}") for t in towers.projector
              for m in _children_of_containers(named, [t], exact=False)]
    tail = [norm, *head_modules(model, head, blocks)]
    if embed is not None and _shares_parameters(model, embed, head):
        tail = [embed, *tail]
    units.append(unit(tail, reshard=False, source="auto: tail"))
    plan = ShardingPlan([u for u in units if u is not None])
    return _split_trainable(model, _merge_shared(model, plan))


def _block_unit_roots(model: nn.Module, blocks: list[str]) -> list[str]:
    """The module each block unit is rooted at: the block, or its children for a reversible block.

    A reversible block (Reformer's, marked by the RevNet convention of a `backward_pass` method)
    recomputes its children by hand in backward without calling the block itself, so a unit around
    the block would never be gathered there; its children, which are called, become the units.
    """
    roots = []
    for name in blocks:
        block = model.get_submodule(name)
        if callable(getattr(block, "backward_pass", None)):
            roots += [f"{name}.{child}" for child, module in block.named_children() if parameter_count(module)]
        else:
            roots.append(name)
    return roots


def _safe_call(fn):
    try:
        return fn() if fn is not None else None
    except (NotImplementedError, AttributeError):
        return None


def _shares_parameters(model: nn.Module, a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    pa = {id(p) for p in model.get_submodule(a).parameters()}
    return any(id(p) in pa for p in model.get_submodule(b).parameters())


def _merge_shared(model: nn.Module, plan: ShardingPlan) -> ShardingPlan:
    """Make every shared parameter live in one unit: merge the units its owners fall in.

    An owner that falls in the root joins the unit of the other owners (its module is added to
    that unit). A merged unit keeps its full weight after forward if any part did.
    """
    units = list(plan.units)
    changed = True
    while changed:
        changed = False
        current = ShardingPlan(units)
        for names in tensor_aliases(model).values():
            owner_modules = [_module_of(n) for n in names]
            indices = {current.unit_index_of(m) for m in owner_modules}
            if len(indices) <= 1:
                continue
            targets = sorted(i for i in indices if i is not None)
            rooted = [m for m in owner_modules if current.unit_index_of(m) is None]
            merged = merge_units(model, [units[i] for i in targets], rooted,
                                 f"parameter {names[0]!r} (shared by {names})")
            units = [u for i, u in enumerate(units) if i not in targets[1:]]
            units[targets[0]] = merged
            changed = True
            break
    return ShardingPlan(units)


def merge_units(model: nn.Module, parts: list[UnitSpec], extra: list[str], why: str) -> UnitSpec:
    """One unit over `parts` and the modules `extra`, in model order. It keeps its full weight after
    forward if any part did; parts that set offload or precision differently are a `PlanError`
    naming them and `why` they must be one unit (no choice between them would be the user's)."""
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    names = [m for part in parts for m in part.modules] + list(extra)
    names = sorted((m for m in dict.fromkeys(names) if not any(_is_within(m, o) and m != o for o in names)),
                   key=order.get)
    for attr in ("cpu_offload", "mixed_precision"):
        values = {getattr(part, attr) for part in parts} - {None}
        if len(values) > 1:
            entries = [part.source or part.name for part in parts]
            raise PlanError(f"{why} must be in one unit, but plan entries {entries} set {attr} differently; "
                            f"give them one {attr} setting")
    reshard = [part.reshard_after_forward for part in parts]
    return replace(parts[0], modules=tuple(names), source=" & ".join(part.source for part in parts),
                   reshard_after_forward=False if False in reshard else parts[0].reshard_after_forward)


def _split_trainable(model: nn.Module, plan: ShardingPlan) -> ShardingPlan:
    """Give the trainable part of a unit that also holds frozen parameters a unit of its own.

    With LoRA every block holds a frozen base and trainable adapters. Apart, the frozen unit
    never needs gradient buffers or a reduce-scatter, and the adapters may keep another dtype
    (fp32 adapters on a bf16 base). The trainable part is all the outermost modules in the unit
    whose parameters are all trainable, sharded together as one group: one extra all-gather per
    block, not one per adapter.
    """
    modules = dict(model.named_modules())
    units, extra = [], []
    for index, unit in enumerate(plan.units):
        names = [n for n in modules if plan.unit_index_of(n) == index]
        flags = {p.requires_grad for n in names for p in modules[n].parameters(recurse=False)}
        if flags != {True, False}:
            units.append(unit)
            continue
        # modules that own parameters directly are the ones whose forward runs (a ModuleDict of
        # adapters is only indexed, so hooks on it would never fire)
        trainable = [n for n in names if {p.requires_grad for p in modules[n].parameters(recurse=False)} == {True}]
        # a module that moves out whole (a trainable head listed beside a frozen norm) leaves the unit
        kept = tuple(m for m in unit.modules if m not in trainable)
        if not kept:  # the frozen part sits below a trainable root: no unit can hold it apart
            units.append(unit)
            continue
        units.append(replace(unit, modules=kept))
        extra.append(replace(unit, modules=tuple(trainable), source=f"{unit.source}: trainable part"))
    return ShardingPlan(units + extra)


def manual_plan(model: nn.Module, modules: dict) -> ShardingPlan:
    """A plan from glob patterns to policies, in the dict form of transformers' `fsdp_plan`.

    Each pattern makes one unit per module it matches. A key naming several patterns joined by
    `+` (e.g. `"model.embed_tokens + lm_head"`), or a tuple of patterns (transformers' spelling),
    makes one unit over all their matches. As in transformers, a container (`"model.layers"`:
    a ModuleList, ModuleDict or Sequential named as it is) stands for its children, one unit
    each, and a tied module listed without its partner takes the partner into its unit (a tied
    embedding brings its head): tied parameters always share one unit.
    """
    named = dict(model.named_modules())
    names = [n for n in named if n]
    units: list[UnitSpec] = []
    for key, policies in modules.items():
        if isinstance(policies, str):
            policies = [policies]
        settings: dict[str, Any] = {}
        for policy in policies:
            if policy not in POLICIES:
                raise PlanError(f"plan entry {key!r}: unknown policy {policy!r}; known: {sorted(POLICIES)}")
            attr, value = POLICIES[policy]
            settings[attr] = value
        matched_groups = []
        for pattern in (p.strip() for p in (key if isinstance(key, tuple) else key.split("+"))):
            regex = glob_regex(pattern)
            matches = _children_of_containers(named, [n for n in names if regex.match(n)], exact="*" not in pattern)
            if not matches:
                raise PlanError(f"plan entry {key!r}: pattern {pattern!r} matches no module of {type(model).__name__}")
            matched_groups.append(matches)
        source = " + ".join(key) if isinstance(key, tuple) else key
        if len(matched_groups) == 1:
            units += [UnitSpec((m,), source=source, **settings) for m in matched_groups[0]]
        else:
            units.append(UnitSpec(tuple(m for group in matched_groups for m in group), source=source, **settings))
    return _merge_shared(model, ShardingPlan(units))


def _children_of_containers(named: dict[str, nn.Module], matches: list[str], exact: bool) -> list[str]:
    """Each container among `matches` replaced by its children (transformers' meaning of a
    container in a plan: its forward never runs, or, for a Sequential named exactly, it is a list
    of layers). A Sequential matched through a wildcard is a module like any other."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential) if exact else (nn.ModuleList, nn.ModuleDict)
    out = []
    for name in matches:
        module = named[name]
        if isinstance(module, containers):
            out += _children_of_containers(named, [f"{name}.{child}" for child, _ in module.named_children()], exact)
        else:
            out.append(name)
    return out


def transformers_plan(model: nn.Module, spec: dict) -> ShardingPlan:
    """transformers' `fsdp_plan` forms without a "mode" key, with transformers' meaning:
    {"modules": {...}} is manual; {"cpu_offload": ..., "mixed_precision": ...} is auto with those
    policies; a flat {pattern or tuple: style or [styles]} (transformers' `model.fsdp_plan`) is
    manual, and there, as in transformers, the final norm and the output head (or the tied
    embedding) kept full after forward are one unit, so nothing is gathered again for backward."""
    if "modules" in spec:
        return build_plan(model, {"mode": "manual", **spec})
    policies_only = set(spec) <= {"cpu_offload", "mixed_precision"}
    if spec and policies_only and all(v is None or isinstance(v, bool) for v in spec.values()):
        return auto_plan(model, cpu_offload=spec.get("cpu_offload"), mixed_precision=spec.get("mixed_precision"))
    plan = manual_plan(model, spec)
    kept = [unit for unit in plan.units if unit.reshard_after_forward is False]
    norm = find_final_norm(model, find_blocks(model))
    ends = {module_name_of(model, _safe_call(getattr(model, f, None)))
            for f in ("get_input_embeddings", "get_output_embeddings")}
    if len(kept) == 2 and any(norm in u.modules for u in kept) and any(ends & set(u.modules) for u in kept):
        tail = merge_units(model, kept, [], "the final norm and the head kept full after forward")
        plan = ShardingPlan([tail if u is kept[0] else u for u in plan.units if u is not kept[1]])
    return plan


def build_plan(model: nn.Module, spec: ShardingPlan | dict | str | None = None) -> ShardingPlan:
    """Turn any accepted plan form into a validated `ShardingPlan`.

    Accepted: None or "auto"; {"mode": "auto", "cpu_offload": ..., "mixed_precision": ...};
    {"mode": "manual", "modules": {pattern: [policy, ...]}}; transformers' forms without "mode"
    (`transformers_plan`); a `ShardingPlan`.
    """
    if spec is None or spec == "auto":
        plan = auto_plan(model)
    elif isinstance(spec, ShardingPlan):
        plan = spec
    elif isinstance(spec, dict) and "mode" not in spec:
        plan = transformers_plan(model, spec)
    elif isinstance(spec, dict):
        mode = spec.get("mode")
        allowed = {"auto": {"mode", "cpu_offload", "mixed_precision"}, "manual": {"mode", "modules"}}
        if mode not in allowed:
            raise PlanError(f"fsdp_plan 'mode' must be 'auto' or 'manual', got {mode!r}")
        unknown = set(spec) - allowed[mode]
        if unknown:
            raise PlanError(f"fsdp_plan ({mode}) has unknown keys {sorted(unknown)}; allowed: {sorted(allowed[mode])}")
        if mode == "auto":
            plan = auto_plan(model, cpu_offload=spec.get("cpu_offload"), mixed_precision=spec.get("mixed_precision"))
        else:
            if not isinstance(spec.get("modules"), dict) or not spec["modules"]:
                raise PlanError("fsdp_plan manual mode needs a non-empty 'modules' dict of pattern -> policies")
            plan = manual_plan(model, spec["modules"])
    else:
        raise PlanError(f"cannot read a sharding plan from {type(spec).__name__}: {spec!r}")
    plan.validate(model)
    return plan
