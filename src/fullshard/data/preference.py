"""Preference records (a prompt, a chosen and a rejected completion) to one packed document per pair.

The formats TRL's preference datasets use: conversational with an explicit prompt (`prompt`,
`chosen`, `rejected` as lists of turns), conversational with an implicit prompt (`chosen` and
`rejected` whole conversations, their shared leading turns being the prompt, TRL's
`extract_prompt`), and plain text (`prompt`, `chosen`, `rejected` strings; EOS appended to each
completion unless it ends with it). The completion is what the prompt-plus-completion adds after the
prompt (rendered with its generation prompt for conversations), TRL's rule: the tokens after the
common prefix of the tokenized prompt and prompt-plus-completion. Labels are on the completion only.

A pair becomes one document, chosen then rejected, with a per-token `pair_role` column (1 chosen,
2 rejected, 0 padding) at which the packer restarts positions (`pack.SPLIT_COLUMN`): so a pair is
never split between rows or micro-batches, and packing keeps whole pairs together. A record's
`margin` (TRL's reward-model field), when the records have one, rides on every token of its pair as
the float32's bits in an int32 column (`pair_margin`; `pair_margins` reads it back).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .chat import RecordError, _turn, as_tools, chat_template_of

ROLE = "pair_role"
MARGIN = "pair_margin"
CHOSEN, REJECTED = 1, 2


def margin_bits(row: int, value) -> int:
    """A record's margin as the bits of its float32 (what an int32 column holds exactly)."""
    if value is None:
        raise RecordError(row, "has no margin, and other records have one")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecordError(row, f"has a margin that is not a finite number: {value!r}")
    return int(np.float32(value).view(np.int32))


def pair_margins(column: torch.Tensor) -> torch.Tensor:
    """The `pair_margin` column back as float32 values."""
    return column.to(torch.int32).view(torch.float32)


def common_prefix_length(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _turns(row: int, value, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(row, f"has a {what} that is not a non-empty list of turns")
    return [_turn(row, t) for t in value]


def split_prompt(row: int, prompt, chosen, rejected):
    """(prompt, chosen, rejected) with an implicit prompt made explicit: the longest common leading
    turns of two conversations (TRL's `extract_prompt`)."""
    if prompt is not None or isinstance(chosen, str):
        return prompt, chosen, rejected
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise RecordError(row, "has no prompt and chosen / rejected that are not conversations")
    shared = common_prefix_length(chosen, rejected)
    return chosen[:shared], chosen[shared:], rejected[shared:]


class PreferenceTokenize:
    """A picklable batch function: each record's pair as one document (chosen then rejected),
    labels on the completions, `pair_role` marking each token's sequence. A pair longer than
    `seq_len` is dropped (and counted)."""

    def __init__(self, tokenizer, section, margin: bool = False):
        self.tokenizer, self.seq_len = tokenizer, section.seq_len
        self.fields = (section.prompt_field, "chosen", "rejected")
        self.tools_field = section.tools_field
        self.template = section.chat_template
        self.columns = (ROLE, MARGIN) if margin else (ROLE,)

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {"input_ids": [], "labels": [], "truncated": [], **{c: [] for c in self.columns}}
        prompt_field = self.fields[0]
        for k, row in enumerate(indices):
            prompt = batch[prompt_field][k] if prompt_field in batch else None
            tools = as_tools(row, batch[self.tools_field][k]) if self.tools_field in batch else None
            ids, labels, roles = self.pair(row, prompt, batch["chosen"][k], batch["rejected"][k], tools)
            if len(ids) > self.seq_len:
                ids, labels, roles = [], [], []
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out[ROLE].append(roles)
            if MARGIN in self.columns:
                out[MARGIN].append([margin_bits(row, batch["margin"][k])] * len(ids))
            out["truncated"].append(False)
        return out

    def pair(self, row: int, prompt, chosen, rejected, tools=None) -> tuple[list, list, list]:
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if value is None or (isinstance(value, (str, list)) and not value):
                raise RecordError(row, f"has no {name} completion")
        prompt, chosen, rejected = split_prompt(row, prompt, chosen, rejected)
        if not chosen or not rejected:
            raise RecordError(row, "has a chosen or rejected completion that is empty after its prompt")
        prompt_ids, chosen_ids = self.encode(row, prompt, chosen, tools)
        _, rejected_ids = self.encode(row, prompt, rejected, tools)
        keep = min(common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids))
        ids, labels, roles = [], [], []
        for role, full in ((CHOSEN, chosen_ids), (REJECTED, rejected_ids)):
            if len(full) <= keep:
                raise RecordError(row, "has a completion that adds no tokens after its prompt")
            ids += full
            labels += [-100] * keep + full[keep:]
            roles += [role] * len(full)
        return ids, labels, roles

    def encode(self, row: int, prompt, completion, tools) -> tuple[list[int], list[int]]:
        """Token ids of the prompt alone and of prompt plus completion, as TRL tokenizes them."""
        tok = self.tokenizer
        if isinstance(completion, str):
            if not isinstance(prompt, str):
                raise RecordError(row, "has a text completion without a text prompt")
            eos = tok.eos_token
            completion = completion if completion.endswith(eos) else completion + eos
            return tok(prompt)["input_ids"], tok(prompt + completion)["input_ids"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        prompt, completion = _turns(row, prompt, "prompt"), _turns(row, completion, "completion")
        template = chat_template_of(tok, self.template)
        try:
            alone = tok.apply_chat_template(prompt, tools=tools, chat_template=template, tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
            whole = tok.apply_chat_template(prompt + completion, tools=tools, chat_template=template, tokenize=True,
                                            return_dict=True)["input_ids"]
        except Exception as err:  # noqa: BLE001 - a template error names the record
            raise RecordError(row, f"does not render with the chat template: {type(err).__name__}: {err}") from None
        return list(alone), list(whole)


class VisionPreferenceTokenize:
    """Preference records for a vision-language model, images in their prompts (content parts as in
    image-text chat records): each sequence, the prompt with one completion, goes through the
    processor as an image-text conversation (`vision.VisionTokenize.document`: image tokens
    expanded, per-token columns, rope rows restarting at the sequence), and the two are joined as
    one pair document with `pair_role`, its image tensors the chosen sequence's then the rejected
    one's. The labels are the conversation's assistant turns, so a prompt with assistant turns of
    its own is one error naming the record. A pair longer than `seq_len` is dropped (counted)."""

    def __init__(self, processor, section, base_dir, rope):
        from .vision import VisionTokenize

        self.vision = VisionTokenize(processor, section, base_dir, rope)
        self.columns = (ROLE, *self.vision.columns)
        self.prompt_field, self.seq_len = section.prompt_field, section.seq_len

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from .pack import IMAGES

        out = {key: [] for key in ("input_ids", "labels", "truncated", "broken", IMAGES, *self.columns)}
        for k, row in enumerate(indices):
            prompt = batch[self.prompt_field][k] if self.prompt_field in batch else None
            pair = self.pair(row, prompt, batch["chosen"][k], batch["rejected"][k])
            for key in out:
                out[key].append(pair[key] if key in pair else False)
        return out

    def pair(self, row: int, prompt, chosen, rejected) -> dict:
        from .pack import IMAGES
        from .vision import decode_images, encode_images

        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, list) or not value:
                raise RecordError(row, f"has no {name} completion as a list of turns "
                                       "(image-text pairs are conversations)")
        prompt, chosen, rejected = split_prompt(row, prompt, chosen, rejected)
        turns = isinstance(prompt, list) and prompt and all(isinstance(t, dict) for t in prompt)
        if not turns:
            raise RecordError(row, "has a prompt that is not a non-empty list of turns "
                                   "(image-text pairs are conversations)")
        if any(turn.get("role") == "assistant" for turn in prompt):
            raise RecordError(row, "has assistant turns in its prompt: image-text pairs label "
                                   "every assistant turn, so their prompts must end before one")
        docs = [self.vision.document(row, prompt + list(c)) for c in (chosen, rejected)]
        lengths = [len(d["input_ids"]) for d in docs]
        if min(lengths) == 0 or sum(lengths) > self.seq_len:
            return {"input_ids": [], "labels": [], IMAGES: b"", **{c: [] for c in self.columns}}
        keys = ("input_ids", "labels", *self.vision.columns)
        joined = {key: docs[0][key] + docs[1][key] for key in keys}
        joined[ROLE] = [CHOSEN] * len(docs[0]["input_ids"]) + [REJECTED] * len(docs[1]["input_ids"])
        joined[IMAGES] = encode_images(decode_images([docs[0][IMAGES], docs[1][IMAGES]]))
        return joined
