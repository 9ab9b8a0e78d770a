"""The phases of a colocated RL step besides the update: log-probs without gradients, and moving
a model's (and its optimizer's) state off the device while another phase needs the memory.

A colocated step on the trainer's devices: generate (the optimizer state, and a reference model,
on the host), take the old policy's and the reference's log-probs (`sequence_logprobs`,
`reference_logprobs`), update (`policy_update`), push the weights to the rollout engine
(`WeightSync.push`) after the optimizer state has left the device (`offload`), then `onload`
before the next update. `offload` / `onload` replace each tensor with a copy on the other device
(FSDP2 re-registers its sharded parameters after `Module._apply`), so the step after them does
exactly what it would have done without them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..fsdp import reshard_all
from ..tensors import local_tensor
from .batches import token_batches


def _bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _move(model: nn.Module, optimizer, device: torch.device) -> int:
    pin = device.type == "cpu" and torch.accelerator.is_available()

    def copy(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device, copy=True)
        return moved.pin_memory() if pin and not isinstance(moved, DTensor) else moved

    moved = 0
    if model is not None:
        reshard_all(model)
        moved += sum(_bytes(p) + (_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
        moved += sum(_bytes(b) for b in model.buffers())
        model._apply(copy)
    for state in ([] if optimizer is None else optimizer.state.values()):
        for key, value in state.items():
            # Adam's `step` is a host scalar by design (capturable=False); it stays where it is
            if isinstance(value, torch.Tensor) and not (key == "step" and value.ndim == 0):
                state[key] = copy(value)
                moved += _bytes(value)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
    return moved


def offload(model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> int:
    """This rank's parameters, gradients, buffers and (given) optimizer state to the host (pinned
    where an accelerator exists); returns the bytes moved. `model=None`: the optimizer state only
    (what a colocated step moves while the model generates)."""
    return _move(model, optimizer, torch.device("cpu"))


def onload(model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None, device=None) -> int:
    """Back to `device` (default: this rank's accelerator, or the host without one); returns the
    bytes moved."""
    from ..distributed import current_device

    return _move(model, optimizer, torch.device(device) if device is not None else current_device())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model under a PEFT model's adapters: the reference of a LoRA run, no second copy."""
    if not hasattr(model, "disable_adapter"):
        raise TypeError(f"adapters_disabled needs a peft.PeftModel, got {type(model).__name__}")
    with model.disable_adapter():
        yield model


@torch.no_grad()
def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                      max_tokens: int = 8192, temperature: float = 1.0, chunk_tokens: int = 1024,
                      return_entropy: bool = False, group=None, **model_inputs):
    """`token_logprobs` of right-padded sequences without gradients, in micro-batches of at most
    `max_tokens` (padded) tokens, every rank of `group` running as many (a collective on a
    sharded model). Returns `[n, T - 1]` (and the entropies with `return_entropy`), 0 past each
    sequence's end."""
    from ..objectives.logprobs import token_logprobs as compute

    n, width = input_ids.shape
    out = torch.zeros(n, width - 1, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(out) if return_entropy else None
    lengths = attention_mask.sum(dim=-1).tolist()
    for index in token_batches(lengths, max_tokens, padded=True, group=group):
        if not index:  # this rank has fewer sequences than others have micro-batches
            ids = input_ids[:1, :2] if n else torch.ones(1, 2, dtype=torch.long)
            compute(model, ids, attention_mask=torch.ones_like(ids))
            continue
        rows = torch.tensor(index, device=input_ids.device)
        cut = int(max(lengths[i] for i in index))
        extra = {k: v[rows] for k, v in model_inputs.items()}
        result = compute(model, input_ids[rows, :cut], attention_mask=attention_mask[rows, :cut],
                         temperature=temperature, chunk_tokens=chunk_tokens,
                         return_entropy=return_entropy, **extra)
        values = result[0] if return_entropy else result
        out[rows, :cut - 1] = values.float() * attention_mask[rows, 1:cut].to(values.dtype)
        if return_entropy:
            entropy[rows, :cut - 1] = result[1].float() * attention_mask[rows, 1:cut].to(values.dtype)
    return (out, entropy) if return_entropy else out


def reference_logprobs(reference, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       policy: nn.Module | None = None, offloaded: bool = True,
                       **kwargs) -> torch.Tensor:
    """The reference's log-probs: `reference` a (sharded) model, kept on the host between uses
    when `offloaded` (moved to the device for this call and back: `onload`, `offload`), or
    `"adapter"`: `policy` (a PEFT model) with its adapters disabled. `kwargs` reach
    `sequence_logprobs`."""
    if reference == "adapter":
        if policy is None:
            raise ValueError("reference='adapter' needs the policy (a peft.PeftModel)")
        with adapters_disabled(policy):
            return sequence_logprobs(policy, input_ids, attention_mask, **kwargs)
    if not offloaded:  # its root unit would stay gathered after a forward without gradients
        try:
            return sequence_logprobs(reference, input_ids, attention_mask, **kwargs)
        finally:
            reshard_all(reference)
    onload(reference)
    try:
        return sequence_logprobs(reference, input_ids, attention_mask, **kwargs)
    finally:
        offload(reference)
