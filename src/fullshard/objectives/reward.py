"""Reward models (`train.objective=reward`): one score per sequence, trained on preference pairs
with the Bradley-Terry loss of TRL's `RewardTrainer`.

The model is the checkpoint config's `AutoModelForSequenceClassification` class with one output
(`num_labels=1`) and the run's pad token id in its config (TRL sets it too: it is what transformers
finds the scored token by). From a causal-LM checkpoint the base loads as usual, the causal LM's
head is not read, and the `score` head is new: drawn from the run's seed as transformers
initialises it (normal, std `initializer_range`), the whole tensor on every rank and each rank's
region copied in, so every world size starts from the same head. `checkpoint.init_from` a causal
LM's training checkpoint (an SFT run's) is read the same way (`init_reward_from`): its base, not
its LM head, and the same new head, so the run equals one started from that checkpoint's export.

Where the score is read: transformers' `*ForSequenceClassification` apply `score` at every
position and read each row at its last token that is not the pad token
(`(arange * (ids != pad)).argmax(-1)`, the first token when every one is padding). A row here holds
several sequences (a pair's chosen and rejected, more pairs when packed), so the score head's
output at every position is kept and each sequence read at its own last position whose token is
not the pad token: where transformers reads that sequence alone, so the export scores as training
did.

The loss of a pair: -log sigmoid(r_chosen - r_rejected - margin) + c (r_chosen + r_rejected)^2, the
margin from the records when they have one, c `reward.center_coefficient` (TRL's
`center_rewards_coefficient`); summed over pairs and divided by the step's pairs, TRL's mean over
a batch. Metrics, TRL's names: `accuracy` (r_chosen > r_rejected) and `margin`
(r_chosen - r_rejected).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.preference import MARGIN, ROLE, pair_margins
from ..errors import ConfigError, LoadError
from ..log import log_rank0
from .base import Objective
from .logprobs import forward_inputs
from .preference import pair_count

METRICS = ("accuracy", "margin")


class Reward(Objective):
    """Bradley-Terry over the pairs of each micro-batch, scores read per sequence."""

    name = "reward"
    unit = "pairs"
    metrics = METRICS
    shown = METRICS

    def __init__(self, center_coefficient: float = 0.0):
        self.center_coefficient = center_coefficient

    def count(self, batch: dict) -> int:
        return pair_count(batch)

    def loss_sum(self, model, batch: dict):
        scores = sequence_scores(model, batch).float()
        chosen, rejected = scores[0::2], scores[1::2]
        margin = pair_margin(batch).to(scores.device)
        losses = -F.logsigmoid(chosen - rejected - margin)
        if self.center_coefficient:
            losses = losses + self.center_coefficient * (chosen + rejected) ** 2
        with torch.no_grad():
            diff = chosen - rejected
            sums = torch.stack([(diff > 0).float().sum(), diff.sum()])
        return losses.sum(), sums.detach().to("cpu", torch.float64)


# --------------------------------------------------------------------------- the model


def reward_model_class(hf_config):
    """transformers' sequence-classification class for `hf_config`'s model type."""
    import transformers

    try:
        return transformers.AutoModelForSequenceClassification._model_mapping[type(hf_config)]
    except KeyError:
        raise ConfigError(f"{type(hf_config).__name__} has no sequence-classification class in "
                          "transformers: train.objective=reward cannot build a reward model from it"
                          ) from None


def as_reward_config(hf_config, pad_token_id: int):
    """`hf_config` with one output and the pad token the score is found by."""
    hf_config.num_labels = 1
    hf_config.get_text_config().pad_token_id = pad_token_id
    return hf_config


def score_head(model: nn.Module) -> nn.Linear:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ConfigError(f"{type(model).__name__} has no one-output `score` head to train as a "
                          "reward model")
    return head


def load_reward_model(name_or_path: str, engine, dtype, seed: int, pad_token_id: int,
                      attn_implementation: str | None = None) -> nn.Module:
    """A sharded reward model from a sequence-classification or causal-LM checkpoint (the `score`
    head then new, drawn from `seed`); anything else the checkpoint lacks or adds is an error."""
    from transformers import AutoConfig

    from ..loading import resolve_checkpoint_dir
    from ..pretrained import from_pretrained

    hf_config = AutoConfig.from_pretrained(resolve_checkpoint_dir(name_or_path))
    model = from_pretrained(name_or_path, engine=engine, dtype=dtype,
                            model_class=reward_model_class(hf_config), num_labels=1,
                            attn_implementation=attn_implementation, strict=False,
                            init_missing=lambda model, names: init_score_head(model, names, seed))
    as_reward_config(model.config, pad_token_id)
    report = model.fullshard_load_report
    if report.missing:
        std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
        log_rank0(f"{name_or_path}: no score head in the checkpoint (a causal LM): a new one drawn "
                  f"from train.seed={seed}, normal(0, {std}); its head {report.unexpected} is not "
                  "read")
    prefix = f"{getattr(model, 'base_model_prefix', 'model')}."
    others = [k for k in report.unexpected if k.startswith(prefix)]
    if others:
        raise LoadError(f"checkpoint {name_or_path!r} holds tensors {type(model).__name__} has no "
                        f"place for: {others[:20]}")
    return model


@torch.no_grad()
def init_score_head(model: nn.Module, names: list[str], seed: int) -> None:
    """The missing tensors, which must be the score head's: drawn from `seed` whole (weight
    normal(0, initializer_range), bias 0) and each rank's region copied in, the same head on any
    world size."""
    from ..loading.shards import local_region

    head = dict(score_head(model).named_parameters())
    others = [n for n in names if n.removeprefix("score.") not in head]
    if others:
        raise LoadError(f"the checkpoint lacks {others[:20]}: of a reward model only the score "
                        "head may be new")
    std = float(getattr(model.config.get_text_config(), "initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    for name, param in head.items():
        if f"score.{name}" not in names:
            continue
        full = torch.zeros(param.shape)
        if name != "bias":
            full.normal_(0, std, generator=generator)
        local, region = local_region(param)
        local.copy_(full[region])


SFT_OPTIMIZER = ("checkpoint.init_from={path!r} is a causal LM's checkpoint, whose optimizer state "
                 "has none for the reward model's new score head: set "
                 "checkpoint.init_optimizer=false (the weights are read, the optimizer starts anew)")


def new_head_keys(metadata, model: nn.Module) -> list[str]:
    """The score head's keys when a checkpoint's index (`metadata`) is a causal LM's of this reward
    model's base (an SFT run's): every base weight there in its shape, no score head, nothing else
    but the LM head (none saved when tied). [] otherwise: the checkpoint is read as it is (a
    reward run's), strictly."""
    from ..checkpoint.fit import weights_apart

    missing, unexpected, reshaped = weights_apart(metadata, model.state_dict(), model)
    head = sorted(f"score.{name}" for name, _ in score_head(model).named_parameters())
    prefix = f"{getattr(model, 'base_model_prefix', 'model')}."
    base_only = not reshaped and not any(k.startswith(prefix) for k in unexpected)
    return head if missing == head and base_only else []


def init_reward_from(manager, path, model: nn.Module, optimizer, seed: int) -> dict:
    """`checkpoint.init_from` into a reward model: a reward run's checkpoint as it is; a causal
    LM's as a causal-LM directory loads (its base read, its LM head not, the score head new, drawn
    from `seed` as `load_reward_model` draws it). Returns the checkpoint's extra state."""
    from ..checkpoint.manager import agreed_run_checkpoint
    from ..checkpoint.read import CheckpointReader

    checkpoint = agreed_run_checkpoint(path)
    new = new_head_keys(CheckpointReader(checkpoint, share=None).metadata, model)
    if new and optimizer is not None:
        raise ConfigError(SFT_OPTIMIZER.format(path=path))
    extra = manager.init_from(checkpoint, model, optimizer, strict=not new)
    if new:
        init_score_head(model, new, seed)
        std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
        log_rank0(f"checkpoint.init_from={path}: a causal LM's checkpoint, no score head: its base "
                  f"read, its LM head not; a new score head drawn from train.seed={seed}, "
                  f"normal(0, {std})")
    return extra


# --------------------------------------------------------------------------- the score


def position_scores(model: nn.Module, batch: dict) -> torch.Tensor:
    """[rows, seq]: the score head's output at every position. The model runs as usual; its
    output's `logits` (transformers' one pooled score per row) are replaced by these before FSDP's
    post-forward sees them, so its backward hooks sit on what the loss uses."""
    kept = []

    def keep(module, args, output):
        kept.append(output)

    def per_position(module, args, output):
        output.logits = kept[-1][..., 0].clone()  # not a view: FSDP's hook on it must stay
        return output

    handles = [score_head(model).register_forward_hook(keep),
               model.register_forward_hook(per_position, prepend=True)]
    try:
        return model(**forward_inputs(model, batch)).logits
    finally:
        for handle in handles:
            handle.remove()


def score_positions(batch: dict, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (2k pair k's chosen, 2k + 1 its rejected), the flat index of its first token
    and of the token its score is read at: its last that is not `pad_token_id` (else its first)."""
    role, ids = batch[ROLE].flatten(), batch["input_ids"].flatten()
    positions = batch["position_ids"]
    positions = (positions[:, 0] if positions.ndim == 3 else positions).flatten()
    starts = (positions == 0) & (role > 0)
    seq = torch.where(role > 0, starts.cumsum(0) - 1, -1)
    index = torch.arange(len(ids))
    first = index[starts]
    scored = (seq >= 0) & (ids != pad_token_id if pad_token_id is not None else True)
    return first, first.scatter_reduce(0, seq[scored], index[scored], "amax")


def sequence_scores(model: nn.Module, batch: dict) -> torch.Tensor:
    """Each sequence's score, read where transformers reads it."""
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    _, scored = score_positions(batch, pad)
    scores = position_scores(model, batch)
    return scores.flatten()[scored.to(scores.device)]


def pair_margin(batch: dict) -> torch.Tensor:
    """Each pair's margin (0 without the records' `margin` field)."""
    if MARGIN not in batch:
        return torch.zeros(pair_count(batch))
    first, _ = score_positions(batch, None)
    return pair_margins(batch[MARGIN]).flatten()[first[0::2]]
