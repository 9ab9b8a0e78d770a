"""Rank-0 initialisation: rank 0 holds the loaded model, every other rank the same model on meta.

LLaMA-Factory's and LightRFT's `init_on_rank0` read the weights once, on rank 0 (in CPU memory),
and build the model on meta everywhere else. The ranks first agree on what each holds: one small
all-gather of each rank's layout (loaded, on meta, or partly on meta) and a digest of its tensors'
names, shapes, dtypes and ties. A mix fullshard cannot shard is then one error on every rank,
raised before any collective of sharding, instead of ranks waiting on each other until the
process-group timeout. Then every rank shards the same plan, the meta ranks get empty storage,
and rank 0 broadcasts one tensor at a time; each rank keeps its own slice of it. Rank 0 keeps
references to its full tensors rather than copies and lets each go once sent, so no rank ever
holds a second full copy of the model, and every other rank holds one full tensor beyond its shards.

`torch.distributed.checkpoint.state_dict.set_model_state_dict(broadcast_from_rank0=True)` sends
the state dict the same way, but not the non-persistent buffers (rotary `inv_freq`), which are
garbage on the meta ranks after `to_empty`; sending every tensor the model holds covers them too.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import all_ranks_agree_ok, broadcast_from_rank0, get_rank, get_world_size
from ..errors import LoadError
from ..tensors import tied_groups
from .materialize import broken_ties
from .shards import local_region

LOADED, META, RANK0 = "loaded", "meta", "rank0"


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds once (a tie under its first name): parameters and all buffers."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def layout_of(model: nn.Module) -> str:
    """"loaded" (no tensor on meta) or "meta" (some: the whole model, or a base on meta under
    adapters initialised for real, to be filled by a load or from rank 0)."""
    return META if any(t.is_meta for t in held_tensors(model).values()) else LOADED


def describe(model: nn.Module) -> list[tuple]:
    """Name, shape and dtype of every tensor, and the ties: what must match rank 0's model."""
    rows = [(name, tuple(t.shape), str(t.dtype)) for name, t in held_tensors(model).items()]
    return rows + [("tied", tuple(group)) for group in tied_groups(model)]


def agree_on_layout(model: nn.Module, supported: str | None = None) -> str:
    """LOADED (every rank), META (every rank) or RANK0 (rank 0 loaded, others on meta: the same model,
    which rank 0 fills); rank 0 on meta while another rank is loaded raises `LoadError` on every
    rank. `supported` is None, or why the caller cannot initialise from rank 0 (tensor parallelism,
    say), raised on every rank when that is asked."""
    description = describe(model)
    mine = (layout_of(model), hashlib.sha256(repr(description).encode()).hexdigest())
    if not dist.is_initialized() or get_world_size() == 1:
        return mine[0]
    everyone: list = [None] * get_world_size()
    dist.all_gather_object(everyone, mine)
    layouts = [layout for layout, _ in everyone]
    if all(layout == LOADED for layout in layouts):
        return LOADED
    if all(layout == META for layout in layouts):
        return META
    if layouts[0] != LOADED:
        _refuse(everyone)
    if supported is not None:
        raise LoadError(f"rank 0 holds a loaded model and the other ranks one on meta (rank-0 initialisation), "
                        f"which fullshard cannot do {supported}; build the model on meta on every rank "
                        "(fullshard.from_pretrained) or load it on every rank")
    if any(digest != everyone[0][1] for _, digest in everyone):
        _name_differences(description)
    return RANK0


def _refuse(everyone: list) -> None:
    held = "; ".join(f"rank {rank}: {layout}" for rank, (layout, _) in enumerate(everyone))
    raise LoadError("the ranks' models cannot be sharded together: every rank must hold the model loaded, "
                    "or every rank on meta, or rank 0 loaded and the others on meta (rank-0 initialisation); "
                    f"here {held}")


def _name_differences(description: list[tuple]) -> None:
    """Raise, on every rank, the first entry where each rank's model differs from rank 0's."""
    reference = broadcast_from_rank0(description if get_rank() == 0 else None)
    first = next((f"{mine} vs rank 0's {theirs}" for mine, theirs in zip(description, reference) if mine != theirs),
                 f"{len(description)} tensors vs rank 0's {len(reference)}" if len(description) != len(reference)
                 else None)
    all_ranks_agree_ok(first is None, f"its model on meta differs from rank 0's loaded model: {first}", LoadError)


def full_tensors_of_rank0(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """On rank 0, references (not copies) to the full tensors, taken before sharding replaces them."""
    if get_rank() != 0:
        return None
    return {name: tensor.detach() for name, tensor in held_tensors(model).items()}


def init_from_rank0(model: nn.Module, shard, device: torch.device) -> nn.Module:
    """Shard with `shard(model)` on every rank, give the meta ranks storage, send rank 0's weights."""
    full = full_tensors_of_rank0(model)
    model = shard(model)
    if get_rank() != 0:
        model.to_empty(device=device)
    send_from_rank0(model, full, device)
    return model


@torch.no_grad()
def send_from_rank0(model: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Fill every rank's (sharded, materialised) model from rank 0's full tensors, one at a time.

    Each rank copies its own region of each tensor (any placement: FSDP rows, HSDP replicas) into
    its storage; rank 0 drops its reference to each tensor once sent.
    """
    ties = tied_groups(model)
    for name, target in held_tensors(model).items():
        local, region = local_region(target)
        if full is not None:
            value = full.pop(name).to(device).contiguous()
        else:
            value = torch.empty(target.shape, dtype=target.dtype, device=device)
        dist.broadcast(value, src=0)
        local.copy_(value[region])
        del value
    broken = broken_ties(model, ties)
    if broken:  # the plan keeps ties in one unit; this would be a bug, said plainly
        raise LoadError(f"tied weights {broken} are no longer one tensor after rank-0 initialisation")

