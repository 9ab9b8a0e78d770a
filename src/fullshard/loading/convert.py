"""From checkpoint keys to model tensors, as lazy recipes that read only the rows a rank needs.

transformers 5 checkpoints do not always store a tensor under its module's name or in its
layout: keys are renamed (`block_sparse_moe` -> `mlp`, a `model.` prefix added or dropped) and
MoE experts stored one per key are fused into one 3-D tensor on load (`experts.*.w1` and
`experts.*.w3` stacked, then concatenated into `experts.gate_up_proj`). The same conversion
tables transformers uses decide the mapping here, so whatever its `from_pretrained` accepts
loads the same way.

Each model tensor becomes a `Lazy` recipe. `read_into(index, out)` writes just the region `index`
of the converted tensor into `out`, each part straight into its place (no stack or cat is ever
built): a stack of experts reads only the experts in the requested rows, a concatenation along a
later dim reads the same rows of every part. Conversions with no sliceable
form fall back to converting the whole tensor (reported as such), never to a wrong answer.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .readers import TensorReader


class Lazy:
    """A model tensor as a recipe over checkpoint keys; `read_into` writes a region of it straight
    into a destination (a shard's storage), casting in the copy when the dtypes differ."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[str]  # checkpoint keys it reads

    def read_into(self, index: tuple[slice, ...], out: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        out = torch.empty([len(range(*s.indices(n))) for n, s in zip(self.shape, index)], dtype=self.dtype)
        self.read_into(index, out)
        return out

    def read_all(self) -> torch.Tensor:
        return self.read(tuple(slice(0, n) for n in self.shape))


@dataclass
class Stored(Lazy):
    reader: TensorReader
    key: str

    def __post_init__(self) -> None:
        info = self.reader.infos[self.key]
        self.shape, self.dtype, self.sources = info.shape, info.dtype, [self.key]

    def read_into(self, index, out):
        if out.numel():
            self.reader.read_into(self.key, index, out)


@dataclass
class Stack(Lazy):
    """`torch.stack(parts, dim)`, reading only the parts (and the region of each) that `index` covers."""

    parts: list[Lazy]
    dim: int

    def __post_init__(self) -> None:
        first = self.parts[0].shape
        self.shape = (*first[: self.dim], len(self.parts), *first[self.dim:])
        self.dtype, self.sources = self.parts[0].dtype, [k for p in self.parts for k in p.sources]

    def read_into(self, index, out):
        inner = index[: self.dim] + index[self.dim + 1:]
        for position, part in enumerate(range(*index[self.dim].indices(len(self.parts)))):
            self.parts[part].read_into(inner, out.select(self.dim, position))


@dataclass
class Concat(Lazy):
    """`torch.cat(parts, dim)`: a region along `dim` maps onto the parts it overlaps."""

    parts: list[Lazy]
    dim: int

    def __post_init__(self) -> None:
        first = list(self.parts[0].shape)
        first[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        self.shape, self.dtype = tuple(first), self.parts[0].dtype
        self.sources = [k for p in self.parts for k in p.sources]

    def read_into(self, index, out):
        start, stop, _ = index[self.dim].indices(self.shape[self.dim])
        offset = 0
        for part in self.parts:
            size = part.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                sub = index[: self.dim] + (slice(lo - offset, hi - offset),) + index[self.dim + 1:]
                part.read_into(sub, out.narrow(self.dim, lo - start, hi - lo))
            offset += size


@dataclass
class Transposed(Lazy):
    """`part.transpose(dim0, dim1)`: a region of it is the swapped region of the part (Qwen3-VL-MoE's
    experts are stored transposed)."""

    part: Lazy
    dim0: int
    dim1: int

    def __post_init__(self) -> None:
        rank = len(self.part.shape)
        self.dim0, self.dim1 = self.dim0 % rank, self.dim1 % rank
        shape = list(self.part.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        self.shape, self.dtype, self.sources = tuple(shape), self.part.dtype, self.part.sources

    def read_into(self, index, out):
        swapped = list(index)
        swapped[self.dim0], swapped[self.dim1] = index[self.dim1], index[self.dim0]
        self.part.read_into(tuple(swapped), out.transpose(self.dim0, self.dim1))


@dataclass
class Chunked(Lazy):
    """Chunk `index` of `torch.chunk(part, chunks, dim)`: one of several model tensors stored fused
    (Qianfan-OCR's vision `qkv` split into `q_proj`, `k_proj`, `v_proj`), a region of the stored one."""

    part: Lazy
    dim: int
    index: int
    chunks: int

    def __post_init__(self) -> None:
        shape = list(self.part.shape)
        self.dim %= len(shape)
        self.size = -(-shape[self.dim] // self.chunks)  # torch.chunk's size
        self.offset = self.index * self.size
        shape[self.dim] = max(0, min(self.size, shape[self.dim] - self.offset))
        self.shape, self.dtype, self.sources = tuple(shape), self.part.dtype, self.part.sources

    def read_into(self, index, out):
        start, stop, step = index[self.dim].indices(self.shape[self.dim])
        moved = slice(start + self.offset, stop + self.offset, step)
        self.part.read_into(index[: self.dim] + (moved,) + index[self.dim + 1:], out)


def split_targets(converter, target: str, inputs: dict[str, list[Lazy]]) -> dict[str, Lazy] | None:
    """The recipes of a one-to-many conversion (one stored tensor chunked into several model
    tensors), each a region of the stored one; None for any other conversion."""
    names = [type(op).__name__ for op in converter.operations]
    parts = [p for ps in inputs.values() for p in ps]
    op = converter.operations[0] if names == ["Chunk"] else None
    if op is None or getattr(op, "num_shards_attribute", None) or len(parts) != 1:
        return None
    first, count = converter.target_patterns[0], len(converter.target_patterns)
    if first not in target:
        return None
    return {target.replace(first, pattern, 1): Chunked(parts[0], op.dim, i, count)
            for i, pattern in enumerate(converter.target_patterns)}


@dataclass
class Converted(Lazy):
    """A conversion with no sliceable form: the whole result is built once, then sliced."""

    converter: object
    inputs: dict[str, list[Lazy]]
    target: str
    cache: dict = field(default_factory=dict)
    model_keys: dict = field(default_factory=dict)  # a conversion may check the target's shape (Transpose)

    def __post_init__(self) -> None:
        self.sources = [k for parts in self.inputs.values() for p in parts for k in p.sources]
        self.shape, self.dtype = None, None  # known only once converted

    def convert(self) -> torch.Tensor:
        if "tensor" not in self.cache:
            tensors = {pattern: [p.read_all() for p in parts] for pattern, parts in self.inputs.items()}
            for op in self.converter.operations:
                tensors = op.convert(tensors, source_patterns=self.converter.source_patterns,
                                     target_patterns=self.converter.target_patterns, full_layer_name=self.target,
                                     model=_Parameters(self.model_keys))
            if len(tensors) != 1:
                raise NotImplementedError(f"conversion of {self.target!r} gives {len(tensors)} tensors")
            self.cache["tensor"] = next(iter(tensors.values()))
        return self.cache["tensor"]

    def read(self, index):
        return self.convert()[index]

    def read_into(self, index, out):
        out.copy_(self.convert()[index])


class _Parameters:
    """What a conversion asks of the model: a parameter by name, for its (global) shape."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get_parameter(self, name: str):
        return self.tensors[name]


SLICEABLE_OPS = {"MergeModulelist", "Concatenate"}


def plan_conversion(converter, inputs: dict[str, list[Lazy]], target: str, model_keys: dict | None = None) -> Lazy:
    """The recipe for one converter target: lazy when every op is a stack or a concatenation."""
    names = [type(op).__name__ for op in converter.operations]
    parts = [p for pattern in converter.source_patterns for p in inputs.get(pattern, [])]
    if names == ["Transpose"] and len(parts) == 1:
        op, expected = converter.operations[0], getattr((model_keys or {}).get(target), "shape", None)
        if op.check_dims and expected is not None and tuple(parts[0].shape) == tuple(expected):
            return parts[0]
        return Transposed(parts[0], op.dim0, op.dim1)
    if not set(names) <= SLICEABLE_OPS or names.count("MergeModulelist") > 1:
        return Converted(converter, inputs, target, model_keys=model_keys or {})
    merged = {}
    for pattern in converter.source_patterns:
        if pattern not in inputs:
            continue
        parts = inputs[pattern]
        if "MergeModulelist" in names:
            merged[pattern] = Stack(parts, converter.operations[names.index("MergeModulelist")].dim)
        elif len(parts) == 1:
            merged[pattern] = parts[0]
        else:
            return Converted(converter, inputs, target, model_keys=model_keys or {})
    if "Concatenate" in names:
        return Concat(list(merged.values()), converter.operations[names.index("Concatenate")].dim)
    if len(merged) != 1:
        return Converted(converter, inputs, target, model_keys=model_keys or {})
    return next(iter(merged.values()))


@dataclass
class KeyPlan:
    """Which recipe fills each model key, and which checkpoint keys matched no model key."""

    recipes: dict[str, Lazy]
    unexpected: list[str]


def natural_key(key: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def transformers_conversions(model, key_mapping: dict[str, str] | None = None) -> list:
    """The renamings and converters transformers would apply when loading `model`; none for a plain module."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    with user_classes(model):
        return get_model_conversion_mapping(model, key_mapping)


@contextlib.contextmanager
def user_classes(model):
    """Every module shown under the class the user built while transformers looks mappings up by class
    name: `fully_shard` swaps in `FSDPQwen2VLForConditionalGeneration`, whose name maps to nothing, and
    the model-type fallback lacks a VLM's renames (`model.embed_tokens` -> `model.language_model....`)."""
    from torch.distributed.fsdp import FSDPModule

    swapped = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            swapped.append((module, type(module)))
            module.__class__ = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def plan_keys(reader: TensorReader, model_keys: dict[str, object], conversions: list,
              base_model_prefix: str | None) -> KeyPlan:
    """Map every checkpoint key onto a model key the way transformers' loader does."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    direct: dict[str, Lazy] = {}
    grouped: dict[str, tuple[object, dict[str, list[Lazy]]]] = {}
    unexpected = []
    for key in sorted(reader.infos, key=natural_key):
        target, pattern = rename_source_key(key, renamings, converters, base_model_prefix or None, model_keys)
        if target not in model_keys and key in model_keys:
            target, pattern = key, None
        if target not in model_keys:
            unexpected.append(key)
            continue
        if pattern is None:
            direct[target] = Stored(reader, key)
        else:
            converter, inputs = grouped.setdefault(target, (by_pattern[pattern], {}))
            inputs.setdefault(pattern, []).append(Stored(reader, key))
    recipes = dict(direct)
    for target, (converter, inputs) in grouped.items():
        split = split_targets(converter, target, inputs) if len(converter.target_patterns) > 1 else None
        if split is not None and set(split) <= set(model_keys):
            recipes.update(split)
        else:
            recipes[target] = plan_conversion(converter, inputs, target, model_keys)
    return KeyPlan(recipes, unexpected)


def ignored_unexpected(model, keys: list[str], has_buffer_named) -> list[str]:
    """Checkpoint keys transformers drops silently: old per-layer `inv_freq` / `position_ids`, and
    the model's `_keys_to_ignore_on_load_unexpected`."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if has_buffer_named("rotary_emb.inv_freq"):
        patterns.add(r"rotary_emb\.inv_freq")
    if has_buffer_named("position_ids"):
        patterns.add(r"(^|\.)position_ids$")
    if not patterns:
        return []
    regex = re.compile("|".join(f"({p})" for p in patterns))
    return [k for k in keys if regex.search(k)]


# --------------------------------------------------------------------------------- the other direction


@dataclass(frozen=True)
class HubView:
    """A Hub checkpoint tensor as a region of one model tensor: `model[...]` taken with these sizes,
    strides and storage offset over the model tensor's contiguous layout (an expert's `gate_proj`
    inside a fused `gate_up_proj`). Whole tensors under a new name have `view` None. A Hub tensor
    fused from several model tensors is a `HubConcat` of such regions."""

    source: str
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None

    @property
    def parts(self) -> tuple["HubView", ...]:
        """The regions of model tensors it is made of: itself (as a `HubConcat`'s are its parts)."""
        return (self,)

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """Its shape, from its model tensor's (`shapes`: model name -> shape)."""
        return tuple(self.view[0]) if self.view is not None else tuple(shapes[self.source])

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This region of the whole model tensor (contiguous; itself maybe a view, e.g. into a
        bucket's buffer), a view of it."""
        if self.view is None:
            return full
        size, stride, offset = self.view
        return full.as_strided(size, stride, full.storage_offset() + offset)

    def take(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """This region of its model tensor in `tensors` (model name -> whole tensor), a view of
        it."""
        return self.of(tensors[self.source])


@dataclass(frozen=True)
class HubConcat:
    """A Hub checkpoint tensor fused from several model tensors: `torch.cat` of `parts` (each a
    region of one model tensor, `HubView`) along `dim`, in the order transformers' `save_pretrained`
    concatenates them (Qianfan-OCR's vision `qkv` from `q_proj`, `k_proj`, `v_proj`)."""

    parts: tuple[HubView, ...]
    dim: int

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The fused tensor's shape, from its model tensors' (`shapes`: model name -> shape)."""
        sizes = [list(part.shape(shapes)) for part in self.parts]
        fused = sizes[0]
        fused[self.dim] = sum(size[self.dim] for size in sizes)
        return tuple(fused)

    def take(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fused tensor from its whole model tensors (`tensors`: model name -> tensor), a new
        one."""
        return torch.cat([part.take(tensors) for part in self.parts], self.dim)


class _RevertedOps(TorchFunctionMode):
    """What the reversed conversions do to meta tensors, kept traceable. `.contiguous()` hands back
    the tensor itself: they copy a region (a chunk of a fused `gate_up_proj`) before splitting it
    further, which would lose where the region came from; kept a view, every Hub tensor cut from
    one model tensor stays a view of it. Each `torch.cat` is recorded with its inputs and dim, so a
    Hub tensor fused from several model tensors says which ones, in which order."""

    def __init__(self) -> None:
        super().__init__()
        self.cats: list[tuple[torch.Tensor, list[torch.Tensor], int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous:
            return args[0]
        out = func(*args, **kwargs)
        if func is torch.cat:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            self.cats.append((out, list(args[0]), dim))
        return out

    def concat_of(self, tensor: torch.Tensor, region) -> HubConcat | None:
        """`tensor` as a concatenation of regions of model tensors (`region(t)`: the `HubView` of
        `t`, or None where it is no region of one), or None where it was not made so."""
        for out, inputs, dim in self.cats:
            if out is tensor:
                parts = [region(part) for part in inputs]
                sources = {part.source for part in parts if part is not None}
                if len(sources) == len(parts):  # each a region of a model tensor of its own
                    return HubConcat(tuple(parts), dim % tensor.dim())
        return None


def hub_views(model, shapes: dict[str, tuple[int, ...]]) -> dict[str, HubView | HubConcat]:
    """The Hub checkpoint's names of the model tensors `shapes` (state name -> shape): what
    transformers' `save_pretrained` writes, by its own conversion mapping run backwards
    (`revert_weight_conversion`: renames, fused MoE experts split one key per expert, Qianfan-OCR's
    vision `q_proj` / `k_proj` / `v_proj` concatenated into `qkv`).

    The reversal runs on meta tensors, where the split comes out as views: each Hub tensor's strides
    and offset inside its model tensor say which region it is (`HubView`), so an export writes (and
    a stream gathers) the model's own rows without building the Hub tensors first. A Hub tensor
    concatenated from several model tensors is a `HubConcat` of their regions. One made any other
    way from several is written as the model tensors it is made of, under their own names, which
    transformers' loader takes as they are."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {name: HubView(name) for name in shapes}
    if not isinstance(model, PreTrainedModel) or not shapes:
        return {name: HubView(name) for name in shapes}
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    by_id = {id(tensor): name for name, tensor in meta.items()}

    def region(tensor: torch.Tensor) -> HubView | None:
        base = tensor if tensor._base is None else tensor._base
        source = by_id.get(id(base))
        if source is None:
            return None
        whole = tensor is base
        return HubView(source, None if whole else (tuple(tensor.shape), tuple(tensor.stride()),
                                                   tensor.storage_offset()))

    ops = _RevertedOps()
    with ops, user_classes(model):  # a sharded VLM's renames are found by its own class
        reverted = revert_weight_conversion(model, dict(meta))
    views: dict[str, HubView | HubConcat] = {}
    for hub_name, tensor in reverted.items():
        view = region(tensor) or ops.concat_of(tensor, region)
        if view is not None:  # else made of several some other way: they keep their names
            views[hub_name] = view
    covered = {part.source for view in views.values() for part in view.parts}
    views.update({name: HubView(name) for name in shapes if name not in covered})
    return views
