"""Preference optimisation (`train.objective=dpo`): DPO and its family on pairs, TRL's losses and metrics.

A micro-batch holds whole pairs (`data.preference`: chosen then rejected, `pair_role` marking each
token's sequence, packed or one pair per row). The policy's per-token log-probs come from
`token_logprobs`' path (the head a chunk at a time); each sequence's log-prob is their sum over its
completion tokens, the reference's likewise under no gradient. The loss is summed over the pairs
and the trainer divides by the step's pairs over every rank: TRL's mean over the batch. The
formulas are TRL's `DPOTrainer._compute_loss` (sigmoid, hinge, ipo normalised by completion
length, robust), SimPO's (CPO's `simpo`: length-normalised, no reference, a margin gamma) and
ORPO's (`ORPOTrainer`: no reference, the odds ratio of the completions' mean log-probs).

Two losses add a next-token term on the chosen sequence, a mean over its tokens in the step, not
over pairs: ORPO's (prompt and completion, as `ORPOTrainer` computes it) and `sft_weight`'s (RPO:
the completion, TRL's `loss_type=[..., "sft"]` weighted). `begin_step` counts the step's pairs and
those tokens over every rank, and each micro-batch's term is scaled by their ratio, so that the
trainer's division by the pairs leaves the token mean, whatever the split.

Reference strategies (`preference.reference`): `model`, a frozen sharded copy of the starting
weights (no gradients, no optimizer state); `precompute`, their log-probs computed once before
training and cached (`precompute.py`); `adapter`, under LoRA the same model with its adapters
disabled; `none`, reference-free losses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.preference import CHOSEN, ROLE
from ..fsdp import reshard_all
from .base import Objective
from .logprobs import DEFAULT_LOSS_CHUNK_TOKENS, IGNORE_INDEX, aligned_targets, batch_logprobs, stage_logprobs

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
REFERENCE_FREE = ("simpo", "orpo")


def text_positions(batch: dict) -> torch.Tensor:
    """The rows' text positions (restarting at each sequence): an mRoPE model's rows carry its rope
    rows beside them (`data.rows`: [rows, 4, tokens], the text positions first)."""
    positions = batch["position_ids"]
    return positions[:, 0] if positions.ndim == 3 else positions


CP_SEQUENCE, CP_SEQUENCES = "pair_sequence", "pair_sequences"  # `context_parallel_pairs`' columns


def context_parallel_pairs(batch: dict, part: dict, cp_rank: int, cp_size: int) -> dict:
    """`part` (this cp rank's share of `batch`, `parallel.cp.context_parallel_batch`) with what the
    pair losses need of the whole rows: each aligned position's sequence (numbered before the
    split), the number of sequences, and the pair roles of its own positions."""
    seq, count = sequence_index(batch)
    width = part["input_ids"].shape[1]
    piece = slice(cp_rank * width, (cp_rank + 1) * width)
    pad = width * cp_size - seq.shape[1]
    return {**part, CP_SEQUENCE: F.pad(seq, (0, pad), value=-1)[:, piece].contiguous(),
            CP_SEQUENCES: torch.tensor(count), ROLE: F.pad(batch[ROLE], (0, pad))[:, piece].contiguous()}


def sequence_index(batch: dict) -> tuple[torch.Tensor, int]:
    """For each position, the sequence its target belongs to (-1: padding), aligned with
    `aligned_targets`, and the number of sequences: 2k is pair k's chosen, 2k + 1 its rejected."""
    if CP_SEQUENCE in batch:  # a cp rank's part: numbered over the whole rows before the split
        return batch[CP_SEQUENCE], int(batch[CP_SEQUENCES])
    role, positions = batch[ROLE], text_positions(batch)
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
    """The pairs whose chosen sequence starts in `batch` (under cp: in this rank's part)."""
    role, positions = batch[ROLE], text_positions(batch)
    return int(((positions == 0) & (role == CHOSEN)).sum())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (TRL's ORPO helper, branching at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_losses(beta: float, chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """ORPO's odds-ratio term per pair, `-beta log sigma(log odds(chosen) - log odds(rejected))`, on the
    completions' mean log-probs (TRL's `ORPOTrainer.odds_ratio_loss`, negated: the loss adds it)."""
    chosen_mean, rejected_mean = chosen_mean.float(), rejected_mean.float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return -beta * F.logsigmoid(log_odds)


def preference_losses(loss_type: str, beta: float, chosen, rejected, ref_chosen, ref_rejected, chosen_len,
                      rejected_len, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> torch.Tensor:
    """Each pair's loss, as TRL computes it (sequence log-probs summed over completion tokens)."""
    if loss_type == "orpo":
        return odds_ratio_losses(beta, chosen / chosen_len, rejected / rejected_len)
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


def nll_positions(batch: dict, whole_sequence: bool) -> torch.Tensor:
    """Aligned with `aligned_targets`: the positions whose target is a chosen token of the NLL term,
    every one after the sequence's first (`whole_sequence`, ORPO) or the completion's (RPO)."""
    role = batch[ROLE]
    if whole_sequence:
        keep = (role == CHOSEN) & (text_positions(batch) > 0)
    else:
        keep = (role == CHOSEN) & (batch["labels"] != IGNORE_INDEX)
    return F.pad(keep[:, 1:], (0, 1), value=False)


class Preference(Objective):
    """The preference section's loss over the pairs of each micro-batch."""

    name = "dpo"
    unit = "pairs"

    def __init__(self, section, reference, chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS):
        self.section, self.reference, self.chunk_tokens = section, reference, chunk_tokens
        self.cp_group = None  # under context parallelism: the group a sequence's parts are summed over
        orpo = section.loss_type == "orpo"
        self.nll_weight = 1.0 if orpo else section.sft_weight  # ORPO's term has weight one
        self.nll_whole_sequence = orpo
        self.nll_scale: float | None = None  # the step's pairs over its NLL tokens (`begin_step`)
        self.metrics = METRICS + (("nll_loss",) if self.nll_weight else ())

    @property
    def reference_free(self) -> bool:
        return self.section.loss_type in REFERENCE_FREE

    def count(self, batch: dict) -> int:
        return pair_count(batch)

    def begin_step(self, batches: list[dict]) -> None:
        if not self.nll_weight:
            return
        counts = torch.tensor([sum(pair_count(b) for b in batches),
                               sum(int(nll_positions(b, self.nll_whole_sequence).sum()) for b in batches)],
                              dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # tp ranks count their batch again: the ratio is unchanged
        self.nll_scale = float(counts[0] / counts[1].clamp(min=1))

    def token_logps(self, model, batch: dict) -> torch.Tensor:
        """Each position's log-prob of its target: the completions', and the chosen prompt's for ORPO."""
        return batch_logprobs(model, self.scored(batch), self.chunk_tokens)[..., 0]

    def scored(self, batch: dict) -> dict:
        """`batch` with the labels its log-probs are taken of (ORPO's NLL scores the chosen
        prompt too)."""
        if self.nll_weight and self.nll_whole_sequence:
            chosen = (batch[ROLE] == CHOSEN) & (text_positions(batch) > 0)
            batch = {**batch, "labels": torch.where(chosen, batch["input_ids"], batch["labels"])}
        return batch

    def completion_sums(self, logps: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's summed completion log-prob and its completion length."""
        seq, count = sequence_index(batch)
        valid = (aligned_targets(batch) != IGNORE_INDEX).to(logps.device)
        sums = sequence_sums(logps * valid, seq, count), sequence_sums(valid.to(logps.dtype), seq, count)
        if CP_SEQUENCE in batch:  # each cp rank holds a part of every sequence: the whole sums
            from torch.distributed.nn.functional import all_reduce

            sums = tuple(all_reduce(s, group=self.cp_group) for s in sums)
        return sums

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's summed completion log-prob and its completion length."""
        return self.completion_sums(batch_logprobs(model, batch, self.chunk_tokens)[..., 0], batch)

    def loss_sum(self, model, batch: dict):
        ref = None if self.reference_free else self.reference(model, batch, self)
        loss, sums = self.pair_losses(self.token_logps(model, batch), batch, ref)
        if CP_SEQUENCE in batch:
            # every cp rank has the whole pairs' loss: each counts 1 / cp of it (and of its gradient,
            # which the all-reduce's backward sums over the cp ranks onto each one's own part)
            cp = dist.get_world_size(self.cp_group)
            loss, sums = loss / cp, sums / cp
        return loss, sums

    def pair_losses(self, token_logps: torch.Tensor, batch: dict, ref: torch.Tensor | None):
        """The pairs' loss sum and metric sums from each position's log-prob (`token_logps`), the
        rows' roles, positions and labels, and each sequence's reference log-prob (None:
        reference-free), chosen and rejected alternating."""
        s = self.section
        logps, lengths = self.completion_sums(token_logps, batch)
        chosen, rejected = logps[0::2], logps[1::2]
        if ref is None:
            ref_chosen = ref_rejected = torch.zeros_like(chosen)
        else:
            ref = ref.to(chosen.device)
            ref_chosen, ref_rejected = ref[0::2], ref[1::2]
        losses = preference_losses(s.loss_type, s.beta, chosen, rejected, ref_chosen, ref_rejected, lengths[0::2],
                                   lengths[1::2], s.label_smoothing, s.simpo_gamma)
        loss = losses.sum()
        nll = None
        if self.nll_weight:
            if self.nll_scale is None:
                raise RuntimeError("the NLL term is a mean over the step's tokens: call begin_step first")
            keep = nll_positions(batch, self.nll_whole_sequence).to(token_logps.device)
            nll = -(token_logps * keep).sum() * self.nll_scale
            loss = loss + self.nll_weight * nll
        with torch.no_grad():
            if self.reference_free:  # SimPO's and ORPO's implicit rewards: beta times the mean log-prob
                chosen_r, rejected_r = s.beta * chosen / lengths[0::2], s.beta * rejected / lengths[1::2]
            else:
                chosen_r, rejected_r = s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected)
            sums = [chosen_r.sum(), rejected_r.sum(), (chosen_r > rejected_r).float().sum(),
                    (chosen_r - rejected_r).sum(), chosen.sum(), rejected.sum()]
            sums = torch.stack(sums + ([nll] if nll is not None else []))
        return loss, sums.detach().to("cpu", torch.float64)

    # under pipeline parallelism: the reference first, on every rank; the policy's log-probs and
    # the loss on the last stage, per pipeline micro-batch (its rows hold whole pairs)

    def stage_batch(self, batch: dict) -> dict:
        return self.scored(batch)

    def stage_inputs(self, model, batch: dict) -> dict:
        """The rows' pair roles, positions and labels (which sequence and completion each target
        belongs to), and each sequence's reference log-prob in a [rows, most sequences per row]
        table, row by row."""
        inputs = {ROLE: batch[ROLE], "positions": batch["position_ids"], "labels": batch["labels"]}
        if not self.reference_free:
            with torch.no_grad():
                ref = self.reference(model, batch, self).float().cpu()
            starts = sequence_starts(batch)
            table = torch.zeros(len(starts), max(int(starts.max()), 1), dtype=torch.float32)
            table[torch.arange(table.shape[1])[None] < starts[:, None]] = ref
            inputs["reference"] = table
        return inputs

    def stage_loss_sum(self, lm, call, targets: torch.Tensor, **inputs):
        batch = {ROLE: inputs[ROLE], "position_ids": inputs["positions"],
                 "labels": inputs["labels"]}
        ref = None
        if "reference" in inputs:
            table = inputs["reference"]
            ref = table[torch.arange(table.shape[1], device=table.device)[None]
                        < sequence_starts(batch).to(table.device)[:, None]]
        logps = stage_logprobs(lm, call, targets, self.chunk_tokens)[..., 0]
        return self.pair_losses(logps, batch, ref)


def sequence_starts(batch: dict) -> torch.Tensor:
    """Per row, how many sequences start in it."""
    return ((batch["position_ids"] == 0) & (batch[ROLE] > 0)).sum(1)


class ModelReference:
    """A frozen sharded copy of the starting weights: its log-probs under no gradient."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval().requires_grad_(False)

    def __call__(self, policy, batch: dict, objective: Preference) -> torch.Tensor:
        with torch.no_grad():
            logps = objective.sequence_logps(self.model, batch)[0]
        reshard_all(self.model)  # a no-grad forward leaves the root unit gathered until the next one
        return logps


class AdapterReference:
    """Under LoRA: the policy itself with its adapters disabled (PEFT's `disable_adapter`)."""

    def __call__(self, policy, batch: dict, objective: Preference) -> torch.Tensor:
        disable = getattr(policy, "disable_adapter", None)
        with torch.no_grad(), (disable() if disable is not None else contextlib.nullcontext()):
            return objective.sequence_logps(policy, batch)[0]
