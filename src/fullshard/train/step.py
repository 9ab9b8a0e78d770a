"""One optimizer step over a window of micro-batches, the unit both the trainer and the tests run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..optim import StepResult
from .loss import causal_lm_loss_sum, global_target_count, normalized_loss, sum_over_ranks


@dataclass
class StepOutput:
    loss: float  # mean over every target token of the step, all ranks
    tokens: int  # target tokens in the step, all ranks
    result: StepResult


def train_step(strategy, model: torch.nn.Module, optimizer, scheduler, micro_batches: list[dict]) -> StepOutput:
    """Forward and backward every micro-batch of this rank, then clip and step once.

    The number of micro-batches must be the strategy's accumulation window, so that its
    `optimizer_step` steps exactly at the last one. Under context parallelism they are this cp
    rank's parts (`fullshard.parallel.cp.context_parallel_batch`); FSDP then averages gradients
    over dp x cp, and tp ranks, which repeat their data rank's batch, are counted once.
    """
    if len(micro_batches) != strategy.accumulated_gradient:
        raise ValueError(f"got {len(micro_batches)} micro-batches, the accumulation window is "
                         f"{strategy.accumulated_gradient}")
    dims = strategy.parallel_dims
    tokens = global_target_count(micro_batches, repeats=dims.tp)
    total = torch.zeros((), dtype=torch.float64)
    result = None
    for batch in micro_batches:
        loss_sum = causal_lm_loss_sum(model, batch)
        strategy.backward(normalized_loss(loss_sum, tokens, dims.dp_size * dims.cp), model, optimizer, normalized=True)
        total += loss_sum.detach().to("cpu", torch.float64)
        result = strategy.optimizer_step(optimizer, model, scheduler)
    return StepOutput(float(sum_over_ranks(total, repeats=dims.tp)) / max(tokens, 1), tokens, result)
