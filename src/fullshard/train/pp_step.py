"""The train step and evaluation of a model cut into pipeline stages (`fullshard.parallel.pp`).

The same arithmetic as `step.py`: the objective's loss is summed over its units (target tokens,
pairs) and divided by the units of the whole optimizer step, so any number of pipeline
micro-batches equals one big batch. Here the pipeline schedule runs each trainer micro-batch (cut
into `pp_microbatches` by rows: a row is never split, so a preference pair stays in one), the last
stage computes the objective's loss (`Objective.stage_loss_sum`: chunked through the head, as
without pp, where the model allows; what it needs besides the targets, a reference's log-probs,
computed first on every rank by `Objective.stage_inputs`), the two ends of a tied weight add up
their gradients, and the clip takes the norm over every stage. `pipeline_logprobs` is the
forward-only pass `token_logprobs` takes on a pipelined model, every pp rank getting the result.

torch's stages size their buffers from the first inputs a schedule sees, so every call here pads
its rows and columns to the largest over the world (rows to a multiple of the pipeline
micro-batches; the added rows and columns carry no targets) and keys the schedule by that shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.preference import ROLE
from ..fsdp import reshard_all
from ..objectives.base import Objective
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS, stage_logprobs
from ..objectives.sft import SFT
from ..parallel.pp import LOSS_INPUTS, TARGETS, Pipeline, pipeline_of
from ..tensors import local_tensor
from .loss import NOT_MODEL_INPUTS, PendingTargetCount, aligned_targets, global_target_count, sum_over_ranks
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


@torch.no_grad()
def pipeline_logprobs(model: torch.nn.Module, batch: dict,
                      chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, temperature: float = 1.0,
                      entropy: bool = False) -> torch.Tensor:
    """`batch_logprobs` of a pipelined model: [rows, seq, 2] on every rank of the pipeline, computed
    by the last stage in a forward-only pass and broadcast from it."""
    pipeline = pipeline_of(model)
    rows, width = batch["input_ids"].shape
    pipeline.loss_fn = lambda output, targets: output.new_zeros(())
    def stage(lm, call, targets, **inputs):
        return stage_logprobs(lm, call, targets, chunk_tokens, temperature, entropy)

    pipeline.set_stage_loss(stage)
    padded = agreed_shape(batch, pipeline.microbatches)
    out = run_pipeline(pipeline, padded, train=False, outputs=True)
    if out is None:  # not the last stage: the shape the last one sends
        out = torch.zeros(*padded["input_ids"].shape, 2, dtype=torch.float32,
                          device=pipeline.device)
    out = local_tensor(out).to(pipeline.device, torch.float32).contiguous()
    if dist.get_world_size(pipeline.pp_group) > 1:
        dist.broadcast(out, src=pipeline.last_rank, group=pipeline.pp_group)
    return out[:rows, :width]


def run_pipeline(pipeline: Pipeline, batch: dict, train: bool, loss_inputs: dict | None = None,
                 outputs: bool = False):
    """One trainer micro-batch through the schedule: token ids into the first stage, targets (and
    `loss_inputs`) to the last, the other model inputs (position ids, masks) to every stage.
    Returns the loss of each pipeline micro-batch on the last stage (none elsewhere), or with
    `outputs` the last stage's outputs, merged (None elsewhere). The schedule's own list, not the
    loss function, says what the losses were: it also calls the loss function to size its
    buffers."""
    prefix = "loss_input:"  # padded along with the rows and columns of the batch
    batch = {**batch, **{prefix + k: v for k, v in (loss_inputs or {}).items()}}
    batch = agreed_shape(batch, pipeline.microbatches)
    loss_inputs = {k[len(prefix):]: batch.pop(k) for k in list(batch) if k.startswith(prefix)}
    device = pipeline.device
    args = (batch["input_ids"].to(device),) if pipeline.has_first else ()
    kwargs = {k: v.to(device) for k, v in batch.items()
              if k not in NOT_MODEL_INPUTS and k != "input_ids" and isinstance(v, torch.Tensor)}
    target = aligned_targets(batch).to(device) if pipeline.has_last else None
    if target is not None:
        kwargs[TARGETS] = target  # the last stage computes the loss inside its model call
        if loss_inputs:
            kwargs[LOSS_INPUTS] = {k: v.to(device) for k, v in loss_inputs.items()}
    key = (train, outputs, tuple(batch["input_ids"].shape),
           tuple(sorted(k for k in kwargs if k not in (TARGETS, LOSS_INPUTS))))
    schedule = pipeline.schedule(key)
    losses: list[torch.Tensor] = []
    result = (schedule.step if train else schedule.eval)(*args, target=target, losses=losses,
                                                         return_outputs=outputs, **kwargs)
    return result if outputs else losses


def agreed_shape(batch: dict, multiple: int) -> dict:
    """`batch` padded to the most rows and columns of any rank's (one all_reduce), the rows to a
    multiple of `multiple` (the pipeline micro-batches); the added rows and columns have no
    targets and no pair roles, attention masks 0 there, positions counting on. Unchanged where
    it already has that shape."""
    rows, width = batch["input_ids"].shape
    shape = torch.tensor([rows, width], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    want_rows = -int(shape[0]) // multiple * -multiple
    batch = _padded(batch, want_rows - rows)
    return _widened(batch, int(shape[1]) - width)


def _widened(batch: dict, extra: int) -> dict:
    if not extra:
        return batch
    width = batch["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[-1] != width:
            out[key] = value
            continue
        if key == "position_ids":
            filler = value[..., -1:] + torch.arange(1, extra + 1, dtype=value.dtype)
        else:
            fill = -100 if key in ("labels", "shift_labels") else 0
            filler = torch.full((*value.shape[:-1], extra), fill, dtype=value.dtype)
        out[key] = torch.cat([value, filler.to(value.device)], dim=-1)
    return out
def sum_tied_gradients(pipeline: Pipeline) -> None:
    """Add the gradients of a tied embedding / head held by the first and last stages, so both
    ends take the same step as the one tensor of the unsplit model."""
    tied = pipeline.tied_parameter()
    if tied is None or pipeline.tie_group is None or (pipeline.has_first and pipeline.has_last):
        return
    if tied.grad is None:
        tied.grad = torch.zeros_like(tied)
    dist.all_reduce(local_tensor(tied.grad), group=pipeline.tie_group)


def _padded(batch: dict, extra: int) -> dict:
    """`batch` with its first row repeated `extra` times, the added rows carrying no targets and
    no pair roles (an eval batch can be smaller than a training one)."""
    if not extra:
        return batch
    padded = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            padded[key] = value
            continue
        filler = value[:1].expand(extra, *value.shape[1:])
        if key in ("labels", "shift_labels"):
            filler = torch.full_like(filler, -100)
        elif key.endswith(ROLE):
            filler = torch.zeros_like(filler)
        padded[key] = torch.cat([value, filler])
    return padded
