"""Per-token log-probabilities and the causal-LM loss through the output head, a chunk of tokens at a time.

For a 128K vocabulary an 8K-token micro-batch has 4 GB of fp32 logits; a plain `log_softmax(logits)`
holds them, their log-softmax and its gradient. Here the head is applied to `chunk` tokens of the
final hidden states at a time, the softmax of each chunk taken in fp32 from the logits in the
compute dtype the head makes them (the math of `F.linear(...).float()`), and no [tokens, vocabulary]
tensor larger than a chunk ever exists. Two autograd functions share the chunk arithmetic:

- `LinearCrossEntropy` (the SFT loss, a sum over targets): the upstream gradient of a sum is one
  number, so each chunk's gradients (softmax minus one-hot, times the weight / the hidden states)
  are made in the forward while its logits are at hand, and the backward only scales them.
- `LinearLogProbs` (`token_logprobs`, what preference losses and RL use): one value per token, each
  with its own upstream gradient, so the backward recomputes each chunk's logits (one more head
  matmul per chunk) instead of keeping them. With `entropy`, each position's entropy too.

The head is applied inside its own module call (`through_head`): the model runs as usual, and for
that one call the head's `forward` is the chunked function, so FSDP's hooks on the head's unit run
as they would for logits (unshard before, the pre-backward hook on the output, reshard as the unit's
policy says), tied embeddings included. That is right only when the model returns the head's output
unchanged as its logits (no soft-capping or scaling): checked on each model's first call; a model
that changes them gets the whole-logits path from then on (its first call run again, from the
random state it started with). A head split over tensor-parallel ranks, or anything but a plain
`nn.Linear` (a LoRA-wrapped head), takes the whole-logits path; the auto TP plan keeps the head
whole and its input replicated, so TP is chunked.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.rng import capture_rng_state, restore_rng_state
from ..data.rows import NOT_MODEL_INPUTS, aligned_targets, model_inputs  # noqa: F401 (this module's names too)
from ..errors import ConfigError
from ..log import warn_rank0
from ..packed_attention import packed_inputs
from .pipeline import pipeline_outputs

IGNORE_INDEX = -100
DEFAULT_LOSS_CHUNK_TOKENS = 1024


# --------------------------------------------------------------------------- the chunk arithmetic


def _chunk_logits(h, weight, bias, temperature: float = 1.0) -> torch.Tensor:
    """A chunk's logits in fp32 (made in the compute dtype, as the head makes them), over `temperature`."""
    logits = F.linear(h, weight, bias).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _add_head_grads(grad_logits, h, weight, rows: slice, grads: tuple) -> None:
    """A chunk's gradient w.r.t. its logits carried back through the head: hidden's rows written,
    the weight's and bias's gradients accumulated."""
    grad_hidden, grad_weight, grad_bias = grads
    grad_logits = grad_logits.to(h.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.t(), h)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)


def _empty_grads(hidden, weight, bias, needs) -> tuple:
    return (torch.empty_like(hidden) if needs[0] else None, torch.zeros_like(weight) if needs[1] else None,
            torch.zeros_like(bias) if needs[2] and bias is not None else None)


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
        grads = _empty_grads(hidden, weight, bias, needs)
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
    """One chunk's loss sum, its gradients added into `grads`. A function of its own so that its
    logits are freed before the next chunk's are made."""
    logits = _chunk_logits(h, weight, bias)
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(1, targets[:, None]).squeeze(1)) * keep).sum()
    if all(g is None for g in grads):
        return loss
    probs = logits.sub_(lse[:, None]).exp_()  # the chunk's softmax, in the logits' place
    probs.scatter_add_(1, targets[:, None], -keep[:, None].to(probs.dtype))
    _add_head_grads(probs.mul_(keep[:, None]), h, weight, rows, grads)
    return loss


class LinearLogProbs(torch.autograd.Function):
    """Per row: log_softmax(linear(hidden, weight, bias).float() / T)[target] (0 where the target is
    IGNORE_INDEX) and, with `entropy`, the entropy of that distribution; `chunk` rows at a time.

    Returns [tokens, 2] (log-prob, entropy; the entropy column 0 without `entropy`). The backward
    recomputes each chunk's logits: with u = z / T and p = softmax(u), d logp / du = onehot - p and
    d H / du = -p (u - E_p[u]).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, temperature: float, entropy: bool):
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        out = torch.zeros(hidden.shape[0], 2, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            u = _chunk_logits(hidden[rows], weight, bias, temperature)
            lse = torch.logsumexp(u, dim=-1)
            out[rows, 0] = (u.gather(1, safe[rows, None]).squeeze(1) - lse) * valid[rows]
            if entropy:
                logp = u.sub_(lse[:, None])
                out[rows, 1] = -(logp.exp() * logp).sum(-1) * valid[rows]
        ctx.save_for_backward(hidden, weight, bias, safe, valid)
        ctx.chunk, ctx.temperature, ctx.entropy = chunk, temperature, entropy
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, safe, valid = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grads = _empty_grads(hidden, weight, bias, needs)
        grad_out = grad_out.float() * valid[:, None]
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            u = _chunk_logits(hidden[rows], weight, bias, ctx.temperature)
            _add_head_grads(_logprob_grad(u, safe[rows], grad_out[rows], ctx.entropy) / ctx.temperature,
                            hidden[rows], weight, rows, grads)
        return (*grads, None, None, None, None)


def _logprob_grad(u, targets, grad_out, entropy: bool) -> torch.Tensor:
    """d (g0 * logp + g1 * H) / du for one chunk, written into `u`'s place."""
    probs = torch.softmax(u, dim=-1)
    grad = probs.mul(-grad_out[:, :1])
    grad.scatter_add_(1, targets[:, None], grad_out[:, :1])
    if entropy:
        centred = u.sub_((probs * u).sum(-1, keepdim=True))
        grad.sub_(probs.mul_(centred).mul_(grad_out[:, 1:]))
    return grad


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The summed cross-entropy of `F.linear(hidden, weight, bias)` against `targets` (same leading
    shape as `hidden`), through `LinearCrossEntropy`."""
    grad = torch.is_grad_enabled()
    needs = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    flat = hidden.reshape(-1, hidden.shape[-1])
    return LinearCrossEntropy.apply(flat, weight, bias, targets.reshape(-1).to(hidden.device), chunk, needs)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    chunk: int, temperature: float = 1.0, entropy: bool = False) -> torch.Tensor:
    """[*targets.shape, 2]: each position's log-prob of its target and (with `entropy`) its entropy,
    through `LinearLogProbs`."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = LinearLogProbs.apply(flat, weight, bias, targets.reshape(-1).to(hidden.device), chunk,
                               float(temperature), entropy)
    # a copy, not a view: FSDP warns about a unit (the head's) returning a view (2 floats a token)
    return out.view(*targets.shape, 2).clone()


# --------------------------------------------------------------------------- the head's call


def chunkable_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head if a chunked function can stand in for it: a plain `nn.Linear`
    (FSDP's subclass of it included) that tensor parallelism has not split."""
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


def through_head(model: nn.Module, inputs: dict, targets: torch.Tensor, apply: Callable,
                 call: Callable | None = None) -> torch.Tensor | None:
    """The model's forward with its head's call replaced by `apply(hidden, head)` (the hidden states
    the head gets, whose leading shape is `targets`'s); its result, or None where that would not be
    the model's (the caller then goes through whole logits). `call` runs the model's forward instead
    of `model(**inputs)` (a pipeline stage's, `fullshard.parallel.pp`)."""
    head = chunkable_head(model)
    if head is None or _RETURNS_HEAD_OUTPUT.get(model) is False:
        return None
    computed: list[torch.Tensor] = []

    def instead_of_logits(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:  # the model kept other positions than the labels'
            return F.linear(hidden, head.weight, head.bias)
        computed.append(apply(hidden, head))
        return computed[-1]

    rng = capture_rng_state() if model not in _RETURNS_HEAD_OUTPUT else None
    head.forward = instead_of_logits
    try:
        logits = (call() if call is not None else model(**inputs)).logits
    finally:
        del head.forward
    if len(computed) == 1 and logits is computed[0]:
        _RETURNS_HEAD_OUTPUT[model] = True
        return logits
    _RETURNS_HEAD_OUTPUT[model] = False
    warn_rank0(f"{type(model).__name__} does not return its head's output unchanged as its logits (soft-capping, "
               "scaling): its log-probs and loss are computed from whole logits; train.loss_chunk_tokens has no effect")
    if rng is not None:
        restore_rng_state(rng)
    return None


def chunked_loss_sum(model: nn.Module, inputs: dict, targets: torch.Tensor, chunk: int,
                     call: Callable | None = None) -> torch.Tensor | None:
    """The model's summed loss over `targets` ([batch, seq], one per position) with the head applied
    by `linear_cross_entropy_sum`; None where that would not be the model's loss."""
    def apply(hidden, head):
        return linear_cross_entropy_sum(hidden, head.weight, head.bias, targets, chunk)

    return through_head(model, inputs, targets, apply, call)


def chunked_logprobs(model: nn.Module, inputs: dict, targets: torch.Tensor, chunk: int, temperature: float = 1.0,
                     entropy: bool = False, call: Callable | None = None) -> torch.Tensor | None:
    """[batch, seq, 2] log-probs of `targets` (and entropies) with the head applied by
    `linear_logprobs`; None where that would not be the model's."""
    def apply(hidden, head):
        return linear_logprobs(hidden, head.weight, head.bias, targets, chunk, temperature, entropy)

    return through_head(model, inputs, targets, apply, call)


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    entropy: bool = False) -> torch.Tensor:
    """`linear_logprobs`' result from whole logits: [*targets.shape, 2], in fp32."""
    if hasattr(logits, "full_tensor"):  # a head split over tensor-parallel ranks
        logits = logits.full_tensor()
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    valid = targets != IGNORE_INDEX
    picked = logp.gather(-1, torch.where(valid, targets, 0).to(logp.device)[..., None]).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1) * valid if entropy else torch.zeros_like(picked)
    return torch.stack([picked, ent], dim=-1)


# --------------------------------------------------------------------------- batches


def forward_inputs(model: nn.Module, batch: dict) -> dict:
    """A micro-batch as the model's keyword arguments: labels left out, images concatenated, packed
    documents kept apart (`packed_inputs`)."""
    return packed_inputs(model, model_inputs({k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}))


def stage_logprobs(lm: nn.Module, call: Callable, targets: torch.Tensor,
                   chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, temperature: float = 1.0,
                   entropy: bool = False) -> torch.Tensor:
    """`batch_logprobs` on a pipeline's last stage: `call()` runs the causal LM's forward."""
    if chunk_tokens > 0:
        out = chunked_logprobs(lm, {}, targets, chunk_tokens, temperature, entropy, call=call)
        if out is not None:
            return out
    return logits_logprobs(call().logits, targets, temperature, entropy)


def batch_logprobs(model: nn.Module, batch: dict, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
                   temperature: float = 1.0, entropy: bool = False) -> torch.Tensor:
    """[rows, seq, 2]: each position's log-prob of its aligned target (0 where none) and entropy,
    chunked through the head where the model allows (`chunk_tokens` 0: from whole logits). On a
    pipelined model: a forward-only pass of the pipeline, its last stage computing them, every
    rank of the pipeline getting them (no gradient: a loss over them runs inside the pipeline,
    `Objective.stage_loss_sum`)."""
    if getattr(model, "fullshard_pipeline", None) is not None:
        def stage(lm, call, targets, **inputs):
            return stage_logprobs(lm, call, targets, chunk_tokens, temperature, entropy)

        return pipeline_outputs(model, batch, stage)
    inputs, targets = forward_inputs(model, batch), aligned_targets(batch)
    if chunk_tokens > 0:
        out = chunked_logprobs(model, inputs, targets, chunk_tokens, temperature, entropy)
        if out is not None:
            return out
    return logits_logprobs(model(**inputs).logits, targets, temperature, entropy)


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   temperature: float = 1.0, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
                   return_entropy: bool = False, **model_inputs):
    """Per-token log-probabilities of a (sharded or plain) causal LM, without its whole logits.

    `labels` as in `model(input_ids, labels=labels)` (default `input_ids`; -100: not scored).
    Returns a [batch, seq - 1] fp32 tensor whose entry t is log p(labels[:, t + 1] | tokens up to t)
    at `temperature`, 0 where that label is -100; with `return_entropy`, also the entropy of each
    position's distribution (0 there too). The head is applied `chunk_tokens` tokens at a time from
    the final hidden states; the result is differentiable, with the gradient of the whole-logits
    path. Other model inputs (`pixel_values`, `image_grid_thw`, ...) go through `model_inputs`.
    Every rank of a sharded model calls it with its own rows, as for a forward. On a pipelined
    model (pp) the last stage computes them and every rank of the pipeline gets them, without a
    gradient: a loss over them trains through the pipeline's own backward, which the trainer's
    objectives and `fullshard.rl.policy_update` run (the call is refused with gradients enabled).
    """
    batch = {"input_ids": input_ids, "labels": input_ids if labels is None else labels, **model_inputs}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if position_ids is not None:
        batch["position_ids"] = position_ids
    if getattr(model, "fullshard_pipeline", None) is not None and torch.is_grad_enabled() and any(
            p.requires_grad for p in model.parameters()):
        raise ConfigError("token_logprobs on a pipelined model gives values without a gradient "
                          "(call it under torch.no_grad()); a loss over them trains inside the "
                          "pipeline: train.objective=dpo, fullshard.rl.policy_update")
    out = batch_logprobs(model, batch, chunk_tokens, temperature, return_entropy)[:, :-1]
    return (out[..., 0], out[..., 1]) if return_entropy else out[..., 0]
