"""Compiled blocks and explicit prefetch: the two block-level speed knobs of a sharded model.

Blocks are compiled one by one, in place, before sharding, the way torchtitan does: per block
rather than the whole model, so FSDP's hooks stay outside the compiled graphs (each unit's
all-gather and reduce-scatter run where FSDP puts them) and identical blocks share one compiled
graph; after activation checkpointing, so the recomputation is compiled too. `nn.Module.compile`
compiles the module's call in place, so parameter names and state-dict keys stay those of the
eager model (no `_orig_mod.` prefix) and checkpoints move freely between compiled and eager runs.

Prefetch tells each block unit which units to all-gather next, so the next block's gather is
issued before the current block computes (forward) or the previous one's (backward), instead of
FSDP's implicit one-ahead backward prefetch only.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .plan.blocks import find_blocks


def compile_blocks(model: nn.Module, fullgraph: bool = False, backend: str = "inductor") -> list[str]:
    """`torch.compile` every outermost block of `model` in place; returns the blocks' names.

    Call after activation checkpointing and before `fully_shard`. `fullgraph=False` by default:
    transformers blocks may hold a graph break (a data-dependent branch, a logging call), which
    then splits the block's graph instead of failing the run.
    """
    modules = dict(model.named_modules())
    names = find_blocks(model)
    for name in names:
        modules[name].compile(backend=backend, fullgraph=fullgraph)
    return names


def set_block_prefetch(model: nn.Module, depth: int = 1) -> int:
    """Make each sharded block prefetch the next `depth` blocks in forward and the previous
    `depth` in backward (FSDP2's `set_modules_to_forward_prefetch` / `..._backward_prefetch`).

    Call after sharding. Returns the number of block units wired; blocks that are not their own
    FSDP unit (a plan that merged them) are left to FSDP's default.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    modules = dict(model.named_modules())
    units = [modules[name] for name in find_blocks(model) if isinstance(modules[name], FSDPModule)]
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[index + 1:index + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(index - depth, 0):index][::-1])
    return len(units)
