"""The one interface the trainer calls an objective through: data -> batch -> loss and metrics.

An objective says how many units a batch holds (`count`: target tokens for the next-token loss,
pairs for preference losses) and, for one micro-batch, the loss summed over its units with the
sums of its metrics (`loss_sum`). The trainer divides by the units of the whole optimizer step over
every micro-batch and rank, so any split into micro-batches and ranks gives the same step, and
reports each metric as its sum over the step's units divided by their count (TRL's means over the
batch). A new objective is one module with one `Objective` subclass, chosen in `build_objective`.
"""

from __future__ import annotations

import torch


class Objective:
    """What one training step optimises. `metrics` names the per-unit means it reports."""

    name = "objective"
    unit = "tokens"  # what `count` counts, logged under this name when it is not the target tokens
    metrics: tuple[str, ...] = ()
    shown: tuple[str, ...] | None = None  # the metrics the console line shows (None: the third and fourth)
    runs_own_step = False  # True: `run_step` makes the whole optimizer step (grpo: rollouts, then updates)

    def close(self) -> None:
        """Release what the objective holds beyond the run's end (grpo: its rollout engines)."""

    def count(self, batch: dict) -> int:
        """Units of `batch` the loss is a mean over."""
        raise NotImplementedError

    def begin_step(self, batches: list[dict]) -> None:
        """Called with this rank's micro-batches of a step (or of an evaluation) before their first
        `loss_sum`, on every rank: for a term that is a mean over other units than `count`'s, whose
        step-wide count it gathers (a collective). Nothing by default."""

    def loss_sum(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss summed over the batch's units (differentiable, fp32) and the sums of `metrics`
        over them (detached, a float64 vector on the host; None without metrics)."""
        raise NotImplementedError

    def stage_batch(self, batch: dict) -> dict:
        """Under pipeline parallelism: the batch the pipeline runs, whose labels give the last
        stage's targets (the batch itself by default)."""
        return batch

    def stage_inputs(self, model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Under pipeline parallelism: per-row tensors the last stage's `stage_loss_sum` needs
        besides the targets (they are split with the rows into pipeline micro-batches), computed
        on every rank before the micro-batch enters the pipeline (a reference's log-probs)."""
        return {}

    def stage_loss_sum(self, lm: torch.nn.Module, call, targets: torch.Tensor, **inputs):
        """`loss_sum` on a pipeline's last stage, for its share of the rows: `call()` runs the
        causal LM's forward (`logprobs.through_head` stands in for its head), `targets` are the
        rows' aligned next-token targets, `inputs` this share of `stage_inputs`."""
        raise NotImplementedError(f"the {self.name} objective does not run under pipeline "
                                  "parallelism")

    def describe(self) -> str:
        return self.name
