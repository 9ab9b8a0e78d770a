"""Two questions asked all over the package, answered once: which names share one tensor, and what
this rank holds of a (possibly sharded) tensor."""

from __future__ import annotations

import re

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
            tensor = tensor.redistribute(
                placements=[*tensor.placements[:dim], Replicate(), *tensor.placements[dim + 1 :]]
            )
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
    """Whether a state name belongs to a part of the model other ranks hold (another pipeline stage,
    experts of another ep rank): a checkpoint of the whole model has it, and it is not unexpected."""
    return name in (getattr(model, "names_held_elsewhere", None) or ())


def holds_part(model: nn.Module) -> bool:
    """Whether `model` is the part of a model one rank holds, other ranks holding the rest under
    names it lacks (`fullshard.parallel.pp`'s stages, `fullshard.parallel.ep_lists`' experts)."""
    return getattr(model, "names_held_elsewhere", None) is not None


def state_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)} | {n for n, _ in module.named_buffers()}


def mark_held_elsewhere(module: nn.Module, everything: set[str], ignored: list[str] | None) -> None:
    """Tell the loaders, the checkpoint check and the export which of the full model's names
    (`everything`) other ranks hold: a checkpoint has them, and they are not unexpected here."""
    elsewhere = sorted(everything - state_names(module))
    module.names_held_elsewhere = frozenset(elsewhere)
    module._keys_to_ignore_on_load_unexpected = [rf"^{re.escape(n)}$" for n in elsewhere] + list(ignored or [])


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """The whole model's parameters (a tied weight once) and, of them, the input embedding's when it
    is not tied to the head (a table lookup, not a matmul, so FLOP counts leave it out). A pipeline
    stage holds part of the model: it carries the uncut model's counts, recorded where it was cut
    (`fullshard.parallel.pp`)."""
    recorded = getattr(model, "whole_model_parameter_counts", None)
    if recorded is not None:
        return recorded
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is None or embedding.weight is getattr(head, "weight", None):
        return total, 0
    return total, embedding.weight.numel()
