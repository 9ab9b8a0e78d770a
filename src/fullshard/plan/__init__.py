"""The plan: which modules become FSDP units, decided and checked before any `fully_shard`, and
what `fullshard plan` prints about it.

- `towers`: a VLM's towers, projector and block lists from its sub-configs; `freeze`
- `blocks`: a model's repeated blocks, final norm and head, from its structure
- `build`: the plan's data (`UnitSpec`, `ShardingPlan`), the auto / manual / transformers builders,
  validation and the unit table (`describe`)
- `memory`: the per-rank memory estimate (`estimate_run`, `estimate_rank_bytes`), above the plan in
  the layers (it reads the engine's config), so resolved here on first use
- `report`: what `fullshard plan` prints: the tensor-parallel split and the estimate
"""

from __future__ import annotations

import importlib

from .blocks import (
    BLOCK_CONTAINER_PATHS,
    find_blocks,
    find_final_norm,
    get_transformer_block_classes,
    get_transformer_layer_cls,
    head_modules,
)
from .build import (
    POLICIES,
    ShardingPlan,
    UnitSpec,
    auto_plan,
    build_plan,
    manual_plan,
    merge_units,
    shard_bytes,
    transformers_plan,
)

_LATER = {name: ".memory" for name in ("estimate_memory", "estimate_rank_bytes", "estimate_run")}

__all__ = ["BLOCK_CONTAINER_PATHS", "POLICIES", "ShardingPlan", "UnitSpec", "auto_plan", "build_plan",
           "find_blocks", "find_final_norm", "get_transformer_block_classes", "get_transformer_layer_cls",
           "head_modules", "manual_plan", "merge_units", "shard_bytes", "transformers_plan", *_LATER]


def __getattr__(name: str):
    if name not in _LATER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LATER[name], __name__), name)
