"""Conversations rendered with the tokenizer's chat template, labelled for training on the
assistant turns only.

The template is a Jinja program, so which characters belong to an assistant turn is found by
rendering: the conversation up to turn i with the generation prompt, and up to turn i included;
the characters between the two are the assistant's turn (its content and the template's
end-of-turn marker, so the model learns to stop). Tokens starting inside those spans keep their
label, every other token is -100. A template that does not render a conversation as the prefix of
its continuation cannot be labelled this way and is refused, naming the record.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


class RecordError(ConfigError):
    """A record that cannot be trained on; `row` is its 0-based index in the source, named by the caller."""

    def __init__(self, row: int, reason: str):
        super().__init__(row, reason)
        self.row, self.reason = row, reason

    def __str__(self) -> str:
        return f"row {self.row + 1}: {self.reason}"


def chat_template_of(tokenizer, override: str | None) -> str:
    """The template to render with: `data.chat_template` (Jinja text, or a file holding it) or the tokenizer's."""
    if override:
        from pathlib import Path

        path = Path(override).expanduser()
        return path.read_text(encoding="utf-8") if path.is_file() else override
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"data.format=chat needs a chat template, and the tokenizer {name!r} has none: "
                          "use a tokenizer with one or set data.chat_template")
    return template


def as_messages(row: int, messages=None, prompt=None, response=None, system=None) -> list[dict]:
    """A record's conversation as role/content dicts, checked; prompt/response records become two turns."""
    if messages is None:
        if prompt is None or response is None:
            raise RecordError(row, "has no prompt or no response")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if not isinstance(messages, list) or not messages:
        raise RecordError(row, "has no messages (a list of {role, content})")
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise RecordError(row, f"has a turn that is not {{role: {'/'.join(ROLES)}, content: text}}: {turn!r}")
    if not any(t["role"] == "assistant" for t in messages):
        raise RecordError(row, "is a conversation with no assistant turn (nothing to train on)")
    return [{"role": t["role"], "content": t["content"]} for t in messages]


def assistant_spans(tokenizer, template: str, messages: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    def render(turns, generation_prompt=False) -> str:
        return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    full = render(messages)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[:i + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise RecordError(row, "is rendered by the chat template differently as a prefix than in full, so its "
                                   "assistant turns cannot be located; use a prefix-consistent template")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_chat(tokenizer, template: str, messages: list[dict], row: int) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and their labels (-100 outside assistant turns)."""
    text, spans = assistant_spans(tokenizer, template, messages, row)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (starts >= start) & (starts < end)
    return ids.tolist(), np.where(trained, ids, IGNORE_INDEX).tolist()
