"""Conversations rendered with the tokenizer's chat template, labelled for training on the
assistant turns only.

The template is a Jinja program, so which characters belong to an assistant turn is found by
rendering: the conversation up to turn i with the generation prompt, and up to turn i included;
the characters between the two are the assistant's turn (its content and the template's
end-of-turn marker, so the model learns to stop). Tokens starting inside those spans keep their
label, every other token is -100. A template that does not render a conversation as the prefix of
its continuation cannot be labelled this way and is refused, naming the record.

Turns come in the OpenAI / transformers chat format, passed to the template as they are: `content`
as text or a list of text parts (`[{"type": "text", "text": ...}]`), assistant turns with
`tool_calls` (and `content: null`), `tool` turns answering them, and a record's `tools` list given
to the template as its `tools`. An assistant turn's tool calls are assistant output, so they train;
the tool's answers, like the user's turns, do not.
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


def adopt_chat_template(tokenizer, section):
    """`tokenizer` (and a processor's own tokenizer) given the template `data.chat_template` names,
    when chat data is rendered with it: the tokenizer saved with checkpoints and exports then
    renders as training did (`apply_chat_template`, `fullshard generate`, a server)."""
    if section.format == "chat" and section.chat_template:
        template = chat_template_of(tokenizer, section.chat_template)
        tokenizer.chat_template = template
        if getattr(tokenizer, "tokenizer", None) is not None:
            tokenizer.tokenizer.chat_template = template
    return tokenizer


def as_messages(row: int, messages=None, prompt=None, response=None, system=None) -> list[dict]:
    """A record's conversation as chat-format turns, checked; prompt/response records become two turns.
    Keys a record does not set (Arrow fills them with null when other records have them) are left out."""
    if messages is None:
        if prompt is None or response is None:
            raise RecordError(row, "has no prompt or no response")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if not isinstance(messages, list) or not messages:
        raise RecordError(row, "has no messages (a list of {role, content})")
    turns = [_turn(row, turn) for turn in messages]
    if not any(t["role"] == "assistant" for t in turns):
        raise RecordError(row, "is a conversation with no assistant turn (nothing to train on)")
    return turns


def _turn(row: int, turn) -> dict:
    """One turn, checked against the chat format, its null keys left out (its content kept, null or not)."""
    shape = (f"{{role: {'/'.join(ROLES)}, content: text or a list of text parts}} (an assistant turn may have "
             "tool_calls and content null)")
    if not isinstance(turn, dict) or turn.get("role") not in ROLES:
        raise RecordError(row, f"has a turn that is not {shape}: {turn!r}")
    turn = {**without_nulls({k: v for k, v in turn.items() if k != "content"}), "content": turn.get("content")}
    content, calls = turn["content"], turn.get("tool_calls")
    if calls is not None and (turn["role"] != "assistant" or not isinstance(calls, list)
                              or not all(isinstance(c, dict) for c in calls)):
        raise RecordError(row, f"has tool_calls that are not a list of calls on an assistant turn: {turn!r}")
    if content is None and not calls:
        raise RecordError(row, f"has a turn without content (only an assistant turn with tool_calls may have none): "
                               f"{turn!r}")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RecordError(row, f"has a content part that is not {{type: text, text: ...}} (only text is "
                                       f"trained on): {part!r}")
        turn["content"] = [without_nulls(part) for part in content]
    elif content is not None and not isinstance(content, str):
        raise RecordError(row, f"has a turn that is not {shape}: {turn!r}")
    return turn


def as_tools(row: int, tools) -> list[dict] | None:
    """A record's `tools` (function schemas the template shows the model), or None when it has none."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(row, f"has tools that are not a list of tool schemas: {tools!r}")
    return [without_nulls(t) for t in tools] or None


def without_nulls(value):
    """`value` without the dict keys whose value is null, at any depth: a column read by Arrow holds
    every key any record has, null where a record has none, which a template must not see."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def assistant_spans(tokenizer, template: str, messages: list[dict], row: int,
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (tool calls included)."""
    def render(turns, generation_prompt=False) -> str:
        try:
            return tokenizer.apply_chat_template(turns, tools=tools, chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - the template is the user's program: name the record
            raise RecordError(row, template_failure(tokenizer, template, turns, tools, err)) from None

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


def template_failure(tokenizer, template: str, turns: list[dict], tools, err: Exception) -> str:
    """Why the chat template failed on a record; when its turns give text parts (a list of content
    parts) and the same turns as strings render, the template only takes strings: say so."""
    reason = f"cannot be rendered by the chat template ({type(err).__name__}: {err})"
    if not any(isinstance(t.get("content"), list) for t in turns):
        return reason
    flat = [{**t, "content": "".join(p.get("text", "") for p in t["content"])}
            if isinstance(t.get("content"), list) else t for t in turns]
    try:
        tokenizer.apply_chat_template(flat, tools=tools, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - fails on strings too: the first error stands
        return reason
    return (f"{reason}: its turns give content as text parts (a list of {{type: text, text}} parts), and this "
            "template only takes strings; give content as a string, or use a template that reads parts")


def tokenize_chat(tokenizer, template: str, messages: list[dict], row: int,
                  tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and their labels (-100 outside assistant turns)."""
    text, spans = assistant_spans(tokenizer, template, messages, row, tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (starts >= start) & (starts < end)
    return ids.tolist(), np.where(trained, ids, IGNORE_INDEX).tolist()


def prompt_turns(row: int, messages=None) -> list[dict]:
    """An RL prompt from a conversation: its turns, checked, up to its last non-assistant turn (an
    assistant turn at the end is a reference answer, not part of what the policy is asked)."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(row, "has no messages (a list of {role, content})")
    turns = [_turn(row, turn) for turn in messages]
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns:
        raise RecordError(row, "is a conversation of assistant turns only: no prompt")
    return turns


def render_prompt(tokenizer, template: str | None, prompt, row: int, tools=None) -> str:
    """The text a policy continues: chat turns through the template with the generation prompt; a
    text prompt as a user turn of the template, or as it is when there is no template."""
    if isinstance(prompt, str) and not template:
        return prompt
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not template:
        raise RecordError(row, "is a conversation, and the tokenizer has no chat template: set "
                               "data.chat_template")
    try:
        return tokenizer.apply_chat_template(turns, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - the template is the user's program: name the record
        raise RecordError(row, template_failure(tokenizer, template, turns, tools, err)) from None
