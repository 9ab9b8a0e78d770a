"""`materialize_and_load`: a sharded model on meta, filled from a checkpoint, in four named phases.

1. plan reads: metadata only (files, keys, shapes); agreed on every rank before any storage is
   touched, so a checkpoint that does not fit leaves the model as it was;
2. materialise: storage on the device, buffers restored or recomputed, adapters kept;
3. read slices: each rank copies only its region of every tensor, with no collective in flight;
   failures are agreed on afterwards, so no rank is left waiting for one that raised;
4. prove: ties are still one tensor, and with `verify` nothing is left unwritten.

Every phase works on a `ModelView`, taken once before anything changes, and
on a `Source` (`source.py`, `dcp.py`), so no phase forks on the checkpoint format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..distributed import agreed, current_device, get_rank, get_world_size
from ..dtypes import dtype_name, resolve_dtype
from ..errors import LoadError
from ..tensors import local_tensor, named_state_tensors, tensor_aliases, tied_groups
from .dcp import DCPSource
from .materialize import BufferSnapshot, broken_ties, find_unfilled, materialize, snapshot_buffers
from .resolve import resolve_checkpoint_dir
from .shards import shard_count, slice_bytes
from .source import HFSource, Source, SourcePlan


@dataclass
class LoadReport:
    """What one rank did. `bytes_read` counts tensor bytes the readers copied; `byte_budget` is
    this rank's fair share (checkpoint / shards) plus one row of every tensor for uneven splits."""

    source: str
    format: str
    rank: int
    world_size: int
    dtype: str = ""
    bytes_read: int = 0
    checkpoint_bytes: int = 0
    byte_budget: int = 0
    tensors_loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    restored_buffers: list[str] = field(default_factory=list)
    recomputed_buffers: list[str] = field(default_factory=list)
    buffers_from_init: list[str] = field(default_factory=list)
    whole_tensor_conversions: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # held their values through materialising (checkpoint_view)
    verified: bool = False


@dataclass
class ModelView:
    """The model as the checkpoint names it, taken once, before anything is materialised; every
    phase reads it instead of walking the model again.

    `own_name` maps each checkpoint-side name to the model's name for it (the identity unless a
    `checkpoint_view` renames a wrapper's tensors); `groups` are the names sharing one tensor;
    `kept` are parameters the checkpoint does not hold (LoRA adapters), with their values;
    `elsewhere` the checkpoint-side names of what other ranks hold (other pipeline stages).
    """

    keys_model: nn.Module
    names: dict[str, torch.Tensor]
    own_name: dict[str, str]
    groups: list[list[str]]
    kept: dict[str, torch.Tensor]
    snapshot: BufferSnapshot
    ties: list[list[str]]
    elsewhere: frozenset[str] = frozenset()


def view_model(model: nn.Module, checkpoint_view=None) -> ModelView:
    state = named_state_tensors(model)
    rename = checkpoint_view.name if checkpoint_view is not None else (lambda name: name)
    own_name = {rename(n): n for n in state if rename(n) is not None}
    groups = [[rename(n) for n in group if rename(n) is not None]
              for group in tensor_aliases(model, persistent_buffers=True).values()]
    params = dict(model.named_parameters())
    viewed = set(own_name.values())
    kept = {n: local_tensor(t).detach().clone() for n, t in state.items() if n not in viewed and n in params}
    keys_model = checkpoint_view.model if checkpoint_view is not None else model
    elsewhere = {rename(n) for n in getattr(model, "names_held_elsewhere", None) or ()} - {None}
    elsewhere |= set(getattr(keys_model, "names_held_elsewhere", None) or ())
    return ModelView(keys_model=keys_model, names={c: state[n] for c, n in own_name.items()}, own_name=own_name,
                     groups=[g for g in groups if g], kept=kept, snapshot=snapshot_buffers(model),
                     ties=tied_groups(model), elsewhere=frozenset(elsewhere))


# --------------------------------------------------------------------------- phase 1: plan reads


def plan_reads(model: nn.Module, view: ModelView, source: Source, dtype: torch.dtype | None, strict: bool,
               report: LoadReport) -> tuple[SourcePlan, torch.dtype | None]:
    """What the source fills and the dtype to load into; raises if the checkpoint does not fit."""
    plan = source.plan(view.names)
    target = dtype or plan.dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    report.format, report.dtype = source.format, dtype_name(target) if target is not None else ""
    report.checkpoint_bytes, report.whole_tensor_conversions = plan.checkpoint_bytes, plan.whole_tensor_conversions
    ignore_missing = _matching(view.keys_model, "_keys_to_ignore_on_load_missing", view.names)
    for group in view.groups:
        if any(n in plan.shapes for n in group) or set(group) & ignore_missing:
            continue
        if all(view.snapshot.values.get(view.own_name[n]) is not None for n in group):
            report.buffers_from_init += group  # a real persistent buffer the checkpoint lacks
        else:
            report.missing.append(group[0])
    report.unexpected = [k for k in plan.unexpected if k not in view.elsewhere]
    report.mismatched = sorted(f"{k}: checkpoint {list(shape)}, model {list(view.names[k].shape)}"
                               for k, shape in plan.shapes.items() if tuple(shape) != tuple(view.names[k].shape))
    problems = [_listing(title, names) for title, names in (
        ("missing keys", report.missing), ("unexpected keys", report.unexpected),
        ("shape mismatches", report.mismatched)) if names]
    if report.mismatched or (strict and problems):
        raise LoadError(f"checkpoint {source.location!r} does not fit {type(model).__name__}: " + "; ".join(problems))
    return plan, target


# --------------------------------------------------------------------------- phase 2: materialise


def materialise(model: nn.Module, view: ModelView, target: torch.dtype | None, device: torch.device, verify: bool,
                report: LoadReport, init_missing=None) -> dict[str, torch.Tensor]:
    """Storage for every tensor; buffers and kept adapters back; missing keys (strict=False) given
    the model's own init, or `init_missing(model, names)`'s. Returns the new tensors under their
    checkpoint-side names."""
    if target is not None and any(p.is_floating_point() and p.dtype != target
                                  for n, p in model.named_parameters() if n not in view.kept):
        model.to(target)  # still on meta: free; buffers get their own dtype back from the snapshot
    report.recomputed_buffers = materialize(model, device, view.snapshot, fill=verify)
    report.restored_buffers = sorted(n for n, v in view.snapshot.values.items()
                                     if v is not None and n in view.snapshot.non_persistent)
    state = named_state_tensors(model)
    with torch.no_grad():
        for name, value in view.kept.items():
            local_tensor(state[name]).copy_(value)
        if report.missing and init_missing is not None:
            init_missing(model, [view.own_name[n] for n in report.missing])
        elif report.missing:
            _init_missing(model, [view.own_name[n] for n in report.missing], state)
    return {c: state[n] for c, n in view.own_name.items()}


def _init_missing(model: nn.Module, missing: list[str], state: dict[str, torch.Tensor]) -> None:
    """strict=False: give keys the checkpoint lacks the model's own init instead of garbage."""
    init = getattr(model, "_init_weights", None)
    modules = dict(model.named_modules())
    for name in missing:
        module = modules.get(name.rpartition(".")[0])
        if init is not None and module is not None:
            init(module)
        else:
            local_tensor(state[name]).zero_()


# --------------------------------------------------------------------------- phase 3: read slices


def read_slices(model: nn.Module, view: ModelView, source: Source, plan: SourcePlan,
                names: dict[str, torch.Tensor], report: LoadReport) -> None:
    """One read per tensor (a tie stored under two names is read once), then the byte budget."""
    targets = {}
    for group in view.groups:
        stored = next((n for n in group if n in plan.shapes), None)
        if stored is not None:
            targets[stored] = names[stored]
    report.bytes_read = source.read(targets)
    report.tensors_loaded = len(targets)
    rows = sum(slice_bytes(t, plan.dtypes[k]) for k, t in targets.items())
    report.byte_budget = report.checkpoint_bytes // shard_count(model) + rows


# --------------------------------------------------------------------------- phase 4: prove


def prove(model: nn.Module, view: ModelView, verify: bool, location: str, report: LoadReport) -> None:
    broken = broken_ties(model, view.ties)
    if broken:
        raise LoadError(f"tied weights {broken} are no longer one tensor after materialising; both ends of a tie "
                        "must sit in one FSDP unit (the auto plan does this)")
    if verify:
        unfilled = find_unfilled(model)
        if unfilled:
            raise LoadError(_listing(f"after loading {location!r}, tensors still hold the NaN poison "
                                     "(never written)", unfilled))
        report.verified = True


# --------------------------------------------------------------------------- entry point


def materialize_and_load(
    model: nn.Module,
    hf_model_path: str | None = None,
    dcp_path: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    verify: bool = False,
    key_mapping: dict[str, str] | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    checkpoint_view=None,
    init_missing=None,
) -> nn.Module:
    """Give a (sharded) model on the meta device storage and fill it from a checkpoint.

    Each rank reads only its own region of every tensor. `dtype=None` keeps the checkpoint's
    floating dtype; a named dtype loads into it, casting as each slice is copied (fp32 masters
    from a bf16 checkpoint). `strict=False` loads what matches, initialises the rest with the
    model's own init and reports the lists instead of raising (a shape mismatch is always an
    error: no slice of a wrong-shaped tensor is right). `dcp_path`, when given, wins over
    `hf_model_path`. `verify=True` poisons the fresh storage with NaN and proves afterwards that
    nothing poisoned is left. The per-rank report is returned on the model as
    `model.fullshard_load_report`.

    `checkpoint_view` loads a wrapper (a PEFT model, see `fullshard.lora.lora_checkpoint_view`)
    from the checkpoint of the model it wraps: `view.model` is the wrapped model (its key
    conversions apply) and `view.name` maps the wrapper's tensor names to the checkpoint's, or to
    None for tensors that already hold their values (adapters initialised on the CPU); those keep
    them through materialising and are not expected in the checkpoint.

    `init_missing(model, names)` initialises what `strict=False` finds missing instead of the
    model's own init (a new head drawn whole from a seed, the same on any world size).
    """
    device = torch.device(device) if device is not None else current_device()
    view = view_model(model, checkpoint_view)
    source = open_source(view.keys_model, hf_model_path, dcp_path, key_mapping, revision, cache_dir)
    report = LoadReport(source=source.location, format=source.format, rank=get_rank(), world_size=get_world_size(),
                        kept=sorted(view.kept))
    context = f"reading checkpoint {source.location!r} failed"
    try:
        with agreed(LoadError, context):
            plan, target = plan_reads(model, view, source, resolve_dtype(dtype), strict, report)
        with agreed(LoadError, context):  # no collective inside: one agreement for the three phases
            names = materialise(model, view, target, device, verify, report, init_missing)
            read_slices(model, view, source, plan, names, report)
            prove(model, view, verify, source.location, report)
    finally:
        source.close()
    model.fullshard_load_report = report
    return model


def open_source(keys_model: nn.Module, hf_model_path: str | None, dcp_path: str | None,
                key_mapping: dict[str, str] | None, revision: str | None, cache_dir: str | None) -> Source:
    """The source to load from; a Hub id is resolved (downloaded once per node) here, on every rank."""
    if dcp_path is not None:
        return DCPSource(dcp_path)
    if not hf_model_path:
        raise ValueError("materialize_and_load needs hf_model_path (a directory or Hub id) or dcp_path")
    return HFSource(resolve_checkpoint_dir(hf_model_path, revision, cache_dir), keys_model, key_mapping)


def _matching(model: nn.Module, attr: str, names) -> set[str]:
    patterns = getattr(model, attr, None) or []
    if not patterns:
        return set()
    regex = re.compile("|".join(f"({p})" for p in patterns))
    return {n for n in names if regex.search(n)}


def _listing(title: str, names: list[str], limit: int = 20) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"{title} ({len(names)}): {names[:limit]}{more}"
