"""TRL's trainers as the tests' peer: in file order, every step's raw loss recorded."""

from __future__ import annotations


def in_order(trainer_cls):
    """`trainer_cls` (TRL's `DPOTrainer`, `RewardTrainer`, ...) reading its records in file order (a
    sequential sampler, not TRL's shuffling) and keeping each step's raw loss in `losses` (TRL logs
    4 digits)."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_cls):
        losses: list

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            self.losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    return InOrder
