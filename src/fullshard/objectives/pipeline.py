"""Running a batch through a pipelined model's schedule (`fullshard.parallel.pp`), for every
objective: token ids into the first stage, targets and the loss's other inputs to the last, which
computes the loss (or, forward only, per-token outputs such as log-probs) inside its model call.

torch's stages size their buffers from the first inputs a schedule sees, so every call here pads
its rows and columns to the largest over the world (rows to a multiple of the pipeline
micro-batches; the added rows and columns carry no targets) and keys the schedule by that shape.
The two ends of a tied embedding / head add up their gradients after the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.preference import ROLE
from ..data.rows import NOT_MODEL_INPUTS, aligned_targets
from ..parallel.pp import LOSS_INPUTS, TARGETS, Pipeline, pipeline_of
from ..tensors import local_tensor


@torch.no_grad()
def pipeline_outputs(model: torch.nn.Module, batch: dict, stage, channels: int = 2) -> torch.Tensor:
    """What `stage(lm, call, targets, **inputs)` makes on the last stage of a pipelined model from
    `batch` ([rows, seq, channels]: per-token log-probs and entropies for `batch_logprobs`), in a
    forward-only pass, broadcast to every rank of the pipeline."""
    pipeline = pipeline_of(model)
    rows, width = batch["input_ids"].shape
    pipeline.loss_fn = lambda output, targets: output.new_zeros(())
    pipeline.set_stage_loss(stage)
    padded = agreed_shape(batch, pipeline.microbatches)
    out = run_pipeline(pipeline, padded, train=False, outputs=True)
    if out is None:  # not the last stage: the shape the last one sends
        out = torch.zeros(*padded["input_ids"].shape, channels, dtype=torch.float32, device=pipeline.device)
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
