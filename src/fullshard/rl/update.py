"""One policy update from fixed rollouts: token-budget micro-batches, global aggregation, one step.

The rollouts are this rank's completed sequences with everything the loss needs (advantages, the
old policy's and the reference's log-probs). The update splits them into micro-batches of at most
`max_tokens` tokens (`token_batches`, every data-parallel rank running as many), takes each one's
log-probs through the head in chunks (`token_logprobs`), normalises its loss by the mini-batch's
global counts (`global_counts`) and backpropagates it; the gradients of all micro-batches on all
ranks add up to the one-process gradient of the whole mini-batch, so the step (clipped by the
global norm) does not depend on `max_tokens` or the world size.
"""

from __future__ import annotations

import torch

from ..objectives.logprobs import token_logprobs
from ..optim import clip_and_step
from ..parallel.pp import pipeline_of
from .batches import token_batches
from .counts import global_counts
from .pipeline import pipelined_sums
from .terms import SUMMED, Rollouts, UpdateConfig, loss_terms, term_sums  # noqa: F401 (rl.update's names too)


def micro_batch_loss(model, batch: Rollouts, config: UpdateConfig, counts, dp_size: int):
    """The globally normalised loss of one micro-batch and its terms' sums (weighted to add up,
    over micro-batches and ranks, to the mini-batch's means)."""
    logprobs, entropy = token_logprobs(
        model, batch.input_ids, attention_mask=batch.attention_mask, temperature=config.temperature,
        chunk_tokens=config.chunk_tokens, return_entropy=True, **batch.model_inputs)
    return loss_terms(logprobs, entropy, batch, config, counts, dp_size)


def _stand_in(model, like: Rollouts) -> torch.Tensor:
    """A forward whose loss is 0 for a rank with fewer sequences than micro-batches: FSDP's
    collectives need every rank to run each one."""
    ids = like.input_ids[:1, :2]
    logprobs = token_logprobs(model, ids, attention_mask=torch.ones_like(ids))
    return logprobs.sum() * 0.0


def policy_update(model, optimizer, rollouts: Rollouts, config: UpdateConfig, *, dp_size: int = 1,
                  group=None, repeats: int = 1, scheduler=None) -> dict[str, float]:
    """One optimizer step on this rank's `rollouts` (a collective over `group`, default every
    rank). `dp_size`: the ranks FSDP averages gradients over (dp x cp); `repeats`: ranks holding
    the same rollouts (tensor-parallel ranks of one data rank, and the pp ranks of one pipeline:
    on a pipelined model the last stage computes the loss, `pipeline.py`). Returns the
    mini-batch's `loss`, `pg_loss`, `kl`, `entropy` and statistics (global, as one process over
    all rollouts would compute them), `grad_norm`, `micro_batches`, `skipped`."""
    batches = token_batches(rollouts.lengths(), config.max_tokens, padded=True, group=group)
    counts = global_counts([rollouts.response_mask], group=group, repeats=repeats)
    step = {}
    if pipeline_of(model) is not None:
        sums, step = pipelined_sums(model, rollouts, batches, config, counts, dp_size)
    else:
        sums = torch.zeros(len(SUMMED), dtype=torch.float64)
        for index in batches:
            if not index:
                _stand_in(model, rollouts).backward()
                continue
            loss, terms = micro_batch_loss(model, rollouts.rows(index), config, counts, dp_size)
            loss.backward()
            sums += term_sums(terms)
    device = next(model.parameters()).device
    result = clip_and_step(optimizer, config.max_norm, scheduler, values=sums.to(device), **step)
    totals = (result.sums.cpu() if result.sums is not None else sums) / (dp_size * repeats)
    out = {name: float(value) for name, value in zip(SUMMED, totals)}
    out.update(grad_norm=float(result.grad_norm), micro_batches=len(batches),
               skipped=bool(result.skipped))
    return out
