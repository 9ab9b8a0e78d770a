"""The causal-LM loss normalised by the global number of target tokens.

A mean per micro-batch weighs a token in a short (padded) micro-batch more than one in a full
one, so k micro-batches would not equal one batch k times the size. Summing the token losses and
dividing by the count of target tokens in the whole optimizer step, over every micro-batch and
every rank, makes them equal. FSDP averages gradients over the data-parallel ranks (dp x cp under
context parallelism), so each rank's sum is multiplied by that size to undo the average.

Under context parallelism a micro-batch is this rank's part of each sequence, its labels already
shifted over the whole sequence (`shift_labels`, from `fullshard.parallel.cp.context_parallel_batch`):
its logits are compared unshifted. Tensor-parallel ranks of one data rank hold the same batch, so
sums over the world count it tp times; `repeats` divides that out.

The loss goes through the output head a chunk of tokens at a time (`chunked_loss.py`) unless
`chunk_tokens` is 0 or the model's head cannot be stood in for; the two give the same loss and
gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..objectives.logprobs import (  # noqa: F401
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    NOT_MODEL_INPUTS,
    aligned_targets,
    chunked_loss_sum,
    forward_inputs,
)
from ..objectives.sft import causal_lm_loss_sum, token_loss_sum  # noqa: F401


def _targets(batch: dict) -> torch.Tensor:
    """The next-token targets of every position that has one: `shift_labels` as given, or `labels`
    shifted by one (the last position predicts nothing)."""
    return batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]


def target_count(batch: dict) -> int:
    """Tokens that contribute to the loss: the targets minus the ignored ones."""
    return int((_targets(batch) != IGNORE_INDEX).sum())


def sum_over_ranks(value: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """`value` summed over every rank (a collective), each distinct value counted once when every
    one appears on `repeats` ranks (the tp ranks of one data rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value // repeats if not value.is_floating_point() else value / repeats


def global_target_count(micro_batches: list[dict], repeats: int = 1) -> int:
    """Target tokens of one optimizer step across all micro-batches and all data ranks (a collective)."""
    return PendingTargetCount(micro_batches, repeats).wait()


class PendingTargetCount:
    """Target tokens of one optimizer step across all micro-batches and all data ranks, summed by an
    all_reduce started at once and waited for only when the count is needed (before the first
    backward), so it travels while the first forward runs."""

    def __init__(self, micro_batches: list[dict], repeats: int = 1, count=None):
        count = count or target_count  # the objective's units: target tokens, or pairs
        self.value = torch.tensor(sum(count(b) for b in micro_batches), dtype=torch.int64)
        self.repeats = repeats
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.work = dist.all_reduce(self.value, async_op=True) if distributed else None

    def wait(self) -> int:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return int(self.value) // self.repeats


def normalized_loss(loss_sum: torch.Tensor, global_tokens: int, dp_size: int) -> torch.Tensor:
    """The loss to backpropagate so that gradients, after FSDP's average over `dp_size` ranks (dp x cp),
    are those of the mean over `global_tokens`."""
    return loss_sum * (dp_size / max(global_tokens, 1))
