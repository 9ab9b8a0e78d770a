"""Two questions asked all over the package, answered once: which names share one tensor, and what
this rank holds of a (possibly sharded) tensor."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's storage of `tensor`: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor on every rank (a collective), as `full_tensor()` gives it, but
    gathered one mesh dim at a time, outermost first: the collectives torch runs for FSDP x TP's
    `_StridedShard` layout anyway, minus its warning, once per rank and layout, that they cannot
    be merged into one."""
    if not isinstance(tensor, DTensor):
        return tensor
    for dim in range(tensor.device_mesh.ndim):
        if not tensor.placements[dim].is_replicate():
            tensor = tensor.redistribute(placements=[*tensor.placements[:dim], Replicate(), *tensor.placements[dim + 1:]])
    return tensor.to_local()


def tensor_aliases(model: nn.Module, persistent_buffers: bool = False) -> dict[int, list[str]]:
    """Every parameter (and, if asked, persistent buffer) by identity, with all the names it is
    reachable under, in registration order; a tied weight has several.

    Identity, not `_tied_weights_keys`, is the truth: it also catches ties a config does not
    declare (BERT's decoder bias) and ones made by hand.
    """
    owners: dict[int, list[str]] = {}
    for name, tensor in named_state_tensors(model, persistent_buffers).items():
        owners.setdefault(id(tensor), []).append(name)
    return owners


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The alias groups with more than one name: the ties that must survive sharding and loading."""
    return [names for names in tensor_aliases(model).values() if len(names) > 1]


def named_state_tensors(model: nn.Module, persistent_buffers: bool = True) -> dict[str, torch.Tensor]:
    """Every state-dict name, tied aliases included -> its parameter or persistent buffer."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    if persistent_buffers:
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attr, buf in module._buffers.items():
                if buf is not None and attr not in module._non_persistent_buffers_set:
                    tensors[f"{module_name}.{attr}" if module_name else attr] = buf
    return tensors


def held_elsewhere(model: nn.Module, name: str) -> bool:
    """Whether a state name belongs to a part of the model that another pipeline stage holds
    (`fullshard.parallel.pp`): a checkpoint of the whole model has it, and it is not unexpected."""
    return name in (getattr(model, "other_stage_names", None) or ())


def is_pipeline_stage(model: nn.Module) -> bool:
    """Whether `model` is what one rank holds of a pipeline (`fullshard.parallel.pp`): other ranks hold the rest."""
    return getattr(model, "other_stage_names", None) is not None
