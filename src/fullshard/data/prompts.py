"""Prompts for RL (`train.objective=grpo`): chat records read as prompts, every other column kept.

A record is a conversation (`messages`: its turns up to the last non-assistant one) or a `prompt`
(text, or turns); the rest of the record (`answer`, `solution`, anything) goes to the reward
functions as it is. The prompts of a step are chosen like SFT rows: a seeded order per epoch, the
step's slice of it, each data-parallel rank a contiguous share, so the step is the position a
checkpoint keeps, and the step's prompts in their order (by which `rl.sampling` numbers the
completions) are the same at any world size. Prompts are rendered and tokenized when their step
comes (a record that cannot be is named then); one longer than `data.seq_len` tokens keeps its
last `seq_len` tokens (TRL's `max_prompt_length` cut).
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..errors import ConfigError
from .chat import (
    RecordError,
    as_tools,
    chat_template_of,
    prompt_turns,
    render_prompt,
    without_nulls,
)


class PromptData:
    """A run's prompt records (the trainer's data for `train.objective=grpo`)."""

    def __init__(self, records: list[dict], section, tokenizer, group_size: int):
        self.records, self.section, self.tokenizer = records, section, tokenizer
        self.group_size = group_size
        self.prompt_fields = (section.messages_field, section.prompt_field)
        has_template = bool(section.chat_template or getattr(tokenizer, "chat_template", None))
        self.template = chat_template_of(tokenizer, section.chat_template) if has_template else None

    def prompt(self, row: int):
        """Record `row`'s prompt as the reward functions get it: text, or chat turns."""
        record = self.records[row]
        messages = record.get(self.section.messages_field)
        if messages is not None:
            return prompt_turns(row, messages)
        prompt = record.get(self.section.prompt_field)
        if prompt is None:
            raise RecordError(
                row, f"has no {self.prompt_fields[0]!r} and no {self.prompt_fields[1]!r}"
            )
        return prompt if isinstance(prompt, str) else prompt_turns(row, prompt)

    def columns(self, row: int) -> dict:
        """Everything else the record holds."""
        return {k: v for k, v in self.records[row].items() if k not in self.prompt_fields}

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt's tokens, rendered as chat data is (at most `data.seq_len`: the last ones)."""
        tools = self.records[row].get(self.section.tools_field)
        text = render_prompt(
            self.tokenizer, self.template, self.prompt(row), row, as_tools(row, tools)
        )
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        ids = tokenizer(text, add_special_tokens=not self.template)["input_ids"]
        return ids[-self.section.seq_len :]

    def fingerprint(self) -> str:
        """The records' count, first and last ones: a resume on other prompts is refused."""
        picked = self.records[:8] + self.records[-1:]
        text = json.dumps([len(self.records), picked], sort_keys=True, default=str)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.records)} prompts"

    def step_batches(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
    ) -> "PromptBatches":
        """`global_batch_size` completions a step: that over the group size prompts, one batch a
        rank."""
        return PromptBatches(
            self, global_batch_size // self.group_size, dp_rank, dp_size, seed, shuffle
        )

    def eval_batches(self, *args) -> list:
        return []  # an RL run's measure is its reward, logged every step


class PromptBatches:
    """The prompt rows each data-parallel rank samples from at each step."""

    def __init__(
        self,
        data: PromptData,
        prompts_per_step: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
    ):
        if len(data.records) < prompts_per_step:
            raise ConfigError(
                f"the data has {len(data.records)} prompts, fewer than one step's "
                f"{prompts_per_step} (train.global_batch_size / rl.group_size)"
            )
        self.data, self.per_step, self.dp_rank, self.dp_size = (
            data,
            prompts_per_step,
            dp_rank,
            dp_size,
        )
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = len(data.records) // prompts_per_step

    def global_rows(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        n = len(self.data.records)
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            if self.shuffle
            else torch.arange(n)
        )
        return order[within * self.per_step : (within + 1) * self.per_step].tolist()

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's prompt rows of `step`, as the one batch of its step."""
        per_rank = self.per_step // self.dp_size
        return [self.global_rows(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]]

    def step_hash(self, step: int) -> str:
        return hashlib.sha1(repr(self.global_rows(step)).encode()).hexdigest()[:12]

    def state_dict(self) -> dict:
        return {}  # the step is the position

    def load_state_dict(self, state: dict) -> None:
        pass


def load_prompts(section, tokenizer, group_size: int) -> PromptData:
    """The prompts `data.path` holds (chat records: messages, or prompt), or without a path the
    built-in toy's."""
    if section.path is None:
        from .builtin import builtin_prompts

        return PromptData(builtin_prompts(), section, tokenizer, group_size)
    if isinstance(section.path, list):
        raise ConfigError(
            "train.objective=grpo reads one prompt source: data.path as a list (a mixture) is not "
            "supported yet"
        )
    from .prepare import default_cache_dir
    from .sources import load_records, resolve_source

    fields = (section.messages_field, section.prompt_field)
    source = resolve_source(section.path, fields, section.split)
    cache = default_cache_dir() if section.cache_dir is None else section.cache_dir
    from pathlib import Path

    dataset = load_records(source, Path(cache), ((fields[0],), (fields[1],)), optional="*")
    return PromptData(
        [without_nulls(record) for record in dataset.to_list()], section, tokenizer, group_size
    )
