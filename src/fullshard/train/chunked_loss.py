"""The causal-LM loss through the output head a chunk of tokens at a time: never the batch's whole logits.

For a 128K vocabulary an 8K-token micro-batch has 4 GB of fp32 logits, and the plain loss holds
them, their log-softmax and its gradient. `LinearCrossEntropy` takes `chunk` tokens at a time: their
logits, log-sum-exp and loss, and, while that chunk's logits are at hand, the loss's gradients
with respect to the hidden states and the head's weight (softmax minus the one-hot target, times
the weight / the hidden states), accumulated in place. No [tokens, vocabulary] tensor larger than
a chunk ever exists, nothing is recomputed, and the backward only scales the stored gradients by
the incoming one: the math of the plain loss (`F.linear(...).float()` then cross-entropy), each
chunk's logits in the compute dtype as the head makes them and the softmax in fp32.

The head is applied inside its own module call. The model runs as usual, and for that one call the
head's `forward` is the chunked loss: FSDP's hooks on the head's unit run exactly as they would for
logits (unshard before, the pre-backward hook on the loss, reshard as the unit's policy says), tied
embeddings included. That is the model's loss only when the model returns the head's output
unchanged as its logits (no soft-capping or scaling): checked on each model's first call; a model
that changes them gets the plain loss from then on (its first micro-batch is run again, from the
random state it started with). A head split over tensor-parallel ranks, or anything but a plain
`nn.Linear` (a LoRA-wrapped head), keeps the plain loss; the auto TP plan keeps the head whole and
its input replicated, so TP uses the chunked loss.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.rng import capture_rng_state, restore_rng_state
from ..log import warn_rank0

IGNORE_INDEX = -100
DEFAULT_LOSS_CHUNK_TOKENS = 1024


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(linear(hidden, weight, bias).float(), targets), `chunk` rows at a time.

    `hidden` is [tokens, H], `targets` [tokens] (IGNORE_INDEX: no loss). The gradients are computed
    in the forward, for the inputs `needs` names, and held (in the inputs' dtypes: what the plain
    loss's backward makes) until the backward scales them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, needs: tuple[bool, bool, bool]):
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        grads = (torch.empty_like(hidden) if needs[0] else None, torch.zeros_like(weight) if needs[1] else None,
                 torch.zeros_like(bias) if needs[2] else None)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            total += _chunk_loss_and_grads(hidden[rows], weight, bias, safe[rows], valid[rows], rows, grads)
        ctx.grads = grads
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("the chunked loss was differentiated twice (retain_graph): its gradients are "
                               "computed once, in the forward; set train.loss_chunk_tokens=0")
        grads, ctx.grads = ctx.grads, None
        return (*(None if g is None else g.mul_(grad_total) for g in grads), None, None, None)


def _chunk_loss_and_grads(h, weight, bias, targets, keep, rows: slice, grads: tuple) -> torch.Tensor:
    """One chunk's loss sum, its gradients added into `grads` (hidden's rows written, the weight's
    and bias's accumulated). A function of its own so that its logits are freed before the next
    chunk's are made."""
    logits = F.linear(h, weight, bias).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(1, targets[:, None]).squeeze(1)) * keep).sum()
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is None and grad_weight is None and grad_bias is None:
        return loss
    probs = logits.sub_(lse[:, None]).exp_()  # the chunk's softmax, in the logits' place
    probs.scatter_add_(1, targets[:, None], -keep[:, None].to(probs.dtype))
    grad_logits = probs.mul_(keep[:, None]).to(h.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.t(), h)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    return loss


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The summed cross-entropy of `F.linear(hidden, weight, bias)` against `targets` (same leading
    shape as `hidden`), through `LinearCrossEntropy`."""
    grad = torch.is_grad_enabled()
    needs = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    flat = hidden.reshape(-1, hidden.shape[-1])
    return LinearCrossEntropy.apply(flat, weight, bias, targets.reshape(-1).to(hidden.device), chunk, needs)


def chunkable_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head if the chunked loss can stand in for it: a plain `nn.Linear` (FSDP's
    subclass of it included) that tensor parallelism has not split."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None
    if getattr(head, "_distribute_module_applied", False):  # a TP style's hooks: the weight is a DTensor
        return None
    return head


# model -> whether it returns its head's output unchanged as its logits (learned on its first call)
_RETURNS_HEAD_OUTPUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunked_loss_sum(model: nn.Module, inputs: dict, targets: torch.Tensor, chunk: int,
                     call: Callable | None = None) -> torch.Tensor | None:
    """The model's summed loss over `targets` ([batch, seq], one per position) with the head applied
    by `linear_cross_entropy_sum`; None where that would not be the model's loss (the caller then
    computes it from whole logits). `call` runs the model's forward instead of `model(**inputs)`
    (a pipeline stage's, `fullshard.parallel.pp`)."""
    head = chunkable_head(model)
    if head is None or _RETURNS_HEAD_OUTPUT.get(model) is False:
        return None
    computed: list[torch.Tensor] = []

    def loss_instead_of_logits(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:  # the model kept other positions than the labels'
            return F.linear(hidden, head.weight, head.bias)
        computed.append(linear_cross_entropy_sum(hidden, head.weight, head.bias, targets, chunk))
        return computed[-1]

    rng = capture_rng_state() if model not in _RETURNS_HEAD_OUTPUT else None
    head.forward = loss_instead_of_logits
    try:
        logits = (call() if call is not None else model(**inputs)).logits
    finally:
        del head.forward
    if len(computed) == 1 and logits is computed[0]:
        _RETURNS_HEAD_OUTPUT[model] = True
        return logits
    _RETURNS_HEAD_OUTPUT[model] = False
    warn_rank0(f"{type(model).__name__} does not return its head's output unchanged as its logits (soft-capping, "
               "scaling): the loss is computed from whole logits; train.loss_chunk_tokens has no effect")
    if rng is not None:
        restore_rng_state(rng)
    return None
