"""Training data: every source reads to the same documents, bad data is named by file and line,
chat trains on assistant tokens only (and equals one process on two ranks), tokenization runs
once per node, and a streamed run resumed on any world size sees the uninterrupted run's batches."""

import json
import re

import pytest
import torch

from fullshard.data.builtin import byte_tokenizer
from fullshard.data.pack import Packer
from fullshard.errors import ConfigError
from fullshard.testing import run_distributed
from fullshard.train import load_config, train
from fullshard.train.config import DataSection
from fullshard.train.data import load_data, read_texts

# A tiny chat template; `<|...|>` markers are plain bytes for the byte tokenizer, one token per character.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TINY = ["--model.name_or_path=micro-llama", "--data.seq_len=64", "--train.micro_batch_size=2",
        "--train.global_batch_size=8", "--train.log_every=1", "--optim.warmup_steps=2", "--train.eval_batches=2",
        "--train.plot=false", "--checkpoint.export=false"]


def section(tmp_path, **fields) -> DataSection:
    return DataSection(cache_dir=str(tmp_path / "cache"), seq_len=fields.pop("seq_len", 16), **fields)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Generated chats: one to three exchanges, some with a system turn, a few too long for seq_len 64."""
    rng = __import__("random").Random(seed)
    records = []
    for i in range(n):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for k in range(rng.randrange(1, 4)):
            a, b = rng.randrange(10), rng.randrange(10)
            turns += [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
        if i % 17 == 5:
            turns[-1]["content"] = "long " * 20  # over seq_len: dropped by the default rule
        records.append({"messages": turns})
    return records


def chat_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------------- sources


def test_every_source_reads_the_same_documents(tmp_path, monkeypatch):
    import datasets

    docs = ["first document", "second one", "the third"]
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in docs]))
    write_jsonl(tmp_path / "lines.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_parquet(str(tmp_path / "data.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved_dict"))
    for name in ("array.json", "lines.jsonl", "data.parquet", "saved", "saved_dict"):
        assert read_texts(section(tmp_path, path=str(tmp_path / name))) == docs, name
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert read_texts(section(tmp_path, path=str(arrow))) == docs

    # a directory: files in name order, each .txt one document, a small meta.json skipped
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("a text file\nof two lines\n")
    write_jsonl(folder / "b.jsonl", [{"text": d} for d in docs])
    (folder / "meta.json").write_text(json.dumps({"source": "test", "license": "cc0"}))
    (folder / "README").write_text("not data")
    assert read_texts(section(tmp_path, path=str(folder))) == ["a text file\nof two lines\n", *docs]

    # a Hub dataset name read offline from the local datasets cache (built here; nothing downloaded)
    from datasets.packaged_modules.json.json import Json

    hub_cache = tmp_path / "hub_cache"
    builder = Json(data_files={"train": [str(tmp_path / "lines.jsonl")]}, cache_dir=str(tmp_path / "b"),
                   dataset_name="tiny")
    builder.download_and_prepare()
    target = hub_cache / "someone___tiny" / "default" / "0.0.0" / "h"
    target.mkdir(parents=True)
    for file in __import__("pathlib").Path(builder.cache_dir).iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hub_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert read_texts(section(tmp_path, path="someone/tiny")) == docs
    with pytest.raises(ConfigError, match="'someone/absent' is no local file or directory, and reading it as a Hub"):
        read_texts(section(tmp_path, path="someone/absent"))


def test_packing_restarts_positions_per_document_and_caches(tmp_path):
    tokenizer = byte_tokenizer()
    docs = [f"doc {i} " + "x" * (i % 13) for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    data = load_data(section(tmp_path, path=str(path), eval_fraction=0.1), tokenizer)
    rows = data.train.take(range(len(data.train)))
    rows_eval = data.eval.take(range(len(data.eval)))
    ids = torch.cat([rows["input_ids"], rows_eval["input_ids"]])
    # the stream is the documents joined by EOS, cut every seq_len tokens (the tail shorter than a row dropped)
    stream = [t for d in docs for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    assert ids.flatten().tolist() == stream[:ids.numel()]
    assert len(data.eval) == round(0.1 * len(ids))
    # every token a target but each document's first (the end of the document before does not predict it)
    firsts = [i == 0 for d in docs for i in range(len(tokenizer(d)["input_ids"]) + 1)]
    labels = torch.cat([rows["labels"], rows_eval["labels"]]).flatten()
    assert torch.equal(labels, torch.where(torch.tensor(firsts[:ids.numel()]), -100, ids.flatten()))
    # position ids: 0 at every document start and every row start, else one more than the previous token
    pos = rows["position_ids"]
    prev_is_eos = torch.cat([torch.ones(len(ids), 1, dtype=torch.bool), ids[:, :-1] == tokenizer.eos_token_id], 1)
    expected = torch.zeros_like(ids)
    for j in range(1, ids.shape[1]):
        expected[:, j] = torch.where(prev_is_eos[:, j], 0, expected[:, j - 1] + 1)
    assert torch.equal(pos, expected[:len(pos)]) and int((pos == 0).sum()) > len(pos)  # restarts inside rows
    # the cache: the same data, tokenizer and packing find the tokenized rows; another seq_len does not
    from fullshard.data.prepare import TOKENIZE_RUNS

    before = TOKENIZE_RUNS["count"]
    again = load_data(section(tmp_path, path=str(path), eval_fraction=0.1), tokenizer)
    assert TOKENIZE_RUNS["count"] == before and again.fingerprint() == data.fingerprint()
    other = load_data(section(tmp_path, path=str(path), eval_fraction=0.1, seq_len=8), tokenizer)
    assert TOKENIZE_RUNS["count"] == before + 1 and other.fingerprint() != data.fingerprint()
    assert not list((tmp_path / "cache").glob("*.tmp-*"))  # no half-written cache left behind
    # eval_path: a separate held-out file
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": d} for d in reversed(docs)])
    split = load_data(section(tmp_path, path=str(path), eval_path=str(held)), tokenizer)
    assert len(split.train) == len(ids) and len(split.eval) == len(ids)


def test_streaming_reads_the_rows_of_the_packed_path(tmp_path):
    from fullshard.data.streaming import TOKENIZE_BATCH

    tokenizer = byte_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"document {i} " + "y" * (i % 7)} for i in range(120)])
    held = write_jsonl(tmp_path / "e.jsonl", [{"text": f"held out {i}"} for i in range(30)])
    packed = load_data(section(tmp_path, path=str(path), eval_path=str(held)), tokenizer)
    streamed = load_data(section(tmp_path, path=str(path), eval_path=str(held), streaming=True), tokenizer)
    batches = streamed.step_batches(4, 2, 0, 1)
    steps = len(packed.train) // 4 + 3  # into the second epoch: the stream wraps around
    assert steps * 4 > len(packed.train) and 120 > 2 * TOKENIZE_BATCH
    got = [torch.cat([b["input_ids"] for b in batches.micro_batches(s)]) for s in range(steps)]
    first_epoch = torch.cat(got)[:len(packed.train)]
    assert torch.equal(first_epoch, packed.train.take(range(len(packed.train)))["input_ids"])
    evals = streamed.eval_batches(2, 0, 1, 5)  # 5 rows: 2 micro-batches of 2 and one with a target-less filler
    assert len(evals) == 3 and int((evals[-1]["labels"][1] != -100).sum()) == 0 and all(torch.equal(a["input_ids"], b["input_ids"])
                                   for a, b in zip(evals, packed.eval_batches(2, 0, 1, 5)))
    with pytest.raises(ConfigError, match="streamed run reads steps in order"):
        batches.micro_batches(0)


def test_packer_carries_state_across_calls():
    whole = Packer(4, pad_id=0, whole_documents=False)
    rows = whole.add([[1, 2, 3], [4, 5, 6, 7, 8], [9]])
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    resumed = Packer(4, pad_id=0, whole_documents=False)
    resumed.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert resumed.add([[10, 11, 12]])["input_ids"].tolist() == [[9, 10, 11, 12]]
    chat = Packer(4, pad_id=0, whole_documents=True)
    rows = chat.add([[1, 2], [3, 4, 5], [6]], [[-100, 2], [-100, 4, 5], [6]])
    assert rows["input_ids"].tolist() == [[1, 2, 0, 0]] and rows["labels"].tolist() == [[-100, 2, -100, -100]]
    assert chat.finish()["input_ids"].tolist() == [[3, 4, 5, 6]]


# ---------------------------------------------------------------------------------------------- errors


def test_bad_data_is_named_by_file_and_line(tmp_path):
    tokenizer, chat = byte_tokenizer(), chat_tokenizer()

    def fails(match, data_section, tok=tokenizer):
        with pytest.raises(ConfigError, match=match):
            load_data(data_section, tok)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": broken}\n')
    fails(r"bad.jsonl:3 is not valid JSON", section(tmp_path, path=str(bad)))
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "a"}, {"body": "b"}])
    fails(r"missing.jsonl:2 has no field 'text'", section(tmp_path, path=str(missing)))
    fails(r"missing.jsonl:1 has no field 'content'", section(tmp_path, path=str(missing), text_field="content"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    fails(r"latin.txt:2 is not UTF-8 text \(byte 0xe9", section(tmp_path, path=str(latin)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(r"empty.jsonl holds no records", section(tmp_path, path=str(empty)))
    small = tmp_path / "small.txt"
    small.write_text("hi")
    fails(rf"{re.escape(str(small))} holds 3 tokens in 1 documents .* fewer than two sequences of data.seq_len=16",
          section(tmp_path, path=str(small)))
    (tmp_path / "no_data").mkdir()
    (tmp_path / "no_data" / "picture.png").write_bytes(b"\x89PNG")
    fails(r"no_data' holds no data files", section(tmp_path, path=str(tmp_path / "no_data")))

    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "yo"}]},
                                                   {"messages": [{"role": "user", "content": "alone"}]}])
    fails(r"needs a chat template, and the tokenizer .* has none", section(tmp_path, path=str(chats), format="chat"))
    fails(r"chat.jsonl:2 is a conversation with no assistant turn",
          section(tmp_path, path=str(chats), format="chat"), chat)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "response": "r"}, {"prompt": "q"}])
    fails(r"pairs.jsonl:2 has no field 'response'", section(tmp_path, path=str(pairs), format="chat"), chat)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "no conversation"}])
    fails(r"odd.jsonl:1 has no field 'messages' or 'prompt'\+'response'",
          section(tmp_path, path=str(odd), format="chat"), chat)
    # a template failing on a record names file and line, and text parts handed to a string-only template
    strings_only = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hi, yo = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    parts = write_jsonl(tmp_path / "parts.jsonl", [{"messages": [hi, yo]}, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}, yo]}])
    fails(r"parts.jsonl:2 cannot be rendered by the chat template \(TypeError: .*\): its turns give content as "
          r"text parts .*this template only takes strings",
          section(tmp_path, path=str(parts), format="chat", chat_template=strings_only), chat)
    fails(r"parts.jsonl:1 cannot be rendered by the chat template \(TemplateError: no system turn\)$",
          section(tmp_path, path=str(parts), format="chat", chat_template="{{ raise_exception('no system turn') }}"),
          chat)
    with pytest.raises(ConfigError, match="data.format=.chats.: input should be .text., .chat. or .preference."):
        load_config(None, ["--data.format=chats"])


# ---------------------------------------------------------------------------------------------- chat


def assistant_mask(text: str) -> torch.Tensor:
    """From the template's structure: the assistant's content and its `<|end|>\\n` train, nothing else
    (one byte token per ASCII character)."""
    mask = torch.zeros(len(text), dtype=torch.bool)
    for match in re.finditer(r"<\|assistant\|>\n(.*?<\|end\|>\n)", text, re.S):
        mask[match.start(1):match.end(1)] = True
    return mask


def test_chat_labels_only_assistant_tokens(tmp_path):
    tokenizer = chat_tokenizer()
    records = conversations(60)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    data = load_data(section(tmp_path, path=str(path), format="chat", seq_len=64, eval_fraction=0), tokenizer)
    rows = data.train.take(range(len(data.train)))
    eos = tokenizer.eos_token_id
    seen = []
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
        for a, b in zip(starts, starts[1:]):  # each segment: one conversation, or the row's padding
            if ids[a] == eos:
                assert set(ids[a:b].tolist()) == {eos} and set(labels[a:b].tolist()) == {-100}
                continue
            text = tokenizer.decode(ids[a:b])
            assert torch.equal(labels[a:b], torch.where(assistant_mask(text), ids[a:b], -100)), text
            seen.append(text)
    kept = [r for r in records if len(tokenizer.apply_chat_template(r["messages"], tokenize=False)) <= 64]
    assert seen == [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in kept]
    assert 0 < len(kept) < len(records)  # the rule was exercised: over-long conversations dropped
    # truncate instead: the over-long ones are kept, cut to seq_len
    cut = load_data(section(tmp_path, path=str(path), format="chat", seq_len=64, overlong="truncate",
                            eval_fraction=0), tokenizer)
    assert len(cut.train) > len(data.train)
    # prompt/response records are the same as the two-turn conversation
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "2+2?", "response": "4"}] * 4)
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"messages": [{"role": "user", "content": "2+2?"},
                                                                 {"role": "assistant", "content": "4"}]}] * 4)
    a, b = (load_data(section(tmp_path, path=str(p), format="chat", seq_len=64, eval_fraction=0), tokenizer)
            for p in (pairs, turns))
    assert all(torch.equal(x, y) for x, y in zip(a.train.take([0, 1]).values(), b.train.take([0, 1]).values()))
    # both kinds in one file (as the README presents a chat file's records): read as the same conversations
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "2+2?", "response": "4"},
                                                   {"messages": [{"role": "user", "content": "2+2?"},
                                                                 {"role": "assistant", "content": "4"}]}] * 2)
    c = load_data(section(tmp_path, path=str(mixed), format="chat", seq_len=64, eval_fraction=0), tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(c.train.take([0, 1]).values(), b.train.take([0, 1]).values()))
    streamed = load_data(section(tmp_path, path=str(mixed), format="chat", seq_len=64, eval_fraction=0,
                                 streaming=True), tokenizer)
    batch = streamed.step_batches(2, 2, 0, 1).micro_batches(0)[0]
    assert torch.equal(batch["input_ids"], b.train.take([0, 1])["input_ids"])
    half = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "2+2?", "response": "4"}, {"prompt": "3+3?"},
                                                 {"messages": [{"role": "user", "content": "2+2?"},
                                                               {"role": "assistant", "content": "4"}]}])
    with pytest.raises(ConfigError, match=r"half.jsonl:2 has no field 'messages' or 'prompt'\+'response'"):
        load_data(section(tmp_path, path=str(half), format="chat", seq_len=64, eval_fraction=0), tokenizer)


# A template in the transformers form for tools: `tools` shown up front, content as text or text parts,
# an assistant's tool calls rendered inside its turn, tool turns answering them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def tool_conversations(n: int) -> list[dict]:
    """OpenAI-format chats: text-part content, tool calls with null content, tool turns, a `tools`
    list on some records, plain text turns on others (in one file, as people have them)."""
    records = []
    for i in range(n):
        a, b = i % 7, i % 5
        if i % 3 == 0:
            records.append({"messages": [{"role": "user", "content": f"{a}+{b}?"},
                                         {"role": "assistant", "content": str(a + b)}]})
            continue
        call = {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        records.append({"tools": [ADD], "messages": [
            {"role": "system", "content": [{"type": "text", "text": "use tools"}]},
            {"role": "user", "content": [{"type": "text", "text": f"{a}+"}, {"type": "text", "text": f"{b}?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": str(a + b)},
            {"role": "assistant", "content": [{"type": "text", "text": f"it is {a + b}"}]}]})
    return records


def test_chat_formats_with_tools_and_parts_label_only_assistant_output(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    records = tool_conversations(12)
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    data = load_data(section(tmp_path, path=str(path), format="chat", seq_len=512, eval_fraction=0,
                             packing=False), tokenizer)
    rows = data.train.take(range(len(data.train)))
    texts = []
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        keep = ids != tokenizer.eos_token_id  # one record per row, padded with EOS
        ids, labels = ids[keep], labels[keep]
        text = tokenizer.decode(ids)
        # the assistant's text and its tool calls train; system, user, tool turns and the tools list do not
        assert torch.equal(labels, torch.where(assistant_mask(text), ids, -100)), text
        texts.append(text)
    expected = [tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=False) for r in records]
    assert sorted(texts) == sorted(expected)
    with_tools = [t for t in texts if "<call>" in t]
    assert len(with_tools) == 8 and all(t.startswith("<|tools|>\n{\"name\": \"add\"") for t in with_tools)
    sample = with_tools[0]
    trained = tokenizer.decode([i for i, keep in zip(tokenizer(sample)["input_ids"], assistant_mask(sample)) if keep])
    assert "<call>add {\"a\": " in trained and "it is" in trained and "use tools" not in trained
    # parts that are not text, a turn without content and no tool call, tool calls off an assistant turn: named
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
           {"role": "assistant", "content": "x"}]
    for turns, match in ((bad, r"bad.jsonl:1 has a content part that is not \{type: text"),
                         ([{"role": "user", "content": None}, {"role": "assistant", "content": "x"}],
                          r"bad.jsonl:1 has a turn without content"),
                         ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
                           {"role": "assistant", "content": "x"}], r"bad.jsonl:1 has tool_calls that are not")):
        write_jsonl(tmp_path / "bad.jsonl", [{"messages": turns}])
        with pytest.raises(ConfigError, match=match):
            load_data(section(tmp_path, path=str(tmp_path / "bad.jsonl"), format="chat", seq_len=512), tokenizer)


def overlong_chat(tmp_path):
    """The chat tokenizer, 60 conversations written as JSONL, and how many are longer than 64 characters."""
    tokenizer = chat_tokenizer()
    records = conversations(60)
    overlong = sum(len(tokenizer.apply_chat_template(r["messages"], tokenize=False)) > 64 for r in records)
    assert overlong
    return tokenizer, records, write_jsonl(tmp_path / "chat.jsonl", records), overlong


def test_dropped_and_truncated_conversations_are_said_every_run(tmp_path, caplog):
    """Over-long conversations were dropped with no word (the count only in a cache file)."""
    import logging

    from fullshard.log import logger

    tokenizer, records, path, overlong = overlong_chat(tmp_path)
    logger.addHandler(caplog.handler)
    try:
        for rule, said in (("drop", "dropped"), ("truncate", "truncated")):
            for run in ("fresh", "cached"):
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="fullshard"):
                    load_data(section(tmp_path, path=str(path), format="chat", seq_len=64, overlong=rule), tokenizer)
                assert f"{overlong} of {len(records)} conversations {said}" in caplog.text, (rule, run, caplog.text)
                assert "data.seq_len=64" in caplog.text
        # nothing left: one error naming the keys, not an empty run
        with pytest.raises(ConfigError, match=r"all 60 conversations are longer than data.seq_len=8 .*data.overlong"):
            load_data(section(tmp_path, path=str(path), format="chat", seq_len=8), tokenizer)
    finally:
        logger.removeHandler(caplog.handler)


def _chat_runs(root: str, world: int) -> dict:
    """Chat training through the trainer; on two ranks also the tokenization count and a streamed run."""
    from fullshard.data.prepare import TOKENIZE_RUNS

    chat = [*TINY, f"--data.path={root}/chat.jsonl", "--data.format=chat", f"--data.chat_template={root}/t.jinja",
            f"--data.cache_dir={root}/cache{world}", "--train.steps=4", "--data.eval_fraction=0.1"]
    try:  # bad data read by rank 0 fails every rank with the one same message
        load_data(load_config(None, [f"--data.path={root}/bad.jsonl", f"--data.cache_dir={root}/bad"]).data,
                  byte_tokenizer())
    except ConfigError as err:
        bad = str(err)
    before = TOKENIZE_RUNS["count"]
    exported = ["--checkpoint.export=true"] if world == 2 else []  # the template trained with goes along
    out = {"bad": bad, "chat": train(load_config(None, [*chat, f"--train.output_dir={root}/chat{world}", *exported]))}
    out["tokenized"] = TOKENIZE_RUNS["count"] - before
    train(load_config(None, [*chat, f"--train.output_dir={root}/chat{world}b"]))
    out["tokenized_again"] = TOKENIZE_RUNS["count"] - before - out["tokenized"]
    stream = [*TINY, f"--data.path={root}/text.jsonl", "--data.streaming=true", f"--data.cache_dir={root}/c",
              "--train.steps=6", "--checkpoint.every=3"]
    if world == 2:
        out["whole"] = train(load_config(None, [*stream, f"--train.output_dir={root}/whole"]))
        for name in ("same", "other"):  # stopped mid-epoch at step 3; "other" resumes on one rank
            out[name] = train(load_config(None, [*stream, f"--train.output_dir={root}/{name}",
                                                 "--train.stop_after=3"]))
        before = TOKENIZE_RUNS["count"]
        out["same_rest"] = train(load_config(None, [*stream, f"--train.output_dir={root}/same"]))
        out["streamed"] = TOKENIZE_RUNS["count"] - before
    else:
        # micro 4: the same 2 micro-batches per step as on 2 ranks (the strategy's restored micro-step
        # counter assumes an unchanged accumulation window; the data position does not)
        out["other_rest"] = train(load_config(None, [*stream, f"--train.output_dir={root}/other",
                                                     "--train.micro_batch_size=4"]))
    return out


def test_chat_on_two_ranks_equals_one_process_and_streaming_resumes_exactly(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", conversations(120))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    write_jsonl(tmp_path / "text.jsonl", [{"text": f"line {i}: " + "ab" * (i % 9)} for i in range(300)])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    two = run_distributed(_chat_runs, 2, str(tmp_path), 2)
    assert [r["bad"] for r in two] == [f"{tmp_path}/bad.jsonl:2 is not valid JSON (Expecting value)"] * 2
    one = run_distributed(_chat_runs, 1, str(tmp_path), 1)[0]
    # chat: the same losses on two ranks as in one process, and the batches were the same
    losses2, losses1 = two[0]["chat"]["losses"], one["chat"]["losses"]
    assert losses2.keys() == losses1.keys() == {0, 1, 2, 3}
    assert max(abs(losses2[s] - losses1[s]) for s in losses1) < 1e-5
    assert two[0]["chat"]["batch_hashes"] == one["chat"]["batch_hashes"]
    # data.chat_template is saved with the model: the export's and the checkpoint's tokenizer render as training
    from transformers import AutoTokenizer

    from fullshard.checkpoint.layout import TOKENIZER_DIR, resolve_run_checkpoint

    for saved in (tmp_path / "chat2" / "hf", resolve_run_checkpoint(tmp_path / "chat2") / TOKENIZER_DIR):
        assert AutoTokenizer.from_pretrained(saved).chat_template == TEMPLATE, saved
    assert abs(two[0]["chat"]["eval_loss"] - one["chat"]["eval_loss"]) < 1e-5
    assert two[0]["chat"]["eval_ppl"] == pytest.approx(__import__("math").exp(one["chat"]["eval_loss"]), rel=1e-5)
    # tokenized once per node: by local rank 0 only, and not again when cached
    assert [r["tokenized"] for r in two] == [1, 0] and [r["tokenized_again"] for r in two] == [0, 0]
    # streaming: resumed mid-epoch on 2 and on 1 rank, every step's batch is the uninterrupted run's
    whole = two[0]["whole"]["batch_hashes"]
    assert len(set(whole.values())) == 6
    assert {**two[0]["same"]["batch_hashes"], **two[0]["same_rest"]["batch_hashes"]} == whole
    assert {**two[0]["other"]["batch_hashes"], **one["other_rest"]["batch_hashes"]} == whole
    assert one["other_rest"]["start_step"] == 3
    assert max(abs(two[0]["same_rest"]["losses"][s] - two[0]["whole"]["losses"][s]) for s in (3, 4, 5)) < 1e-6
    assert [r["streamed"] for r in two] == [1, 0]  # the stream is read and tokenized on the node's first rank only


def test_streaming_says_what_it_dropped_or_truncated_like_the_cached_path(tmp_path, caplog):
    """A streamed pass over conversations, some longer than seq_len: the first one said when met, each
    pass's counts at its end, the same counts the cached path says (before: nothing)."""
    import logging

    from fullshard.log import logger

    tokenizer, records, path, overlong = overlong_chat(tmp_path)
    logger.addHandler(caplog.handler)
    try:
        for rule, said in (("drop", "dropped"), ("truncate", "truncated")):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fullshard"):
                data = load_data(section(tmp_path, path=str(path), format="chat", seq_len=64, overlong=rule,
                                         streaming=True), tokenizer)
                batches = data.step_batches(4, 4, 0, 1)
                step = 0
                while "(pass 1)" not in caplog.text and step < 500:
                    batches.micro_batches(step)
                    step += 1
            assert f"records longer than data.seq_len=64 are {said}" in caplog.text, caplog.text
            assert f"(pass 1): {overlong} of {len(records)} conversations {said}" in caplog.text, caplog.text
    finally:
        logger.removeHandler(caplog.handler)


def test_fingerprint_of_image_rows_ignores_the_order_of_their_tensors():
    """safetensors hands a row's image tensors back in no fixed order (it differs between processes):
    the fingerprint that refuses a resume on other data, and the decoded rows, must not depend on it."""
    from safetensors.torch import save

    from fullshard.data.rows import Rows
    from fullshard.data.vision import decode_images
    from fullshard.train.data import PackedData

    pixels, grid = torch.arange(12.0).view(2, 6), torch.tensor([[1, 1, 2]])
    decoded = decode_images([save({"pixel_values": pixels, "image_grid_thw": grid})])
    assert list(decoded) == ["image_grid_thw", "pixel_values"]

    def data(order):
        class Images(Rows):
            def take(self, indices):
                return {"input_ids": torch.zeros(len(indices), 4, dtype=torch.int64),
                        "images": [dict(order) for _ in indices]}

        return PackedData(Images(torch.zeros(3, 4)), Rows(torch.zeros(1, 4)))

    one = data([("pixel_values", pixels), ("image_grid_thw", grid)])
    other = data([("image_grid_thw", grid), ("pixel_values", pixels)])
    assert one.fingerprint() == other.fingerprint()
