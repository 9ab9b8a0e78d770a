"""A trained reward model as a reward (`rl.reward` naming a directory): the classic RLHF path,
SFT -> reward model (`train.objective=reward`) -> GRPO, scored as TRL's `GRPOTrainer` scores with
a model it is given as a reward function.

Which entries are reward models: an `rl.reward` entry that names an existing directory. Functions
are `file.py:function` or `module:function`, built-ins their bare name; an entry that is both a
built-in's name and a directory here is refused (`./name` names the directory). The directory must
hold a sequence-classification checkpoint with one output (`train.objective=reward`'s export, or
transformers' `save_pretrained`) and its tokenizer: anything else is one line before launch
(`check_reward_model`).

Scoring, as TRL 1.16's `GRPOTrainer` does: each prompt + completion as one text, through the reward
model's own tokenizer's chat template when the prompt is a conversation (the prompt's turns, then
the completion's assistant turn), the two texts concatenated otherwise; tokenized without special
tokens, right-padded with the tokenizer's pad token (its end of text when it has none; the model's
config names the same token, since transformers reads each row's score at its last token that is
not the pad token); the score is `logits[:, 0]`. TRL decides conversation or text once, from the
first prompt; here each completion's prompt decides for itself. Its metrics go under the
directory's name (`rewards/<name>/mean`: TRL's last part of the model's `_name_or_path`).

The model is loaded on the trainer's ranks, sharded with FSDP over all of them (the run's mixed
precision, its own automatic plan: its architecture need not be the policy's), frozen, in eval
mode; on an accelerator it waits on the host between its forwards, as the reference does. A
sharded forward is a collective, so the texts go in token-budget micro-batches
(`rl.max_tokens_per_micro_batch`, padded) with every rank running as many, a rank with fewer (or
none) running a stand-in.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_reward_model(spec: str) -> bool:
    """Whether an `rl.reward` entry names a reward model: an existing directory."""
    return Path(spec).expanduser().is_dir()


def reward_model_name(spec: str) -> str:
    """Its metrics' name: the directory's last part, as TRL names a model by its `_name_or_path`."""
    return str(spec).rstrip("/").split("/")[-1]


def check_reward_model(spec: str) -> None:
    """A one-output sequence-classification checkpoint with a tokenizer, read from its config alone
    (no code from the directory runs); else a `ConfigError` naming the entry."""
    from transformers import AutoConfig

    from ..objectives.reward import reward_model_class

    path, where = Path(spec).expanduser(), f"rl.reward={spec!r}"
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} is a directory without config.json, not a reward model (a "
                          "sequence-classification checkpoint: train.objective=reward's export)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot read its config: {_line(err)}") from None
    stored = getattr(config, "architectures", None) or [type(config).__name__]
    if not any(a.endswith("ForSequenceClassification") for a in stored):
        raise ConfigError(f"{where} is a {stored[0]} checkpoint, not a sequence-classification "
                          "model: a reward model scores with a one-output head (train one with "
                          "train.objective=reward)")
    if config.num_labels != 1:
        raise ConfigError(f"{where} is a {stored[0]} checkpoint with {config.num_labels} outputs: "
                          "a reward model has one (num_labels 1), whose value is the reward")
    reward_model_class(config)  # transformers has the class
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where} holds no tokenizer: the reward model scores text tokenized by "
                          "its own tokenizer (save it beside the model)")


def _line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def reward_engine_config(run_config):
    """The reward model's engine: the run's FSDP settings over every rank, its own automatic plan,
    nothing that trains (checkpointing, compile, float8) and no tp, cp, ep or pp."""
    from dataclasses import replace

    return replace(run_config, plan="auto", dp_replicate=1, dp_shard=-1, tp_size=1, tp_plan="auto",
                   cp_size=1, ep_size=1, pp_size=1, pp_layers_per_stage=None,
                   pp_microbatches=None, activation_checkpointing=False,
                   activation_offload=False, compile=False, float8="none", dcp_path=None)


def load_reward_model(spec: str, engine_config, dtype, max_tokens: int = 4096) -> "RewardModel":
    """The reward model `spec` names, sharded (`reward_engine_config`), frozen, on the host when
    an accelerator holds the policy; every rank calls it."""
    from transformers import AutoTokenizer

    from ..distributed import agreed
    from ..engine import FSDP2Engine
    from ..log import log_rank0
    from ..pretrained import from_pretrained
    from ..tensors import parameter_counts
    from .phases import offload

    path = str(Path(spec).expanduser())
    with agreed(ConfigError):
        check_reward_model(spec)
        tokenizer = AutoTokenizer.from_pretrained(path)
    engine = FSDP2Engine(reward_engine_config(engine_config))
    model = from_pretrained(path, engine=engine, dtype=dtype).eval().requires_grad_(False)
    offloaded = next(model.parameters()).device.type != "cpu"
    if offloaded:
        offload(model)
    scorer = RewardModel(spec, model, tokenizer, max_tokens, offloaded=offloaded)
    ranks = engine.dims.world_size
    where = f"{ranks} rank{'s' if ranks > 1 else ''}"
    where += ", on the host between its forwards" if offloaded else ""
    log_rank0(f"rl.reward {spec}: a reward model ({type(model).__name__.removeprefix('FSDP')}, "
              f"{parameter_counts(model)[0]:,} parameters) sharded over {where}; its metric "
              f"rewards/{scorer.name}/mean")
    return scorer


class RewardModel:
    """A (sharded) sequence-classification model as a reward function with TRL's signature:
    `model(prompts, completions, completion_ids, **columns) -> list[float]`, a collective on every
    rank of its mesh. `encode` (may fail on one rank: run it under `agreed`) and `scores` (the
    forwards, every rank in step) are its two halves."""

    def __init__(self, spec: str, model: nn.Module, tokenizer, max_tokens: int = 4096,
                 offloaded: bool = False):
        if tokenizer.pad_token_id is None:  # TRL: the end of text pads
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.spec, self.name = spec, reward_model_name(spec)
        self.model, self.tokenizer = model, tokenizer
        self.max_tokens, self.offloaded = max_tokens, offloaded  # on the host between forwards

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        return self.scores(self.encode(prompts, completions)).tolist()

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Prompt + completion per completion: a conversation through the chat template."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                out.append(self._chat(prompt + completion))
            else:
                out.append(prompt + (completion if isinstance(completion, str) else
                                     str(completion[-1]["content"])))
        return out

    def _chat(self, messages: list[dict]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(f"reward model {self.spec!r}: its tokenizer has no chat template, "
                              "and a prompt is a conversation (save one with its tokenizer)")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as err:  # noqa: BLE001 - the template is the user's: named, one line
            raise ConfigError(f"reward model {self.spec!r}: its chat template raised "
                              f"{type(err).__name__}: {_line(err)}") from None

    def encode(self, prompts: list, completions: list) -> list[list[int]]:
        """Each completion's tokens as the reward model reads them (no special tokens added)."""
        texts = self.texts(prompts, completions)
        if not texts:  # a rank with none (the tokenizer refuses an empty batch)
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    @torch.no_grad()
    def scores(self, encoded: list[list[int]]) -> torch.Tensor:
        """`[n]` float32 scores of the encoded texts, in padded micro-batches of at most
        `max_tokens` tokens; every rank calls it together (a rank's list may be empty)."""
        from ..fsdp import reshard_all
        from .batches import token_batches
        from .phases import offload, onload

        lengths = [max(len(ids), 1) for ids in encoded]
        out = torch.zeros(len(encoded), dtype=torch.float32)
        if self.offloaded:
            onload(self.model)
        try:
            for index in token_batches(lengths, self.max_tokens, padded=True):
                rows = [encoded[i] for i in index] or [[]]  # none: a stand-in forward
                values = self._forward(rows)
                if index:
                    out[torch.tensor(index)] = values
        finally:
            reshard_all(self.model)
            if self.offloaded:
                offload(self.model)
        return out

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        from ..distributed import current_device

        pad, width = self.tokenizer.pad_token_id, max(max(len(r) for r in rows), 1)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : max(len(tokens), 1)] = 1
        device = current_device()
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        return logits[:, 0].float().cpu()
