"""What a policy update trains on and what it computes per micro-batch: `Rollouts` (this rank's
completed sequences with their advantages, old and reference log-probs), `UpdateConfig` (verl's
names), and `loss_terms`, one micro-batch's globally normalised loss and the sums of its terms,
shared by the update with and without pipeline stages (`update.py`, `pipeline.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .losses import aggregate, kl_penalty, policy_loss


@dataclass
class Rollouts:
    """This rank's sequences, right-padded: `input_ids` / `attention_mask` `[n, T]`; the rest over
    the `T - 1` next-token positions (entry t scores token t + 1, as `token_logprobs` returns):
    `response_mask` (1 on completion tokens), `advantages` (`[n]` per sequence or `[n, T - 1]`),
    `old_logprobs` (None: on-policy, the current log-probs detached), `ref_logprobs` (None: no
    KL term). `model_inputs`: further model inputs, sliced along with the rows: tensors per row or
    per position (`[n, T, ...]`, cut with the columns), and `images`, a list of one dict of image
    tensors per row (empty for a row without), concatenated for the rows of a micro-batch as the
    trainer's rows are (`data.rows.model_inputs`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    model_inputs: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def lengths(self) -> list[int]:
        return self.attention_mask.sum(dim=-1).tolist()

    def rows(self, index: list[int]) -> "Rollouts":
        """The rows `index`, trimmed to the longest of them."""
        width = int(self.attention_mask[index].sum(dim=-1).max())
        pick = torch.tensor(index, dtype=torch.long, device=self.input_ids.device)

        def cut(t, columns):
            if t is None:
                return None
            t = t[pick.to(t.device)]
            return t[:, :columns] if t.dim() > 1 else t

        full = self.input_ids.shape[1]

        def extra(value):  # a list (images: one dict per row), per row, or per position
            if not isinstance(value, torch.Tensor):
                return [value[i] for i in index]
            if value.dim() > 1 and value.shape[1] == full:
                return cut(value, width)
            return value[pick.to(value.device)]

        return Rollouts(cut(self.input_ids, width), cut(self.attention_mask, width),
                        cut(self.response_mask, width - 1), cut(self.advantages, width - 1),
                        cut(self.old_logprobs, width - 1), cut(self.ref_logprobs, width - 1),
                        {k: extra(v) for k, v in self.model_inputs.items()})


@dataclass
class UpdateConfig:
    """The loss and the micro-batching of an update; the names of `policy_loss`'s arguments, plus
    the KL term (`kl_coef` times `kl_kind`'s estimate, aggregated as the policy loss), an entropy
    bonus (`entropy_coef`), the sampling `temperature` the log-probs are taken at, and the
    global-norm clip (`max_norm`, 0: none)."""

    loss_type: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    agg: str = "token-mean"
    loss_scale_factor: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    max_tokens: int = 4096
    chunk_tokens: int = 1024
    max_norm: float = 1.0


STAT_NAMES = ("approx_kl", "clip_fraction", "clip_fraction_lower", "clip_ratio/low_mean",
              "clip_ratio/high_mean")


SUMMED = ("loss", "pg_loss", "kl", "entropy") + STAT_NAMES


def loss_terms(logprobs, entropy, batch, config: UpdateConfig, counts, dp_size: int,
               loss_scale_factor: float | None = None):
    """`micro_batch_loss` from the log-probs and entropies of `batch`'s rows (anything with
    `response_mask`, `advantages`, `old_logprobs`, `ref_logprobs` over the same positions)."""
    mask = batch.response_mask.to(logprobs.dtype)
    advantages = batch.advantages.to(logprobs)
    advantages = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(logprobs)
    if loss_scale_factor is None:
        loss_scale_factor = config.loss_scale_factor
    scale = dict(global_tokens=counts.tokens, global_sequences=counts.sequences, dp_size=dp_size,
                 loss_scale_factor=loss_scale_factor)
    pg, stats = policy_loss(logprobs, old, advantages, mask, loss_type=config.loss_type,
                            clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                            clip_ratio_c=config.clip_ratio_c, agg=config.agg, **scale)
    loss, terms = pg, {"pg_loss": pg.detach()}
    if batch.ref_logprobs is not None:
        kl = aggregate(kl_penalty(logprobs, batch.ref_logprobs.to(logprobs), config.kl_kind), mask,
                       config.agg, **scale)
        loss = loss + config.kl_coef * kl if config.kl_coef else loss
        terms["kl"] = kl.detach()
    entropy_term = aggregate(entropy, mask, config.agg, **scale)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * entropy_term
    terms["entropy"] = entropy_term.detach()
    tokens = mask.sum()  # each masked-mean statistic weighted by its share of the tokens
    terms.update({name: stats[name] * tokens / max(counts.tokens, 1) * dp_size for name in STAT_NAMES})
    terms["loss"] = loss.detach()
    return loss, terms


def term_sums(terms: dict) -> torch.Tensor:
    return torch.stack([terms.get(name, torch.zeros(())).double().cpu() for name in SUMMED])
