"""The train step and evaluation of a model cut into pipeline stages (`fullshard.parallel.pp`).

The same arithmetic as `step.py`: the objective's loss is summed over its units (target tokens,
pairs) and divided by the units of the whole optimizer step, so any number of pipeline
micro-batches equals one big batch. Here the pipeline schedule runs each trainer micro-batch (cut
into `pp_microbatches` by rows: a row is never split, so a preference pair stays in one), the last
stage computes the objective's loss (`Objective.stage_loss_sum`: chunked through the head, as
without pp, where the model allows; what it needs besides the targets, a reference's log-probs,
computed first on every rank by `Objective.stage_inputs`), the two ends of a tied weight add up
their gradients, and the clip takes the norm over every stage. Running a batch through the
schedule (padding it to one agreed shape) is `objectives/pipeline.py`, which `token_logprobs` and
`fullshard.rl`'s update share.
"""

from __future__ import annotations

import torch

from ..fsdp import reshard_all
from ..objectives.base import Objective
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS
from ..objectives.pipeline import run_pipeline, sum_tied_gradients
from ..objectives.sft import SFT
from ..parallel.pp import pipeline_of
from .loss import PendingTargetCount, global_target_count, sum_over_ranks
from .step import StepOutput


def stage_loss(chunk_tokens: int):
    """The last stage's next-token loss sum (`SFT.stage_loss_sum`)."""
    objective = SFT(chunk_tokens)
    return lambda lm, call, targets, **inputs: objective.stage_loss_sum(lm, call, targets)[0]


class _StageSums:
    """The objective on the last stage: returns its loss sum to the schedule, keeps its metric
    sums. torch's first step of a schedule also runs the stage once on stand-in inputs to size its
    buffers: only the last `microbatches` calls of a run are the micro-batches'."""

    def __init__(self, objective: Objective):
        self.objective, self.metrics = objective, []

    def __call__(self, lm, call, targets, **inputs):
        loss, sums = self.objective.stage_loss_sum(lm, call, targets, **inputs)
        self.metrics.append(sums)
        return loss

    def take(self, count: int) -> torch.Tensor | None:
        sums, self.metrics = self.metrics[-count:] if count else [], []
        sums = [s for s in sums if s is not None]
        return torch.stack(sums).sum(0) if sums else None


def pipeline_train_step(strategy, model: torch.nn.Module, optimizer, scheduler, micro_batches: list[dict],
                        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
                        objective: Objective | None = None) -> StepOutput:
    """`train_step` for a pipelined model: every micro-batch through the schedule, then one step."""
    if len(micro_batches) != strategy.accumulated_gradient:
        raise ValueError(f"got {len(micro_batches)} micro-batches, the accumulation window is "
                         f"{strategy.accumulated_gradient}")
    objective = objective or SFT(loss_chunk_tokens)
    pipeline, dims = pipeline_of(model), strategy.parallel_dims
    repeats = dims.tp * dims.pp  # every stage sees every batch
    tokens = global_target_count(micro_batches, repeats=repeats)
    units = tokens
    if not isinstance(objective, SFT):
        units = PendingTargetCount(micro_batches, repeats, objective.count).wait()
    scale = dims.dp_size * dims.cp / max(units, 1)  # FSDP then averages over dp x cp (see loss.py)
    scaler = strategy.scaler
    objective.begin_step(micro_batches)
    # before any backward: a reference pass through this pipeline would drop pending gradients
    inputs = [objective.stage_inputs(model, batch) for batch in micro_batches]

    def loss_fn(summed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # the last stage made the sum
        loss = summed * scale
        return scaler.scale_loss(loss) if scaler is not None else loss

    pipeline.loss_fn = loss_fn
    stage = _StageSums(objective)
    pipeline.set_stage_loss(stage)
    losses, metrics = [], torch.zeros(len(objective.metrics), dtype=torch.float64)
    for batch, extra in zip(micro_batches, inputs):
        run = run_pipeline(pipeline, objective.stage_batch(batch), train=True, loss_inputs=extra)
        losses += run
        sums = stage.take(len(run))
        if sums is not None:
            metrics += sums.to("cpu", torch.float64)
    sum_tied_gradients(pipeline)
    tied = pipeline.tied_parameter()
    uncounted = [tied] if tied is not None and not pipeline.has_first else []  # counted once, on the first stage
    result = None
    for _ in micro_batches:
        result = strategy.optimizer_step(optimizer, model, scheduler, across=pipeline.pp_group, uncounted=uncounted)
    total = sum((loss.detach().to("cpu", torch.float64) for loss in losses), torch.zeros((), dtype=torch.float64))
    # back to a sum over units
    total /= scale * (scaler.scale if scaler is not None and scaler.enabled else 1.0)
    summed = sum_over_ranks(torch.cat([total.reshape(1), metrics]), repeats=dims.tp)
    means = (summed / max(units, 1)).tolist()
    return StepOutput(means[0], tokens, result, dict(zip(objective.metrics, means[1:])), units)


@torch.no_grad()
def pipeline_evaluate(model: torch.nn.Module, batches: list[dict],
                      loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
                      objective: Objective | None = None):
    """Mean loss per unit over every rank's eval batches, forward only through the pipeline; with
    `objective.metrics`, `(loss, {metric: mean})` as `trainer.evaluate`."""
    if not batches:
        return None
    objective = objective or SFT(loss_chunk_tokens)
    pipeline = pipeline_of(model)
    dims = pipeline.dims
    pipeline.loss_fn = lambda summed, targets: summed
    stage = _StageSums(objective)
    pipeline.set_stage_loss(stage)
    totals = torch.zeros(2 + len(objective.metrics), dtype=torch.float64)
    objective.begin_step(batches)
    for batch in batches:
        extra = objective.stage_inputs(model, batch)
        run = run_pipeline(pipeline, objective.stage_batch(batch), train=False, loss_inputs=extra)
        totals[0] += sum(loss.to("cpu", torch.float64) for loss in run)
        sums = stage.take(len(run))
        if sums is not None:
            totals[2:] += sums.to("cpu", torch.float64)
        totals[1] += objective.count(batch) / dims.pp  # every stage counts it: once in all
    for s in pipeline.stages:
        reshard_all(s)
    summed = sum_over_ranks(totals, repeats=dims.tp)
    loss = float(summed[0] / summed[1])
    if not objective.metrics:
        return loss
    return loss, dict(zip(objective.metrics, (summed[2:] / summed[1]).tolist()))


