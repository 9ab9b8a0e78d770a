"""The next-token loss (`train.objective=sft`): cross-entropy summed over target tokens, through the
head a chunk at a time (`logprobs.LinearCrossEntropy`)."""

from __future__ import annotations

import torch

from .base import Objective
from .logprobs import DEFAULT_LOSS_CHUNK_TOKENS, IGNORE_INDEX, aligned_targets, chunked_loss_sum, forward_inputs


class SFT(Objective):
    name = "sft"

    def __init__(self, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS):
        self.chunk_tokens = chunk_tokens

    def count(self, batch: dict) -> int:
        return int((target_slice(batch) != IGNORE_INDEX).sum())

    def loss_sum(self, model: torch.nn.Module, batch: dict):
        return causal_lm_loss_sum(model, batch, self.chunk_tokens), None

    def stage_loss_sum(self, lm, call, targets: torch.Tensor, **inputs):
        if self.chunk_tokens > 0:
            summed = chunked_loss_sum(lm, {}, targets, self.chunk_tokens, call=call)
            if summed is not None:
                return summed, None
        return token_loss_sum(call().logits, targets), None


def target_slice(batch: dict) -> torch.Tensor:
    """The next-token targets of every position that has one."""
    return batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS):
    """Sum of the next-token cross-entropy over the batch's target tokens, in fp32; the logits of
    `chunk_tokens` tokens at a time where the model allows (0: all at once)."""
    inputs, targets = forward_inputs(model, batch), aligned_targets(batch)
    if chunk_tokens > 0:
        loss = chunked_loss_sum(model, inputs, targets, chunk_tokens)
        if loss is not None:
            return loss
    return token_loss_sum(model(**inputs).logits, targets)  # whole: unsliced logits, no copy


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of each position's logits against its target (already aligned), in fp32."""
    logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.to(logits.device).reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
