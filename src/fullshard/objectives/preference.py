"""Preference optimisation (`train.objective=dpo`): DPO and its family on pairs, TRL's losses and metrics.

A micro-batch holds whole pairs (`data.preference`: chosen then rejected, `pair_role` marking each
token's sequence, packed or one pair per row). The policy's per-token log-probs come from
`token_logprobs`' path (the head a chunk at a time); each sequence's log-prob is their sum over its
completion tokens, the reference's likewise under no gradient. The loss is summed over the pairs
and the trainer divides by the step's pairs over every rank: TRL's mean over the batch. The
formulas are TRL's `DPOTrainer._compute_loss` (sigmoid, hinge, ipo normalised by completion
length, robust) and SimPO's (CPO's `simpo`: length-normalised, no reference, a margin gamma).

Reference strategies (`preference.reference`): `model`, a frozen sharded copy of the starting
weights (no gradients, no optimizer state); `precompute`, their log-probs computed once before
training and cached (`precompute.py`); `adapter`, under LoRA the same model with its adapters
disabled; `none`, reference-free losses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..data.preference import ROLE
from .base import Objective
from .logprobs import DEFAULT_LOSS_CHUNK_TOKENS, IGNORE_INDEX, aligned_targets, batch_logprobs, stage_logprobs

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_index(batch: dict) -> tuple[torch.Tensor, int]:
    """For each position, the sequence its target belongs to (-1: padding), aligned with
    `aligned_targets`, and the number of sequences: 2k is pair k's chosen, 2k + 1 its rejected."""
    role, positions = batch[ROLE], batch["position_ids"]
    starts = (positions == 0) & (role > 0)
    seq = (starts.flatten().cumsum(0) - 1).view_as(role)
    seq = torch.where(role > 0, seq, -1)
    return F.pad(seq[:, 1:], (0, 1), value=-1), int(starts.sum())


def sequence_sums(values: torch.Tensor, seq: torch.Tensor, count: int) -> torch.Tensor:
    """Per sequence, the sum of `values` over its positions."""
    keep = seq >= 0
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq[keep].to(values.device), values[keep])


def pair_count(batch: dict) -> int:
    role, positions = batch[ROLE], batch["position_ids"]
    return int(((positions == 0) & (role > 0)).sum()) // 2


def preference_losses(loss_type: str, beta: float, chosen, rejected, ref_chosen, ref_rejected, chosen_len,
                      rejected_len, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> torch.Tensor:
    """Each pair's loss, as TRL computes it (sequence log-probs summed over completion tokens)."""
    if loss_type == "simpo":
        delta = chosen / chosen_len - rejected / rejected_len - simpo_gamma / beta
        return (-F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        normalised = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        return (normalised - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    raise ValueError(f"unknown preference loss {loss_type!r}")


class Preference(Objective):
    """The preference section's loss over the pairs of each micro-batch."""

    name = "dpo"
    unit = "pairs"
    metrics = METRICS

    def __init__(self, section, reference, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS):
        self.section, self.reference, self.chunk_tokens = section, reference, chunk_tokens

    @property
    def reference_free(self) -> bool:
        return self.section.loss_type == "simpo"

    def count(self, batch: dict) -> int:
        return pair_count(batch)

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's summed completion log-prob and its completion length."""
        seq, count = sequence_index(batch)
        logps = batch_logprobs(model, batch, self.chunk_tokens)[..., 0]
        valid = (aligned_targets(batch) != IGNORE_INDEX).to(logps.device)
        return sequence_sums(logps, seq, count), sequence_sums(valid.to(logps.dtype), seq, count)

    def loss_sum(self, model, batch: dict):
        logps, lengths = self.sequence_logps(model, batch)
        ref = None if self.reference_free else self.reference(model, batch, self).to(logps.device)
        return self.pair_losses(logps, lengths, ref)

    def pair_losses(self, logps: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor | None):
        """The pairs' loss sum and metric sums from each sequence's log-prob, completion length and
        reference log-prob (None: reference-free), chosen and rejected alternating."""
        s = self.section
        chosen, rejected = logps[0::2], logps[1::2]
        if ref is None:
            ref_chosen = ref_rejected = torch.zeros_like(chosen)
        else:
            ref_chosen, ref_rejected = ref[0::2], ref[1::2]
        losses = preference_losses(s.loss_type, s.beta, chosen, rejected, ref_chosen, ref_rejected, lengths[0::2],
                                   lengths[1::2], s.label_smoothing, s.simpo_gamma)
        with torch.no_grad():
            if self.reference_free:  # SimPO's implicit rewards: beta times the mean log-prob
                chosen_r, rejected_r = s.beta * chosen / lengths[0::2], s.beta * rejected / lengths[1::2]
            else:
                chosen_r, rejected_r = s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected)
            sums = torch.stack([chosen_r.sum(), rejected_r.sum(), (chosen_r > rejected_r).float().sum(),
                                (chosen_r - rejected_r).sum(), chosen.sum(), rejected.sum()])
        return losses.sum(), sums.detach().to("cpu", torch.float64)

    # under pipeline parallelism: the reference first, on every rank; the policy's log-probs and the
    # loss on the last stage, for the rows of each pipeline micro-batch (whole pairs: a row holds them)

    def stage_inputs(self, model, batch: dict) -> dict:
        """The rows' pair roles and positions (which sequence each target belongs to), and each
        sequence's reference log-prob in a [rows, most sequences per row] table, row by row."""
        inputs = {ROLE: batch[ROLE], "positions": batch["position_ids"]}
        if not self.reference_free:
            with torch.no_grad():
                ref = self.reference(model, batch, self).float().cpu()
            starts = sequence_starts(batch)
            table = torch.zeros(len(starts), max(int(starts.max()), 1), dtype=torch.float32)
            table[torch.arange(table.shape[1])[None] < starts[:, None]] = ref
            inputs["reference"] = table
        return inputs

    def stage_loss_sum(self, lm, call, targets: torch.Tensor, **inputs):
        batch = {ROLE: inputs[ROLE], "position_ids": inputs["positions"]}
        seq, count = sequence_index(batch)
        logps = stage_logprobs(lm, call, targets, self.chunk_tokens)[..., 0]
        valid = (targets != IGNORE_INDEX).to(logps.device)
        sums = sequence_sums(logps, seq, count), sequence_sums(valid.to(logps.dtype), seq, count)
        ref = None
        if "reference" in inputs:
            table = inputs["reference"]
            ref = table[torch.arange(table.shape[1], device=table.device)[None]
                        < sequence_starts(batch).to(table.device)[:, None]].to(logps.device)
        return self.pair_losses(*sums, ref)


def sequence_starts(batch: dict) -> torch.Tensor:
    """Per row, how many sequences start in it."""
    return ((batch["position_ids"] == 0) & (batch[ROLE] > 0)).sum(1)


class ModelReference:
    """A frozen sharded copy of the starting weights: its log-probs under no gradient."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval().requires_grad_(False)

    def __call__(self, policy, batch: dict, objective: Preference) -> torch.Tensor:
        with torch.no_grad():
            return objective.sequence_logps(self.model, batch)[0]


class AdapterReference:
    """Under LoRA: the policy itself with its adapters disabled (PEFT's `disable_adapter`)."""

    def __call__(self, policy, batch: dict, objective: Preference) -> torch.Tensor:
        disable = getattr(policy, "disable_adapter", None)
        with torch.no_grad(), (disable() if disable is not None else contextlib.nullcontext()):
            return objective.sequence_logps(policy, batch)[0]
