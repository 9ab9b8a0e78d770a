"""Activation offload: what a block saves for backward waits in host memory instead of the device's.

Long sequences run out of device memory in the activations, not the weights. Each block's call runs
under torch's `saved_tensors_hooks` (the approach of torchtune's `OffloadActivations`, which TRL
and verl use): every tensor autograd saves is copied to pinned host memory as it is saved, and in
backward, when a block's first saved tensor is needed, the previous block's come back on a side
stream, so the copy overlaps the block's backward (one block ahead). Under activation
checkpointing the hooks sit outside the checkpoint: only the blocks' inputs (the checkpoints) are
saved, so only they move. Parameters (the gathered weights a matmul saves) and tiny tensors stay
where they are: they are not the activations' memory, and moving them would cost a copy each way.

On a host with no accelerator the same hooks run with nothing to move, so the training math is
the same with and without, and the tests prove it there.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .plan import find_blocks

MIN_OFFLOAD_BYTES = 1024  # smaller saved tensors (scales, shapes' worth of ints) are not worth a copy


class ActivationOffload:
    """The saved tensors of one model's blocks: their host copies, and the side stream bringing the
    next block's back during backward."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.moves = self.device.type not in ("cpu", "meta")
        # the side stream on CUDA; other accelerators bring each tensor back when it is needed
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.calls = 0  # block calls so far; a call's index names its saved tensors
        self.waiting: dict[int, list] = {}  # call index -> weak references to its host copies
        self.fetched: dict[int, dict[int, torch.Tensor]] = {}  # call index -> host copy id -> device tensor

    def wrap(self, call, block: nn.Module):
        """`call` (a block's forward, or its compiled call) with its saved tensors offloaded."""

        @functools.wraps(call)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return call(*args, **kwargs)
            with self.hooks(block):
                return call(*args, **kwargs)

        return run

    def hooks(self, block: nn.Module) -> saved_tensors_hooks:
        index, self.calls = self.calls, self.calls + 1
        if len(self.waiting) > 256:  # calls whose graph was dropped without a backward
            self.waiting = {i: refs for i, refs in self.waiting.items() if any(r() is not None for r in refs)}
        refs = self.waiting.setdefault(index, [])
        params = {_storage(p) for p in block.parameters() if p.device.type != "meta"}

        def pack(tensor: torch.Tensor):
            if not self.moves or tensor.device.type == "cpu" or not self._worth_moving(tensor, params):
                return None, tensor
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)  # on the compute stream: in order with the tensor's writes
            refs.append(weakref.ref(host))
            return index, host

        def unpack(packed):
            index, tensor = packed
            if index is None:
                return tensor
            self.prefetch(index - 1)
            fetched = self.fetched.get(index, {}).pop(id(tensor), None)
            if fetched is None:
                return tensor.to(self.device, non_blocking=True)
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            fetched.record_stream(current)
            return fetched

        return saved_tensors_hooks(pack, unpack)

    @staticmethod
    def _worth_moving(tensor: torch.Tensor, params: set[int]) -> bool:
        """A plain tensor of some size that is no parameter's (a tensor subclass, such as torchao's
        float8 tensors, has no storage of its own to copy: it stays)."""
        if type(tensor) is not torch.Tensor:
            return False
        return tensor.untyped_storage().nbytes() >= MIN_OFFLOAD_BYTES and _storage(tensor) not in params

    def prefetch(self, index: int) -> None:
        """Start bringing call `index`'s host copies back on the side stream (once)."""
        if self.stream is None:
            return
        refs = self.waiting.pop(index, None)
        if not refs:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the offload copies are done
        fetched = self.fetched.setdefault(index, {})
        with torch.cuda.stream(self.stream):
            for ref in refs:
                host = ref()
                if host is not None:
                    fetched[id(host)] = host.to(self.device, non_blocking=True)


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's storage; None for a wrapper subclass (a DTensor's or float8
    weight's), which has none."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def apply_activation_offload(model: nn.Module, device: torch.device) -> ActivationOffload:
    """Offload the saved tensors of every outermost block of `model` (after checkpointing and
    compiling them: a compiled block's whole call runs under the hooks, outside its graph)."""
    offload = ActivationOffload(device)
    modules = dict(model.named_modules())
    for name in find_blocks(model):
        block = modules[name]
        if getattr(block, "_fullshard_offloaded", False):
            continue
        if getattr(block, "_compiled_call_impl", None) is not None:
            block._compiled_call_impl = offload.wrap(block._compiled_call_impl, block)
        else:
            block.forward = offload.wrap(block.forward, block)
        block._fullshard_offloaded = True
    model._fullshard_activation_offload = offload
    return offload
