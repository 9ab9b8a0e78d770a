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
    runs_own_step = False  # True: `run_step` makes the whole optimizer step (grpo: rollouts, then updates)

    def shown(self, metrics: dict) -> tuple[str, ...]:
        """The metrics the console's step line shows besides the loss and throughput."""
        return tuple(metrics)[2:4]

    def count(self, batch: dict) -> int:
        """Units of `batch` the loss is a mean over."""
        raise NotImplementedError

    def loss_sum(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss summed over the batch's units (differentiable, fp32) and the sums of `metrics`
        over them (detached, a float64 vector on the host; None without metrics)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name
