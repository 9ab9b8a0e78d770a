"""Records to token ids, one batch of records at a time: the function `datasets.map` runs on the
node's tokenizing rank (in `num_proc` processes) and the streaming reader runs on the fly."""

from __future__ import annotations

from .chat import IGNORE_INDEX, RecordError, as_messages, as_tools, chat_template_of, tokenize_chat

FORMATS = ("text", "chat", "preference")
OVERLONG = ("drop", "truncate")


def layouts(section) -> tuple[tuple[str, ...], ...]:
    """The alternative column sets a format reads: each record has one (a chat file may mix them)."""
    if section.format == "chat":
        return (section.messages_field,), (section.prompt_field, section.response_field)
    if section.format == "preference":
        return (section.prompt_field, "chosen", "rejected"), ("chosen", "rejected")
    return ((section.text_field,),)


def optional_fields(section) -> tuple[str, ...]:
    """Fields read when a source has them: a chat record's `tools`, passed to the template; a
    preference record's `margin` (reward models)."""
    if section.format == "preference":
        return section.tools_field, "margin"
    return (section.tools_field,) if section.format == "chat" else ()


class Tokenize:
    """A picklable batch function: text documents end with EOS and train on every token; a chat
    record trains on its assistant turns only. A record that must fit a row (a conversation, or
    any record without packing) and is longer than `seq_len` is dropped or truncated (its first
    `seq_len` tokens kept) by `overlong`. A dropped record yields no tokens."""

    def __init__(self, tokenizer, section):
        self.tokenizer, self.format = tokenizer, section.format
        self.field = section.text_field
        self.seq_len, self.overlong, self.packing = section.seq_len, section.overlong, section.packing
        self.chat_fields = (section.messages_field, section.prompt_field, section.response_field)
        self.tools_field = section.tools_field
        self.template = chat_template_of(tokenizer, section.chat_template) if section.format == "chat" else None

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self.format == "text":
            eos, texts = self.tokenizer.eos_token_id, batch[self.field]
            if None in texts:  # a streamed record without the field (read data is checked when loaded)
                raise RecordError(indices[texts.index(None)], f"has no field {self.field!r}")
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            docs = [doc + [eos] for doc in ids]
            if self.packing:
                return {"input_ids": docs}
            return {
                "input_ids": [self._fit(doc, doc)[0] for doc in docs],
                "truncated": list(map(self._truncates, docs)),
            }
        out = {"input_ids": [], "labels": [], "truncated": []}
        messages, prompt, response = self.chat_fields
        for k, row in enumerate(indices):
            if messages in batch and batch[messages][k] is not None:  # else a prompt/response record
                turns = as_messages(row, messages=batch[messages][k])
            else:
                turns = as_messages(row, prompt=batch.get(prompt, [None] * len(indices))[k],
                                    response=batch.get(response, [None] * len(indices))[k])
            tools = as_tools(row, batch[self.tools_field][k]) if self.tools_field in batch else None
            ids, labels = tokenize_chat(self.tokenizer, self.template, turns, row, tools)
            out["truncated"].append(self._truncates(ids))
            ids, labels = self._fit(ids, labels)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    def _truncates(self, ids: list[int]) -> bool:
        return len(ids) > self.seq_len and self.overlong == "truncate"

    def _fit(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """A record that must fit one row, by `overlong`."""
        if len(ids) <= self.seq_len:
            return ids, labels
        return ([], []) if self.overlong == "drop" else (ids[:self.seq_len], labels[:self.seq_len])


__all__ = ["FORMATS", "IGNORE_INDEX", "OVERLONG", "RecordError", "Tokenize", "layouts", "optional_fields"]
