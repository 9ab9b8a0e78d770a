"""Policy losses, their aggregation and KL estimators, with verl's semantics.

`verl.trainer.ppo.core_algos` (verl 0.9) is the reference: the same clamps, the same edge cases and
the same aggregation modes, so a framework built on verl's functions can swap these in. The
argument order is fullshard's (the current policy first, as in `kl_penalty`); verl's policy
losses take `(old_log_prob, log_prob, ...)`.

Global aggregation: the loss of one micro-batch is normalised by counts over the whole
mini-batch (every micro-batch on every data-parallel rank: `global_tokens`, `global_sequences`,
from `fullshard.rl.global_counts`) and multiplied by `dp_size` to undo FSDP's average of the
gradients over the data-parallel ranks. The backward passes of every micro-batch on every rank
then add up to the gradient of the whole mini-batch's loss computed in one process, whatever the
split. Without the counts the micro-batch's own counts are used (one process, one micro-batch).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("ppo", "gspo", "cispo")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `values` where `mask` is set; a NaN outside the mask does not leak in."""
    kept = torch.where(mask.bool(), values, 0.0) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `values` where `mask` is set (0 for an empty mask)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", *,
              global_tokens=None, global_sequences=None, dp_size: int = 1,
              loss_scale_factor=None) -> torch.Tensor:
    """A `[batch, length]` matrix of per-token losses reduced to the scalar to backpropagate.

    `token-mean`: sum over tokens / `global_tokens`; `token-sum`: sum over tokens;
    `seq-mean-token-sum`: each sequence's token sum, summed / `global_sequences`;
    `seq-mean-token-mean`: each sequence's token mean, summed / `global_sequences`;
    `seq-mean-token-sum-norm`: `seq-mean-token-sum` / `loss_scale_factor` (default: the padded
    width `mask.shape[-1]`, as verl, so set it to a constant when micro-batches differ in width).
    Sequences without a response token never count. Every mode is multiplied by `dp_size`.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r}: expected one of {', '.join(AGG_MODES)}")
    if dp_size > 1 and agg == "token-mean" and global_tokens is None:
        raise ValueError("agg='token-mean' with dp_size > 1 needs global_tokens")
    if dp_size > 1 and agg.startswith("seq-mean") and global_sequences is None:
        raise ValueError(f"agg={agg!r} with dp_size > 1 needs global_sequences")
    if agg == "token-mean":
        tokens = mask.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / tokens * dp_size
    if agg == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    lengths = mask.sum(dim=-1)
    seq_losses = (loss_mat * mask).sum(dim=-1)
    if agg == "seq-mean-token-mean":
        seq_losses = seq_losses / (lengths + 1e-8)
    has_tokens = (lengths > 0).float()
    sequences = has_tokens.sum() if global_sequences is None else global_sequences
    loss = masked_sum(seq_losses, has_tokens) / sequences * dp_size
    if agg == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, loss_type: str = "ppo", clip_ratio_low: float = 0.2,
                clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0, agg: str = "token-mean",
                global_tokens=None, global_sequences=None, dp_size: int = 1,
                loss_scale_factor=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss of one micro-batch and its statistics.

    All tensors are `[batch, length]` over response positions (`advantages` per token; a
    per-sequence advantage `a` is `a[:, None]` broadcast). `loss_type`:
    `ppo`: the clipped surrogate, with verl's dual clip (`clip_ratio_c`) for negative advantages;
    `gspo`: the clipped sequence-level ratio (mean log-ratio over the sequence), its gradient
    through each token's log-prob; `cispo`: the clipped ratio as a constant weight on
    `-advantage * logprob`. Under `ppo`, `clip_ratio_c` (> 1) bounds the loss of a negative
    advantage at `-advantage * clip_ratio_c`; None switches the dual clip off.

    Statistics (detached, means over response tokens): `approx_kl` (verl's ppo_kl, mean of
    old - new log-prob), `clip_fraction` (verl's pg_clipfrac), `clip_fraction_lower` (verl's
    pg_clipfrac_lower: the dual clip's share), and TRL's `clip_ratio/low_mean` (ratio below
    1 - low with a negative advantage) and `clip_ratio/high_mean` (above 1 + high, positive).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    if loss_type == "ppo" and clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (None: no dual clip)")
    if loss_type == "ppo":
        losses, ratio, stats = _ppo(logprobs, old_logprobs, advantages, response_mask,
                                    clip_ratio_low, clip_ratio_high, clip_ratio_c)
    elif loss_type == "gspo":
        losses, ratio, stats = _gspo(logprobs, old_logprobs, advantages, response_mask,
                                     clip_ratio_low, clip_ratio_high)
    else:
        losses, ratio, stats = _cispo(logprobs, old_logprobs, advantages, response_mask,
                                      clip_ratio_low, clip_ratio_high)
    loss = aggregate(losses, response_mask, agg, global_tokens=global_tokens,
                     global_sequences=global_sequences, dp_size=dp_size,
                     loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        ratio = ratio.detach()
        low = (ratio < 1 - clip_ratio_low) & (advantages < 0)
        high = (ratio > 1 + clip_ratio_high) & (advantages > 0)
        stats["clip_ratio/low_mean"] = masked_mean(low.float(), response_mask)
        stats["clip_ratio/high_mean"] = masked_mean(high.float(), response_mask)
    return loss, {name: value.detach() for name, value in stats.items()}


def _ppo(logprobs, old_logprobs, advantages, mask, low, high, clip_c):
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    surrogate = torch.maximum(unclipped, clipped)
    stats = {"approx_kl": masked_mean(-log_ratio, mask),
             "clip_fraction": masked_mean(torch.gt(clipped, unclipped).float(), mask)}
    if clip_c is None:  # no dual clip
        stats["clip_fraction_lower"] = torch.zeros((), device=logprobs.device)
        return surrogate, ratio, stats
    bound = -advantages * clip_c
    dual = torch.min(bound, surrogate)
    stats["clip_fraction_lower"] = masked_mean(
        torch.gt(surrogate, bound) * (advantages < 0).float(), mask)
    return torch.where(advantages < 0, dual, surrogate), ratio, stats


def _gspo(logprobs, old_logprobs, advantages, mask, low, high):
    log_ratio = logprobs - old_logprobs
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    stats = {"approx_kl": masked_mean(-log_ratio, mask),
             "clip_fraction": masked_mean(torch.gt(clipped, unclipped).float(), mask),
             "clip_fraction_lower": torch.zeros((), device=logprobs.device)}
    return torch.maximum(unclipped, clipped), ratio, stats


def _cispo(logprobs, old_logprobs, advantages, mask, low, high):
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - low, 1 + high)
    stats = {"approx_kl": masked_mean(-log_ratio, mask),
             "clip_fraction": masked_mean((ratio != weight).float(), mask),
             "clip_fraction_lower": torch.zeros((), device=logprobs.device)}
    return -weight.detach() * advantages * logprobs, ratio, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman's
    estimators, as verl's `kl_penalty`): `k1` / `kl` (log-ratio), `abs`, `k2` / `mse` (half its
    square), `k3` / `low_var_kl` (`exp(-d) + d - 1`, `d` clamped to +-20, the result to +-10).
    A trailing `+` (`k3+`) keeps the value but takes `k2`'s gradient (unbiased), as verl."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        raise ValueError(f"kl kind {kind!r}: expected one of {', '.join(KL_KINDS)} (or with '+')")
    value = _kl_value(logprobs, ref_logprobs, base)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return value
    straight = 0.5 * (logprobs - ref_logprobs).square()
    return straight - straight.detach() + value.detach()


def _kl_value(logprobs, ref_logprobs, kind):
    if kind in ("k1", "kl"):
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
