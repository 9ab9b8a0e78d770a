"""The policy update on a pipelined model: the last stage computes the loss inside the schedule.

Under pipeline parallelism the log-probs exist only on the last stage, so the loss is computed
there, inside torch's schedule, whose backward then runs through every stage. Each token-budget
micro-batch enters the pipeline as one batch (cut by rows into pipeline micro-batches); the last
stage takes its rows' log-probs and entropies through the head in chunks and the same
`update.loss_terms` as without pp, normalised by the same global counts, so the gradients add up
to one process's. torch's stages size their buffers on a schedule's first step, and sizing them
anew drops the gradients accumulated so far, so every micro-batch of an update is padded to one
shape agreed over the world (the most rows of any micro-batch, rounded up to the pipeline
micro-batches, by the longest sequence): the rows and columns added hold no response token.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..objectives.logprobs import stage_logprobs
from ..objectives.pipeline import run_pipeline, sum_tied_gradients
from ..parallel.pp import pipeline_of
from .terms import SUMMED, Rollouts, UpdateConfig, loss_terms, term_sums


def pipelined_sums(
    model, rollouts: Rollouts, batches: list[list[int]], config: UpdateConfig, counts, dp_size: int
) -> tuple[torch.Tensor, dict]:
    """Every micro-batch's forward and backward through the pipeline; returns the terms' sums
    (counted once per pp rank, as `policy_update`'s `repeats` expects) and the clip's arguments
    (the norm over every stage, a tied weight's second end left out)."""

    if rollouts.model_inputs:
        raise ConfigError(
            "policy_update on a pipelined model takes token ids only: image inputs are not split "
            "over pipeline stages yet"
        )
    pipeline = pipeline_of(model)
    rows, width = _agreed_shape(rollouts, batches, pipeline.microbatches)
    recorded, norm = [], {}

    def stage(lm, call, targets, response_mask, advantages, old=None, ref=None):
        out = stage_logprobs(
            lm, call, targets, config.chunk_tokens, config.temperature, entropy=True
        )[:, :-1]
        part = SimpleNamespace(
            response_mask=response_mask[:, :-1],
            advantages=advantages[:, :-1],
            old_logprobs=None if old is None else old[:, :-1],
            ref_logprobs=None if ref is None else ref[:, :-1],
        )
        loss, terms = loss_terms(
            out[..., 0], out[..., 1], part, config, counts, dp_size, norm.get("width")
        )
        recorded.append(term_sums(terms))
        return loss

    pipeline.loss_fn = lambda loss, targets: loss
    pipeline.set_stage_loss(stage)
    sums = torch.zeros(len(SUMMED), dtype=torch.float64)
    for index in batches:
        batch, inputs, trimmed = _micro_batch(rollouts, index, rows, width)
        if config.agg == "seq-mean-token-sum-norm" and config.loss_scale_factor is None:
            norm["width"] = trimmed - 1  # its response width without the padding added here
        recorded.clear()
        losses = run_pipeline(pipeline, batch, train=True, loss_inputs=inputs)
        if losses:
            sums += torch.stack(recorded[-len(losses):]).sum(0)
    sum_tied_gradients(pipeline)
    tied = pipeline.tied_parameter()
    step = {
        "across": pipeline.pp_group,
        "uncounted": [tied] if tied is not None and not pipeline.has_first else [],
    }
    return sums * pipeline.dims.pp, step


def _agreed_shape(rollouts: Rollouts, batches: list[list[int]], multiple: int) -> tuple[int, int]:
    shape = torch.tensor(
        [max(len(b) for b in batches), max(rollouts.lengths(), default=2)], dtype=torch.int64
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    return -int(shape[0]) // multiple * -multiple, max(int(shape[1]), 2)


def _micro_batch(
    rollouts: Rollouts, index: list[int], rows: int, width: int
) -> tuple[dict, dict, int]:
    """The rows `index` padded to `rows` x `width`: the model's inputs, the last stage's per-row
    tensors (over the `width` aligned positions), and the width the rows had. Added rows repeat a
    sequence (so their attention has keys) with no response token; added columns are masked."""
    part = rollouts.rows(index) if index else None
    n = len(index)
    ids = torch.ones(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    attention[:, 0] = 1
    response, advantages = torch.zeros(rows, width), torch.zeros(rows, width)
    old = torch.zeros(rows, width) if rollouts.old_logprobs is not None else None
    ref = torch.zeros(rows, width) if rollouts.ref_logprobs is not None else None
    trimmed = 2
    if part is not None:
        trimmed = part.input_ids.shape[1]
        ids[:n, :trimmed] = part.input_ids.cpu()
        attention[:n, :trimmed] = part.attention_mask.cpu()
        ids[n:], attention[n:] = ids[0], attention[0]
        response[:n, : trimmed - 1] = part.response_mask.cpu().float()
        adv = part.advantages.cpu().float()
        advantages[:n, : trimmed - 1] = (
            adv[:, None].expand(n, trimmed - 1) if adv.dim() == 1 else adv
        )
        for full, given in ((old, part.old_logprobs), (ref, part.ref_logprobs)):
            if full is not None:
                full[:n, : trimmed - 1] = given.cpu().float()
    inputs = {"response_mask": response, "advantages": advantages}
    inputs.update({k: v for k, v in (("old", old), ("ref", ref)) if v is not None})
    batch = {"input_ids": ids, "attention_mask": attention, "labels": ids}
    return batch, inputs, trimmed
