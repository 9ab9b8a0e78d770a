"""The causal-LM loss normalised by the global number of target tokens.

A mean per micro-batch weighs a token in a short (padded) micro-batch more than one in a full
one, so k micro-batches would not equal one batch k times the size. Summing the token losses and
dividing by the count of target tokens in the whole optimizer step, over every micro-batch and
every rank, makes them equal. FSDP averages gradients over the data-parallel ranks, so each rank's
sum is multiplied by the data-parallel size to undo that average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def target_count(batch: dict) -> int:
    """Tokens that contribute to the loss: labels shifted by one, minus the ignored ones."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def global_target_count(micro_batches: list[dict]) -> int:
    """Target tokens of one optimizer step across all micro-batches and all ranks (a collective)."""
    count = torch.tensor(sum(target_count(b) for b in micro_batches), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)
    return int(count)


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Sum of the next-token cross-entropy over the batch's target tokens, in fp32."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    shifted = logits[:, :-1, :].float()
    labels = batch["labels"][:, 1:].to(shifted.device)
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def normalized_loss(loss_sum: torch.Tensor, global_tokens: int, dp_size: int) -> torch.Tensor:
    """The loss to backpropagate so that gradients, after FSDP's average over `dp_size` ranks,
    are those of the mean over `global_tokens`."""
    return loss_sum * (dp_size / max(global_tokens, 1))
