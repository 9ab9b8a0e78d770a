"""`materialize_and_load` and `from_pretrained`: a sharded model on meta, filled from a checkpoint.

The order is what makes failures safe: everything that can be checked from metadata (files,
keys, shapes) is checked on every rank and agreed on before any storage is touched, so a bad
checkpoint leaves the model as it was; reading happens with no collective in flight, and its
failures are agreed on afterwards, so no rank is ever left waiting for one that raised.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..dtypes import resolve_dtype
from ..distributed import current_device, get_rank, get_world_size
from .bin_reader import BinReader
from .convert import Converted, Lazy, ignored_unexpected, plan_keys, transformers_conversions
from .dcp import choose_prefix, load_dcp, read_dcp_metadata
from .errors import CheckpointError, agree
from .materialize import (broken_ties, find_unfilled, init_empty_model, materialize, named_buffer_slots,
                          snapshot_buffers, tie_groups)
from .readers import TensorReader
from .resolve import CheckpointFiles, find_checkpoint_files, resolve_checkpoint_dir
from .safetensors_reader import SafetensorsReader


@dataclass
class LoadReport:
    """What one rank did. `bytes_read` counts tensor bytes returned by the readers; `byte_budget` is
    this rank's fair share (checkpoint / shards) plus one row of every tensor for uneven splits."""

    source: str
    format: str
    rank: int
    world_size: int
    dtype: str
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

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- the model's side


def model_slots(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict name (tied aliases included) -> its parameter or persistent buffer."""
    slots = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is not None and attr not in module._non_persistent_buffers_set:
                slots[f"{module_name}.{attr}" if module_name else attr] = buf
    return slots


def viewed_slots(model: nn.Module, view=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`model_slots` under the names the checkpoint uses, and each such name's name in the model.

    `view.name(state_name)` renames a wrapper's tensor to the wrapped model's name (a PEFT model's
    `base_model.model.x.base_layer.weight` is the checkpoint's `x.weight`), or returns None for a
    tensor the checkpoint does not hold (a LoRA adapter); those are left out.
    """
    slots = model_slots(model)
    if view is None:
        return slots, {n: n for n in slots}
    names = {n: view.name(n) for n in slots}
    return {v: slots[n] for n, v in names.items() if v is not None}, {v: n for n, v in names.items() if v is not None}


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `tensor` and the region of the global tensor it holds."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise CheckpointError(f"local shard shape {tuple(local.shape)} is not the expected {tuple(shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def shard_count(model: nn.Module) -> int:
    counts = [math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())
              for p in model.parameters() if isinstance(p, DTensor)]
    return max(counts, default=1)


def slice_bytes(target: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of one index along the dim `target` is sharded on: what an uneven split can add to a rank."""
    dims = [p.dim for p in target.placements if p.is_shard()] if isinstance(target, DTensor) else []
    if not target.shape:
        return dtype.itemsize
    dim = dims[0] if dims else 0
    return dtype.itemsize * math.prod(target.shape) // max(target.shape[dim], 1)


def _groups(slots: dict[str, torch.Tensor]) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, tensor in slots.items():
        by_id.setdefault(id(tensor), []).append(name)
    return list(by_id.values())


def _matching(model: nn.Module, attr: str, names: list[str]) -> set[str]:
    patterns = getattr(model, attr, None) or []
    if not patterns:
        return set()
    regex = re.compile("|".join(f"({p})" for p in patterns))
    return {n for n in names if regex.search(n)}


def _listing(title: str, names: list[str], limit: int = 20) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"{title} ({len(names)}): {names[:limit]}{more}"


# --------------------------------------------------------------------------- sources


def open_reader(files: CheckpointFiles) -> TensorReader:
    reader_cls = SafetensorsReader if files.format == "safetensors" else BinReader
    return reader_cls(files.files, files.weight_map)


def checkpoint_dtype(infos) -> torch.dtype | None:
    """The floating dtype holding most of the checkpoint's bytes."""
    totals: dict[torch.dtype, int] = {}
    for info in infos:
        if info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + math.prod(info.shape) * info.dtype.itemsize
    return max(totals, key=totals.get) if totals else None


# --------------------------------------------------------------------------- entry points


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
) -> nn.Module:
    """Give a (sharded) model on the meta device storage and fill it from a checkpoint.

    Each rank reads only its own region of every tensor. `dtype=None` keeps the checkpoint's
    floating dtype; a named dtype loads into it, casting after each slice is read (fp32 masters
    from a bf16 checkpoint). `strict=False` loads what matches, initialises the rest with the
    model's own init and reports the lists instead of raising (a shape mismatch is always an
    error: no slice of a wrong-shaped tensor is right). `dcp_path`, when given, wins over
    `hf_model_path`. `verify=True` poisons the fresh
    storage with NaN and proves afterwards that nothing poisoned is left. The per-rank report is
    returned on the model as `model.fullshard_load_report`.

    `checkpoint_view` loads a wrapper (a PEFT model, see `fullshard.lora.lora_checkpoint_view`)
    from the checkpoint of the model it wraps: `view.model` is the wrapped model (its key
    conversions apply) and `view.name` maps the wrapper's tensor names (see `viewed_slots`).
    Tensors it maps to None already hold their values (adapters initialised on the CPU); they keep
    them through materialising and are not expected in the checkpoint.
    """
    device = torch.device(device) if device is not None else current_device()
    dtype = resolve_dtype(dtype)
    if dcp_path is None and not hf_model_path:
        raise ValueError("materialize_and_load needs hf_model_path (a directory or Hub id) or dcp_path")
    directory = None if dcp_path is not None else resolve_checkpoint_dir(hf_model_path, revision, cache_dir)

    slots, own_name = viewed_slots(model, checkpoint_view)
    keys_model = checkpoint_view.model if checkpoint_view is not None else model
    params = dict(model.named_parameters())
    viewed = set(own_name.values())
    kept = {n: local_region(t)[0].detach().clone() for n, t in model_slots(model).items()
            if n not in viewed and n in params}
    snapshot = snapshot_buffers(model)
    ties = tie_groups(model)
    source = str(dcp_path if dcp_path is not None else directory)
    report = LoadReport(source=source, format="dcp" if dcp_path is not None else "", rank=get_rank(),
                        world_size=get_world_size(), dtype="", kept=sorted(kept))

    # ---- phase 1: metadata only; nothing is touched yet
    reader, recipes, stored_shapes, message = None, {}, {}, ""
    try:
        if dcp_path is not None:
            stored = read_dcp_metadata(dcp_path)
            prefix = choose_prefix(stored, list(slots))
            stored_shapes = {k[len(prefix):]: s for k, s in stored.items() if k.startswith(prefix) and s is not None}
            present = set(stored_shapes) & set(slots)
            unexpected = sorted(set(stored_shapes) - set(slots))
            shapes = {k: stored_shapes[k] for k in present}
            target_dtype = dtype or _float_dtype_of(model)
        else:
            files = find_checkpoint_files(directory)
            report.format = files.format
            reader = open_reader(files)
            plan = plan_keys(reader, slots, transformers_conversions(keys_model, key_mapping),
                             getattr(keys_model, "base_model_prefix", None))
            recipes = plan.recipes
            buffer_names = {n for n, *_ in named_buffer_slots(model)}
            ignored = set(ignored_unexpected(keys_model, plan.unexpected,
                                             lambda suffix: any(b.endswith(suffix) for b in buffer_names)))
            unexpected = [k for k in plan.unexpected if k not in ignored]
            for key, recipe in recipes.items():
                if isinstance(recipe, Converted):
                    tensor = recipe.convert()
                    recipe.shape, recipe.dtype = tuple(tensor.shape), tensor.dtype
                    report.whole_tensor_conversions.append(key)
            shapes = {k: tuple(r.shape) for k, r in recipes.items()}
            present = set(recipes)
            target_dtype = dtype or checkpoint_dtype(reader.infos.values()) or _float_dtype_of(model)
            report.checkpoint_bytes = sum(math.prod(i.shape) * i.dtype.itemsize for i in reader.infos.values())
        report.dtype = str(target_dtype).replace("torch.", "")
        ignore_missing = _matching(keys_model, "_keys_to_ignore_on_load_missing", list(slots))
        for group in _groups(slots):
            if any(n in present for n in group) or set(group) & ignore_missing:
                continue
            if all(snapshot.values.get(own_name[n]) is not None for n in group):
                report.buffers_from_init += group  # a real persistent buffer the checkpoint lacks
            else:
                report.missing.append(group[0])
        report.unexpected = unexpected
        report.mismatched = sorted(
            f"{k}: checkpoint {list(shapes[k])}, model {list(slots[k].shape)}"
            for k in present if tuple(shapes[k]) != tuple(slots[k].shape)
        )
        problems = [_listing(t, l) for t, l in (("missing keys", report.missing), ("unexpected keys", report.unexpected),
                                                ("shape mismatches", report.mismatched)) if l]
        if report.mismatched or (strict and problems):
            raise CheckpointError(f"checkpoint {source!r} does not fit {type(model).__name__}: " + "; ".join(problems))
    except CheckpointError as exc:
        message = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        message = f"reading checkpoint {source!r} failed: {type(exc).__name__}: {exc}"
    agree(not message, message)

    # ---- phase 2: storage, buffers, then the reads (no collective until all are done)
    if target_dtype is not None and any(p.is_floating_point() and p.dtype != target_dtype
                                        for n, p in model.named_parameters() if n not in kept):
        model.to(target_dtype)  # still on meta: free; buffers get their own dtype back from the snapshot
    report.recomputed_buffers = materialize(model, device, snapshot, fill=verify)
    report.restored_buffers = sorted(n for n, v in snapshot.values.items() if v is not None and n in snapshot.non_persistent)
    slots, _ = viewed_slots(model, checkpoint_view)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in kept:
                local_region(param)[0].copy_(kept[name])
    message = ""
    try:
        if report.missing:
            _init_missing(model, [own_name[n] for n in report.missing])
        if dcp_path is not None:
            targets = {next(n for n in g if n in present): slots[g[0]] for g in _groups(slots)
                       if any(n in present for n in g)}
            report.bytes_read = load_dcp(dcp_path, targets, prefix)
            report.tensors_loaded = len(targets)
            report.checkpoint_bytes = sum(math.prod(stored_shapes[k]) * slots[k].element_size() for k in targets)
            rows = sum(slice_bytes(slots[k], slots[k].dtype) for k in targets)
        else:
            rows = _copy_all(recipes, slots, report)
            report.bytes_read = reader.bytes_read
        report.byte_budget = report.checkpoint_bytes // shard_count(model) + rows
    except CheckpointError as exc:
        message = str(exc)
    except Exception as exc:  # noqa: BLE001
        message = f"reading checkpoint {source!r} failed: {type(exc).__name__}: {exc}"
    finally:
        if reader is not None:
            reader.close()
    agree(not message, message)

    # ---- phase 3: proofs
    message = ""
    broken = broken_ties(model, ties)
    if broken:
        message = (f"tied weights {broken} are no longer one tensor after materialising; both ends of a tie "
                   "must sit in one FSDP unit (the auto plan does this)")
    elif verify:
        unfilled = find_unfilled(model)
        if unfilled:
            message = _listing(f"after loading {source!r}, tensors still hold the NaN poison (never written)", unfilled)
        report.verified = not unfilled
    agree(not message, message)
    model.fullshard_load_report = report
    return model


def _copy_all(recipes: dict[str, Lazy], slots: dict[str, torch.Tensor], report: LoadReport) -> int:
    """Copy every recipe's rows into this rank's shard; returns the row-padding allowance in bytes."""
    done: set[int] = set()
    rows = 0
    with torch.no_grad():
        for key, recipe in recipes.items():
            target = slots[key]
            if id(target) in done:  # a tie stored under both names: one read is enough
                continue
            done.add(id(target))
            local, region = local_region(target)
            rows += slice_bytes(target, recipe.dtype)
            if local.numel() == 0:
                continue
            try:
                data = recipe.read(region)
            except Exception as exc:  # noqa: BLE001 - name the key and file
                files = sorted({str(recipe.reader.infos[k].file) if hasattr(recipe, "reader") else k
                                for k in recipe.sources})
                raise CheckpointError(f"reading {key!r} (from {recipe.sources[:4]} in {files[:2]}) failed: "
                                      f"{type(exc).__name__}: {exc}") from None
            local.copy_(data.reshape(local.shape))  # cast after slicing: only this rank's rows are converted
            report.tensors_loaded += 1
    return rows


def _init_missing(model: nn.Module, missing: list[str]) -> None:
    """strict=False: give keys the checkpoint lacks the model's own init instead of garbage."""
    init = getattr(model, "_init_weights", None)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in missing:
            module = modules.get(name.rpartition(".")[0])
            if init is not None and module is not None:
                init(module)
            else:
                local, _ = local_region(model_slots(model)[name])
                local.zero_()


def _float_dtype_of(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def from_pretrained(name_or_path: str, engine=None, dtype=None, model_class=None, revision: str | None = None,
                    cache_dir: str | None = None, lora=None, **load_kwargs) -> nn.Module:
    """The short path: build the model on meta from its config, shard it with `engine`, load it sharded.

    `engine` defaults to `FSDP2Engine()` (fp32, auto plan, whole world). `dtype=None` keeps the
    checkpoint's dtype. Remote code is never run (`trust_remote_code` stays off). `lora` (a
    `peft.LoraConfig` or a dict of its fields) wraps the model on meta with PEFT LoRA before it is
    sharded (`fullshard.lora.apply_lora`): the result is a `PeftModel` whose base loads sharded from
    the checkpoint and whose adapters are initialised as `get_peft_model` would.
    """
    from transformers import AutoConfig

    from ..engine import FSDP2Engine

    engine = engine if engine is not None else FSDP2Engine()
    directory = resolve_checkpoint_dir(name_or_path, revision, cache_dir)
    message, model = "", None
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        build_dtype = resolve_dtype(dtype)
        if build_dtype is None:
            files = find_checkpoint_files(directory)
            reader = open_reader(files)
            build_dtype = checkpoint_dtype(reader.infos.values())
            reader.close()
        model = init_empty_model(config, model_class, dtype=build_dtype)
    except Exception as exc:  # noqa: BLE001 - every rank raises together
        message = f"cannot build a model from {str(directory)!r}: {type(exc).__name__}: {exc}"
    agree(not message, message)
    model.config._name_or_path = str(name_or_path)
    if lora is not None:
        from ..lora import apply_lora, lora_checkpoint_view

        model = apply_lora(model, lora)
        load_kwargs["checkpoint_view"] = lora_checkpoint_view(model)
    model.eval()  # as transformers' from_pretrained returns it
    return engine.shard_model(model, hf_model_path=str(directory), dtype=dtype, revision=revision, cache_dir=cache_dir,
                              **load_kwargs)
