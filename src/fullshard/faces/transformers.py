"""transformers' FSDP2 entry point, `apply_fsdp2(model, device_mesh, fsdp_plan)`, as a face over
`FSDP2Engine`: the plan in any of transformers' forms (`{"mode": "auto"}`, `{"mode": "manual",
"modules": ...}`, a flat `model.fsdp_plan` dict), a mesh of the caller's own (a "tp" dim gives
tensor parallelism that dim), the engine's other settings as keywords."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine import FSDP2Engine


def apply_fsdp2(model: nn.Module, device_mesh: DeviceMesh | None = None, fsdp_plan: dict | str | None = None, **config):
    """Shard `model` over `device_mesh` (or the engine's own mesh) following `fsdp_plan`."""
    return FSDP2Engine(dict(config, plan=fsdp_plan or "auto"), device_mesh=device_mesh).prepare_model(model)


__all__ = ["apply_fsdp2"]
