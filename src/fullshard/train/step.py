"""One optimizer step over a window of micro-batches, the unit both the trainer and the tests run.

A step costs FSDP's own collectives plus two small ones, both needed for exactness: the global
target-token count (the loss is normalised by it before backward), started before the first
forward and waited for at the first backward; and, after the last backward, one all_reduce that
carries the grad norm's pieces (whose finiteness decides whether every rank steps) together with
the step's loss sum for the log (`optim.grad_norm_and_sum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..objectives.base import Objective
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS
from ..objectives.sft import SFT
from ..optim import StepResult
from .loss import PendingTargetCount, normalized_loss, sum_over_ranks, target_count


@dataclass
class StepOutput:
    loss: float  # mean over every unit (target token, pair) of the step, all ranks
    tokens: int  # target tokens in the step, all ranks
    result: StepResult
    metrics: dict = field(default_factory=dict)  # the objective's means over the step's units
    units: int | None = None  # what the loss is a mean over (pairs for preference losses), all ranks


def train_step(strategy, model: torch.nn.Module, optimizer, scheduler, micro_batches: list[dict],
               loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, objective: Objective | None = None) -> StepOutput:
    """Forward and backward every micro-batch of this rank, then clip and step once.

    The number of micro-batches must be the strategy's accumulation window, so that its
    `optimizer_step` steps exactly at the last one. Under context parallelism they are this cp
    rank's parts (`fullshard.parallel.cp.context_parallel_batch`); FSDP then averages gradients
    over dp x cp, and tp ranks, which repeat their data rank's batch, are counted once.
    `loss_chunk_tokens` is `train.loss_chunk_tokens` (`causal_lm_loss_sum`). `objective` (default:
    the next-token loss) gives each micro-batch's loss and metric sums and the units they are means over.
    """
    objective = objective or SFT(loss_chunk_tokens)
    if len(micro_batches) != strategy.accumulated_gradient:
        raise ValueError(f"got {len(micro_batches)} micro-batches, the accumulation window is "
                         f"{strategy.accumulated_gradient}")
    dims = strategy.parallel_dims
    count = PendingTargetCount(micro_batches, repeats=dims.tp, count=objective.count)
    total, units, result = None, None, None
    objective.begin_step(micro_batches)
    for index, batch in enumerate(micro_batches):
        loss_sum, metric_sums = objective.loss_sum(model, batch)
        units = count.wait() if units is None else units
        strategy.backward(normalized_loss(loss_sum, units, dims.dp_size * dims.cp), model, optimizer, normalized=True)
        # the loss, the metrics and the target tokens (throughput) ride along in the grad norm's all_reduce
        sums = loss_sum.detach().to("cpu", torch.float64).reshape(1)
        if metric_sums is not None:
            sums = torch.cat([sums, metric_sums])
        sums = torch.cat([sums, torch.tensor([float(target_count(batch))], dtype=torch.float64)])
        total = sums if total is None else total + sums
        last = index == len(micro_batches) - 1
        result = strategy.optimizer_step(optimizer, model, scheduler, values=total if last else None)
    summed = result.sums if result is not None and result.sums is not None else sum_over_ranks(total.cpu())
    summed = summed.double() / dims.tp
    means = (summed[:-1] / max(units, 1)).tolist()
    return StepOutput(means[0], int(round(float(summed[-1]))), result, dict(zip(objective.metrics, means[1:])), units)
