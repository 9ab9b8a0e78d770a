"""The model's Hugging Face weights as a stream of whole tensors, for a rollout engine (vLLM's
`load_weights`, a transformers model) rather than a directory.

`hf_weight_buckets(model)` yields, on every rank of the model's process group in step, buckets of
`(hf_name, full tensor)`: exactly what `export_hf` writes (same recipe, so the same Hub names,
shapes, dtypes and bits; a LoRA model merged, or only its adapter), whatever the layout: FSDP /
HSDP rows, TP or EP splits, per-expert modules or pipeline stages held by other ranks.

One collective per bucket: up front every rank says (one object all-gather) which region of each
state tensor it holds; then for each bucket every rank packs the regions it is the first holder
of, cast to the written dtype, into its slot of one buffer, one all-gather (in place; on gloo one
broadcast per rank, `distributed.all_gather_slots`)
fills every slot, and the whole tensors are put together from it. A rank holds at most the
gathered buffer and the bucket's tensors (each at most `bucket_bytes`; a tensor bigger than that is
a bucket of its own) beyond what it already had, and nothing of the model, its optimizer or its
next step changes: a LoRA merge is computed into new tensors, never into the module.

`fullshard.weight_sync.buckets_to_first` is the same stream for a sender that is the first rank
alone, built on this module's plan (`stream_plan`, `StreamUnit`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..distributed import all_gather_slots, current_device, get_rank, get_world_size
from ..dtypes import resolve_dtype
from ..errors import CheckpointError
from ..fsdp import reshard_all
from ..loading.convert import HubConcat, HubView
from ..tensors import local_tensor
from .export import recipe_entries
from .lora import adapter_file_names, is_peft_model, merge_recipe
from .offline import checkpoint_hf_weights
from .recipe import ExportRecipe, export_recipe, merge_lora, recipe_parts, recipe_view, source_dtype

DEFAULT_BUCKET_BYTES = 256 * 2**20
ALIGN = 8  # every packed region starts 8-byte aligned, so it can be viewed as any dtype

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape) of a held region


@dataclass
class Input:
    """A state tensor a unit reads whole: gathered in `dtype` (the written one, or the stored one
    where a LoRA merge computes on it)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return shape_numel(self.shape) * self.dtype.itemsize


@dataclass
class StreamUnit:
    """Hub tensors made from the same state tensors: `outputs` (name, dtype, and the region of an
    input it is, or the concatenation of several inputs' regions it is), `merges` the LoRA terms
    (over other inputs) merged into an input, by its key, before its regions are taken."""

    inputs: list[Input]
    outputs: list[tuple[str, torch.dtype, HubView | HubConcat]]
    merges: dict[str, dict] = field(default_factory=dict)
    pieces: dict[int, list[tuple[int, Box]]] = field(default_factory=dict)  # rank -> (input index, box)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.inputs)


def shape_numel(shape) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def aligned(nbytes: int) -> int:
    return nbytes + (-nbytes % ALIGN)


def kept_buffer(buffers: dict, name: str, nbytes: int, device: torch.device, capacity: int = 0) -> torch.Tensor:
    """`nbytes` of the byte buffer `buffers[name]`, kept from bucket to bucket (fresh memory costs a
    page fault per page, on a CPU host more than the copy into it); a too small one is dropped
    before the larger one (of at least `capacity` bytes) is made, so there are never two."""
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < nbytes or buffer.device != device:
        buffers[name] = buffer = None
        buffers[name] = buffer = torch.empty(max(nbytes, capacity), dtype=torch.uint8, device=device)
    return buffer[:nbytes]


def _held_box(tensor: torch.Tensor) -> Box | None:
    """The region of the global tensor this rank holds (None: nothing)."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    if tensor.device_mesh.get_coordinate() is None:
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if not shape_numel(shape):
        return None
    return tuple(offset) if tensor.dim() else (), tuple(shape)


def _recipe(model, lora: str) -> tuple[torch.nn.Module, dict, ExportRecipe]:
    """The model whose config names the output, this rank's state, and the export's recipe."""
    if lora not in ("merge", "adapter"):
        raise ValueError(f"lora must be 'merge' or 'adapter', got {lora!r}")
    reshard_all(model)
    state = model.state_dict()
    if not is_peft_model(model):
        if lora == "adapter":
            raise ValueError(f"lora='adapter' needs a peft.PeftModel, got {type(model).__name__}")
        return model, state, export_recipe(model, state)
    if lora == "adapter":  # the adapter file's names, as `save_adapter` writes them, uncast
        files = adapter_file_names(state, model.active_adapter)
        return model.get_base_model(), state, ExportRecipe(names=files)
    return model.get_base_model(), state, merge_recipe(model, state)


def _local_units(state: dict, recipe: ExportRecipe, out_dtype: torch.dtype | None) -> list[StreamUnit]:
    """This rank's units, from the recipe over the state tensors it holds: one per state tensor (all
    its regions), or per set of them a fused Hub tensor is made of."""
    units: dict[tuple[str, ...], StreamUnit] = {}
    for entry in recipe_entries(recipe, state, out_dtype):
        parts = recipe_parts(recipe, entry.name)
        sources = tuple(view.source for _, view in parts)
        if sources not in units:
            unit = units[sources] = StreamUnit([], [])
            for part, view in parts:
                merge = recipe.merges.get(part)
                if merge is None:  # gathered as written: a cast halves what a bf16 export moves
                    shape = tuple(state[view.source].shape)
                    unit.inputs.append(Input(view.source, shape, entry.dtype))
                    continue
                unit.merges[view.source] = merge
                keys = [view.source, *(k for a, b, _ in merge["terms"] for k in (a, b) if k is not None)]
                unit.inputs += [Input(k, tuple(state[k].shape), state[k].dtype) for k in keys]
        units[sources].outputs.append((entry.name, entry.dtype, recipe_view(recipe, entry.name)))
    return list(units.values())


def plan_stream(state: dict, recipe: ExportRecipe, out_dtype: torch.dtype | None) -> list[StreamUnit]:
    """Every unit of the whole model, the same list on every rank, each input's regions dealt to the
    first rank holding them (one object all-gather)."""
    units = _local_units(state, recipe, out_dtype)
    held = {}
    for unit in units:
        for item in unit.inputs:
            box = _held_box(state[item.key])
            if box is not None:
                held[item.key] = box
    world = get_world_size()
    everyone: list = [(units, held)]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (units, held))
    merged: dict[str, StreamUnit] = {}
    for rank_units, _ in everyone:
        for unit in rank_units:
            merged.setdefault(unit.outputs[0][0], unit)
    order = lambda key: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]  # noqa: E731
    planned = [merged[name] for name in sorted(merged, key=order)]
    for unit in planned:
        _deal(unit, [rank_held for _, rank_held in everyone])
    return planned


def _deal(unit: StreamUnit, held: list[dict[str, Box]]) -> None:
    """Each distinct region of each input to the first rank holding it; every element covered once."""
    unit.pieces = {}
    for index, item in enumerate(unit.inputs):
        seen = set()
        for rank, rank_held in enumerate(held):
            box = rank_held.get(item.key)
            if box is not None and box not in seen:
                seen.add(box)
                unit.pieces.setdefault(rank, []).append((index, box))
        if sum(shape_numel(shape) for _, shape in seen) != shape_numel(item.shape):
            raise CheckpointError(f"the ranks' parts of {item.key!r} {list(item.shape)} do not make the whole tensor: "
                                  f"{sorted(seen)}")


def _rank_bytes(unit: StreamUnit, rank: int) -> int:
    return sum(aligned(shape_numel(box[1]) * unit.inputs[i].dtype.itemsize) for i, box in unit.pieces.get(rank, []))


def buckets_of(units: list[StreamUnit], bucket_bytes: int, world: int) -> list[list[StreamUnit]]:
    """Units in order into buckets whose whole tensors and whose gather buffer (the largest rank's
    part, times the ranks) each stay within `bucket_bytes`; a unit bigger than that is its own bucket."""
    buckets: list[list[StreamUnit]] = []
    whole, slots = 0, [0] * world
    for unit in units:
        add = [_rank_bytes(unit, r) for r in range(world)]
        grown = [s + a for s, a in zip(slots, add)]
        if buckets and buckets[-1] and (whole + unit.nbytes > bucket_bytes or max(grown) * world > bucket_bytes):
            buckets.append([])
            whole, grown = 0, add
        if not buckets:
            buckets.append([])
        buckets[-1].append(unit)
        whole, slots = whole + unit.nbytes, grown
    return buckets


def stream_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return current_device()
    return torch.device("cpu")


def held_region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    offset, shape = box
    for dim, (start, size) in enumerate(zip(offset, shape)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


def _rank_ordered(bucket: list[StreamUnit], slot: int, world: int) -> bool:
    """Whether the gathered buffer is itself the bucket's one whole tensor: one input, rank r holding
    rows r * slot bytes in (FSDP's even Shard(0)), so the tensor is a view of it, with no copy out."""
    if len(bucket) != 1 or len(bucket[0].inputs) != 1 or len(bucket[0].pieces) != world:
        return False
    item, rows = bucket[0].inputs[0], 0
    for rank in range(world):
        pieces = bucket[0].pieces[rank]
        if len(pieces) != 1 or not item.shape:
            return False
        offset, shape = pieces[0][1]
        if offset[0] != rows or any(offset[1:]) or tuple(shape[1:]) != item.shape[1:] or \
                shape_numel(shape) * item.dtype.itemsize != slot:
            return False
        rows += shape[0]
    return rows == item.shape[0]


def _gather_bucket(bucket: list[StreamUnit], state: dict, device: torch.device,
                   buffers: dict) -> list[list[torch.Tensor]]:
    """Every input of the bucket's units, whole, on every rank: one all-gather of packed regions into
    the gather buffer kept in `buffers` (`kept_buffer`)."""
    rank, world = get_rank(), get_world_size()
    slot = max(sum(_rank_bytes(u, r) for u in bucket) for r in range(world))
    in_place = _rank_ordered(bucket, slot, world)
    if in_place:  # handed out as the tensor itself: never reused
        buffers.pop("gather", None)
        gathered = torch.empty(slot * world, dtype=torch.uint8, device=device)
    else:
        gathered = kept_buffer(buffers, "gather", slot * world, device)
    position = rank * slot
    for unit in bucket:
        for index, box in unit.pieces.get(rank, []):
            item = unit.inputs[index]
            nbytes = shape_numel(box[1]) * item.dtype.itemsize
            packed = gathered[position:position + nbytes].view(item.dtype).view(box[1])
            packed.copy_(local_tensor(state[item.key]).detach())
            position += aligned(nbytes)
    if world > 1 and slot:
        all_gather_slots(gathered, slot)
    if in_place:
        item = bucket[0].inputs[0]
        return [[gathered.view(item.dtype).view(item.shape)]]
    wholes = [[torch.empty(i.shape, dtype=i.dtype, device=device) for i in u.inputs] for u in bucket]
    for source in range(world):
        position = source * slot
        for unit, tensors in zip(bucket, wholes):
            for index, box in unit.pieces.get(source, []):
                item = unit.inputs[index]
                nbytes = shape_numel(box[1]) * item.dtype.itemsize
                piece = gathered[position:position + nbytes].view(item.dtype).view(box[1])
                held_region(tensors[index], box).copy_(piece)
                position += aligned(nbytes)
    return wholes


def unit_outputs(unit: StreamUnit, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The unit's Hub tensors from its whole inputs: regions are views of them (of one cast copy per
    input and dtype), a fused Hub tensor a new tensor."""
    whole = {item.key: tensor for item, tensor in zip(unit.inputs, tensors)}
    for key, merge in unit.merges.items():
        terms = [(None if a is None else whole[a], whole[b], s) for a, b, s in merge["terms"]]
        whole[key] = merge_lora(whole[key], terms, merge["fan_in_fan_out"])
    cast: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    outputs = []
    for name, dtype, view in unit.outputs:
        as_written = cast.setdefault(dtype, {})
        for part in view.parts:
            if part.source not in as_written:
                as_written[part.source] = whole[part.source].to(dtype)
        outputs.append((name, view.take(as_written)))
    return outputs


def output_size(unit: StreamUnit) -> tuple[int, int]:
    """How many Hub tensors the unit gives, and their bytes."""
    shapes = {item.key: item.shape for item in unit.inputs}
    nbytes = sum(shape_numel(view.shape(shapes)) * dtype.itemsize
                 for _, dtype, view in unit.outputs)
    return len(unit.outputs), nbytes


def stream_plan(model, dtype, bucket_bytes: int, lora: str) -> tuple[dict, list[list[StreamUnit]]]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    owner, state, recipe = _recipe(model, lora)
    out_dtype = resolve_dtype(dtype) or (None if lora == "adapter" else source_dtype(owner))
    units = plan_stream(state, recipe, out_dtype)
    return state, buckets_of(units, bucket_bytes, get_world_size())


def hf_weight_buckets(model: torch.nn.Module, *, dtype: torch.dtype | str | None = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, lora: str = "merge"
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's Hugging Face weights, a bucket of `(hf_name, full tensor)` at a time; every rank of
    the model's process group iterates it in step and gets every tensor.

    The tensors are what `export_hf` writes (for a LoRA model with `lora="merge"`, what
    `export_merged` writes; with `lora="adapter"`, only the adapter under PEFT's file names, as
    `save_adapter` writes it): Hub names and layout, cast to `dtype` (default: the dtype the model was
    loaded from; the adapter keeps its own) but for what transformers keeps in fp32 at that dtype.
    They lie on the process group's device (the CPU for
    gloo). Beyond the model, a rank holds at most one gather buffer and one bucket (each at most
    `bucket_bytes`, or one tensor bigger than that) while a bucket is made; one collective per bucket.
    """
    state, buckets = stream_plan(model, dtype, bucket_bytes, lora)
    device, buffers = stream_device(), {}
    for bucket in buckets:
        wholes = _gather_bucket(bucket, state, device, buffers)
        items = [pair for unit, tensors in zip(bucket, wholes) for pair in unit_outputs(unit, tensors)]
        del wholes
        yield items
        del items


def hf_weights(model: torch.nn.Module | str | os.PathLike, *, dtype: torch.dtype | str | None = None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, lora: str = "merge") -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_weight_buckets`, one `(hf_name, full tensor)` at a time (every rank in step); a tensor
    handed out is no longer held here, so the caller holds at most the one in hand. Given a
    training checkpoint's path instead of a model: `checkpoint_hf_weights` (one process, merged)."""
    if isinstance(model, (str, os.PathLike)):
        if lora != "merge":
            raise CheckpointError(f"a checkpoint's weights come merged, not lora={lora!r}")
        yield from checkpoint_hf_weights(model, dtype=dtype)
        return
    buckets = hf_weight_buckets(model, dtype=dtype, bucket_bytes=bucket_bytes, lora=lora)
    while (bucket := next(buckets, None)) is not None:
        bucket.reverse()
        while bucket:
            yield bucket.pop()


__all__ = ["checkpoint_hf_weights", "hf_weight_buckets", "hf_weights"]
