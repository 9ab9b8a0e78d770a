"""One optimizer step over a window of micro-batches, the unit both the trainer and the tests run.

A step costs FSDP's own collectives plus two small ones, both needed for exactness: the global
target-token count (the loss is normalised by it before backward), started before the first
forward and waited for at the first backward; and, after the last backward, one all_reduce that
carries the grad norm's pieces (whose finiteness decides whether every rank steps) together with
the step's loss sum for the log (`optim.grad_norm_and_sum`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS
from ..optim import StepResult
from .loss import PendingTargetCount, causal_lm_loss_sum, normalized_loss, sum_over_ranks


@dataclass
class StepOutput:
    loss: float  # mean over every target token of the step, all ranks
    tokens: int  # target tokens in the step, all ranks
    result: StepResult


def train_step(strategy, model: torch.nn.Module, optimizer, scheduler, micro_batches: list[dict],
               loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> StepOutput:
    """Forward and backward every micro-batch of this rank, then clip and step once.

    The number of micro-batches must be the strategy's accumulation window, so that its
    `optimizer_step` steps exactly at the last one. Under context parallelism they are this cp
    rank's parts (`fullshard.parallel.cp.context_parallel_batch`); FSDP then averages gradients
    over dp x cp, and tp ranks, which repeat their data rank's batch, are counted once.
    `loss_chunk_tokens` is `train.loss_chunk_tokens` (`causal_lm_loss_sum`).
    """
    if len(micro_batches) != strategy.accumulated_gradient:
        raise ValueError(f"got {len(micro_batches)} micro-batches, the accumulation window is "
                         f"{strategy.accumulated_gradient}")
    dims = strategy.parallel_dims
    count = PendingTargetCount(micro_batches, repeats=dims.tp)
    total, tokens, result = None, None, None
    for index, batch in enumerate(micro_batches):
        loss_sum = causal_lm_loss_sum(model, batch, loss_chunk_tokens)
        tokens = count.wait() if tokens is None else tokens
        strategy.backward(normalized_loss(loss_sum, tokens, dims.dp_size * dims.cp), model, optimizer, normalized=True)
        total = loss_sum.detach().double() + (0 if total is None else total)
        last = index == len(micro_batches) - 1
        result = strategy.optimizer_step(optimizer, model, scheduler, values=total.reshape(1) if last else None)
    summed = result.sums if result is not None and result.sums is not None else sum_over_ranks(total.cpu())
    return StepOutput(float(summed.sum()) / dims.tp / max(tokens, 1), tokens, result)
