"""Outcome advantages from one scalar reward per completion, with verl's semantics.

Completions of one prompt sit next to each other: `group_size` (an int, every group that size, or
a list of the sizes of consecutive groups). The results are per completion (`[n]`); a
per-token advantage is `advantages[:, None] * response_mask`, which is what verl's
`compute_grpo_outcome_advantage` / `compute_rloo_outcome_advantage` return.
"""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size) -> list[torch.Tensor]:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one value per completion, got shape {tuple(rewards.shape)}")
    sizes = [group_size] * (len(rewards) // group_size) if isinstance(group_size, int) \
        else [int(size) for size in group_size]
    if any(size < 1 for size in sizes) or sum(sizes) != len(rewards):
        raise ValueError(f"group_size={group_size} does not split {len(rewards)} rewards into groups")
    return list(torch.split(rewards, sizes))


def group_advantages(rewards: torch.Tensor, group_size, norm_by_std: bool = True,
                     epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's unbiased standard deviation
    plus `epsilon` (`norm_by_std=False`: not divided, Dr. GRPO). A group of one has mean 0 and
    standard deviation 1, so it keeps its reward (divided by 1 + epsilon), as verl."""
    out = []
    with torch.no_grad():
        for group in _groups(rewards, group_size):
            if len(group) == 1:
                mean, std = torch.zeros_like(group), torch.ones_like(group)
            else:
                mean, std = group.mean(), group.std()
            out.append((group - mean) / (std + epsilon) if norm_by_std else group - mean)
    return torch.cat(out)


def rloo_advantages(rewards: torch.Tensor, group_size) -> torch.Tensor:
    """RLOO: each reward minus the mean of the others in its group (written as verl computes it,
    `r * n / (n - 1) - mean * n / (n - 1)`); a group of one keeps its reward."""
    out = []
    with torch.no_grad():
        for group in _groups(rewards, group_size):
            n = len(group)
            out.append(group.clone() if n == 1 else group * n / (n - 1) - group.mean() * n / (n - 1))
    return torch.cat(out)
