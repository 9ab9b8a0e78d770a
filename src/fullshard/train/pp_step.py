"""The train step and evaluation of a model cut into pipeline stages (`fullshard.parallel.pp`).

The same arithmetic as `step.py`: the loss is summed over target tokens and divided by the
number of target tokens in the whole optimizer step, so any number of pipeline micro-batches
equals one big batch. Here the pipeline schedule runs each trainer micro-batch (cut into
`pp_microbatches`), the last stage computes the loss (chunked through the head, as without pp, where
the model allows: its forward is handed the targets), the two ends of a tied weight add up their
gradients, and the clip takes the norm over every stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..fsdp import reshard_all
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS, chunked_loss_sum
from ..parallel.pp import TARGETS, Pipeline, pipeline_of
from ..tensors import local_tensor
from .loss import NOT_MODEL_INPUTS, aligned_targets, global_target_count, sum_over_ranks, target_count, token_loss_sum
from .step import StepOutput


def stage_loss(chunk_tokens: int):
    """The last stage's loss: through the head `chunk_tokens` tokens at a time where the model
    allows (as `causal_lm_loss_sum`), else from its whole logits."""
    def loss(lm, call, targets: torch.Tensor) -> torch.Tensor:
        if chunk_tokens > 0:
            summed = chunked_loss_sum(lm, {}, targets, chunk_tokens, call=call)
            if summed is not None:
                return summed
        return token_loss_sum(call().logits, targets)

    return loss


def pipeline_train_step(strategy, model: torch.nn.Module, optimizer, scheduler, micro_batches: list[dict],
                        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> StepOutput:
    """`train_step` for a pipelined model: every micro-batch through the schedule, then one step."""
    if len(micro_batches) != strategy.accumulated_gradient:
        raise ValueError(f"got {len(micro_batches)} micro-batches, the accumulation window is "
                         f"{strategy.accumulated_gradient}")
    pipeline, dims = pipeline_of(model), strategy.parallel_dims
    tokens = global_target_count(micro_batches, repeats=dims.tp * dims.pp)  # every stage sees every batch
    scale = dims.dp_size * dims.cp / max(tokens, 1)  # FSDP then averages over dp x cp (see loss.py)
    scaler = strategy.scaler

    def loss_fn(summed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # the last stage made the sum
        loss = summed * scale
        return scaler.scale_loss(loss) if scaler is not None else loss

    pipeline.loss_fn = loss_fn
    pipeline.set_stage_loss(stage_loss(loss_chunk_tokens))
    losses = [loss for batch in micro_batches for loss in _run(pipeline, batch, train=True)]
    sum_tied_gradients(pipeline)
    tied = pipeline.tied_parameter()
    uncounted = [tied] if tied is not None and not pipeline.has_first else []  # counted once, on the first stage
    result = None
    for _ in micro_batches:
        result = strategy.optimizer_step(optimizer, model, scheduler, across=pipeline.pp_group, uncounted=uncounted)
    total = sum((loss.detach().to("cpu", torch.float64) for loss in losses), torch.zeros((), dtype=torch.float64))
    total /= scale * (scaler.scale if scaler is not None and scaler.enabled else 1.0)  # back to a sum over tokens
    return StepOutput(float(sum_over_ranks(total, repeats=dims.tp)) / max(tokens, 1), tokens, result)


@torch.no_grad()
def pipeline_evaluate(model: torch.nn.Module, batches: list[dict],
                      loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> float | None:
    """Mean loss per target token over every rank's eval batches, forward only through the pipeline."""
    if not batches:
        return None
    pipeline = pipeline_of(model)
    dims = pipeline.dims
    pipeline.loss_fn = lambda summed, targets: summed
    pipeline.set_stage_loss(stage_loss(loss_chunk_tokens))
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for batch in batches:
        total += sum(loss.to("cpu", torch.float64) for loss in _run(pipeline, _padded(batch, pipeline.microbatches),
                                                                     train=False))
        count += target_count(batch)
    for stage in pipeline.stages:
        reshard_all(stage)
    return float(sum_over_ranks(total, repeats=dims.tp) / sum_over_ranks(count, repeats=dims.tp * dims.pp))


def _run(pipeline: Pipeline, batch: dict, train: bool) -> list[torch.Tensor]:
    """One trainer micro-batch through the schedule: token ids into the first stage, targets to the
    last, the other model inputs (position ids, masks) to every stage. Returns the loss of each
    pipeline micro-batch on the last stage (none elsewhere). The schedule's own list, not the loss
    function, says what the losses were: it also calls the loss function once to infer shapes."""
    device = pipeline.device
    args = (batch["input_ids"].to(device),) if pipeline.has_first else ()
    kwargs = {k: v.to(device) for k, v in batch.items()
              if k not in NOT_MODEL_INPUTS and k != "input_ids" and isinstance(v, torch.Tensor)}
    target = aligned_targets(batch).to(device) if pipeline.has_last else None
    if target is not None:
        kwargs[TARGETS] = target  # the last stage computes the loss inside its model call
    schedule = pipeline.schedule()
    losses: list[torch.Tensor] = []
    (schedule.step if train else schedule.eval)(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    return losses


def sum_tied_gradients(pipeline: Pipeline) -> None:
    """Add the gradients of a tied embedding / head held by the first and last stages, so both
    ends take the same step as the one tensor of the unsplit model."""
    tied = pipeline.tied_parameter()
    if tied is None or pipeline.tie_group is None or (pipeline.has_first and pipeline.has_last):
        return
    if tied.grad is None:
        tied.grad = torch.zeros_like(tied)
    dist.all_reduce(local_tensor(tied.grad), group=pipeline.tie_group)


def _padded(batch: dict, multiple: int) -> dict:
    """`batch` with rows repeated until the pipeline's micro-batches split it evenly, the added rows
    carrying no targets (an eval batch can be smaller than a training one)."""
    rows = batch["input_ids"].shape[0]
    extra = -rows % multiple
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
        padded[key] = torch.cat([value, filler])
    return padded
