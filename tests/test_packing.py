"""Packing without contamination: a packed row's documents never see each other, so a packed step
is the unpacked step (chat, plain text, under context parallelism), and a packed row through the
model is each of its documents alone through plain transformers."""

import json

import pytest
import torch

from fullshard.data.builtin import byte_tokenizer
from fullshard.data.pack import Packer
from fullshard.errors import ConfigError
from fullshard.packed_attention import attention_path, packed_inputs, use_attention
from fullshard.parallel.cp import context_parallel_batch
from fullshard.testing import build_model, run_distributed
from fullshard.train import load_config, train
from fullshard.train.config import DataSection
from fullshard.train.data import load_data
from fullshard.train.metrics import read_metrics
from fullshard.train.preflight import check_before_launch

TOL = 1e-5
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SEQ_LEN = {"chat": 96, "text": 31}  # 31: cp 2 pads every row by one token


def chats() -> list[dict]:
    """Conversations of one or two exchanges, some with a system turn, each fitting a row of 96."""
    records = []
    for i in range(16):
        turns = [{"role": "system", "content": "be brief"}] if i % 6 == 0 else []
        for k in range(1 + (i % 4 == 3)):
            turns += [{"role": "user", "content": f"{i}+{k}?"}, {"role": "assistant", "content": str(i + k)}]
        records.append({"messages": turns})
    return records


def texts() -> list[dict]:
    """Documents whose tokens (one per byte, plus EOS) fill rows of 31 exactly, so packing cuts none
    (a document cut at a row's end loses its context by the stream rule, contamination or not)."""
    rows = [(9, 20), (14, 15), (30,), (7, 7, 14)]
    return [{"text": chr(97 + k % 26) * length} for k, length in enumerate(n for row in rows for n in row)]


def _one_step(root: str, kind: str, packing: bool, cp: int) -> dict:
    """One fp32 step over all the data (every row in it) and its loss and grad norm, both taken on
    the unchanged weights (what `optim.lr=0` would keep; the config refuses lr 0)."""
    args = [f"--data.path={root}/{kind}.jsonl", f"--data.format={kind}", f"--data.seq_len={SEQ_LEN[kind]}",
            f"--data.packing={str(packing).lower()}", f"--data.cache_dir={root}/cache", "--data.eval_fraction=0",
            "--model.name_or_path=micro-llama", "--fsdp.mixed_precision=fp32", "--train.steps=1",
            "--train.micro_batch_size=1", "--optim.warmup_steps=0",
            f"--fsdp.cp_size={cp}", "--checkpoint.export=false", "--train.plot=false", "--checkpoint.resume=none",
            f"--train.output_dir={root}/{kind}-{packing}-{cp}"]
    if kind == "chat":
        args.append(f"--data.chat_template={root}/template.jinja")
    rows = len(load_data(load_config(None, args).data, byte_tokenizer()).train)
    config = load_config(None, [*args, f"--train.global_batch_size={rows}"])
    summary = train(config)
    step = next(r for r in read_metrics(summary["metrics"]) if r["kind"] == "train")
    return {"rows": rows, "loss": summary["losses"][0], "grad_norm": step["grad_norm"], "tokens": step["tokens"]}


def _packed_and_unpacked_steps(root: str) -> dict:
    return {(kind, packing, cp): _one_step(root, kind, packing, cp)
            for kind in ("chat", "text") for packing in (True, False) for cp in (1, 2)}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    for kind, records in (("chat", chats()), ("text", texts())):
        (root / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "template.jinja").write_text(TEMPLATE)
    return run_distributed(_packed_and_unpacked_steps, 2, str(root))


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_packed_step_is_the_unpacked_step(steps, kind):
    for result in steps:
        reference = result[(kind, False, 1)]  # one record per row, two data-parallel ranks
        assert result[(kind, True, 1)]["rows"] < reference["rows"]  # packing did pack
        for packing, cp in ((True, 1), (True, 2), (False, 2)):
            got = result[(kind, packing, cp)]
            assert got["tokens"] == reference["tokens"], (packing, cp)
            assert abs(got["loss"] - reference["loss"]) < TOL, (packing, cp, got, reference)
            assert abs(got["grad_norm"] - reference["grad_norm"]) < TOL, (packing, cp, got, reference)


def all_rows(packer: Packer, docs: list[list[int]]) -> dict[str, torch.Tensor]:
    rows, last = packer.add(docs), packer.finish()
    return {k: torch.cat([torch.from_numpy(v), torch.from_numpy(last[k])]) for k, v in rows.items()}


def _packed_rows(docs: list[torch.Tensor], row_len: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Documents packed greedily into rows of `row_len` by the data pipeline's `Packer`, and where each landed."""
    rows = all_rows(Packer(row_len, pad_id=0, whole_documents=True), [d.tolist() for d in docs])
    places, row, col = [], 0, 0
    for d in docs:
        if col + len(d) > row_len:
            row, col = row + 1, 0
        places.append((row, col))
        col += len(d)
    return rows["input_ids"], rows["position_ids"], places


CASES = [(name, impl) for name in ("llama", "qwen3", "gemma", "mixtral", "gpt2") for impl in ("sdpa", "eager")]


@pytest.mark.parametrize("name,impl", CASES)
def test_a_packed_row_is_each_document_alone(name, impl):
    generator = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 100, (n,), generator=generator) for n in (5, 9, 3, 12, 6, 2)]
    ids, positions, places = _packed_rows(docs, 20)
    assert len(ids) == 2 and (positions == 0).sum() > len(docs)  # two rows of several documents, one padded
    model = use_attention(build_model(name).eval(), impl)
    with torch.no_grad():
        logits = model(**packed_inputs(model, {"input_ids": ids, "position_ids": positions})).logits
        for doc, (row, col) in zip(docs, places):
            alone = model(input_ids=doc[None]).logits[0]
            assert (logits[row, col:col + len(doc)] - alone).abs().max() < TOL, (name, impl, row, col)


def test_flash_attention_gets_every_document_of_the_flattened_batch():
    model = build_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # no kernel here: only the inputs it would get
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    inputs = packed_inputs(model, {"input_ids": positions, "position_ids": positions})
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 3, 5, 6, 10, 12]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 4 and inputs["use_cache"] is False


def test_the_console_names_the_attention_path_and_unknown_ones_are_refused():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert "block-diagonal causal mask" in attention_path(use_attention(build_model("llama"), "sdpa"), packed=True)
    assert "document BlockMask" in attention_path(use_attention(build_model("llama"), "flex_attention"), packed=True)
    assert "one record per row" in attention_path(build_model("llama"), packed=False)
    model = build_model("llama")
    model.config._attn_implementation = "flash_attention_3"
    assert "varlen kernels over each document" in attention_path(model, packed=True)
    AttentionInterface.register("someones_kernel", sdpa_attention_forward)
    model = use_attention(build_model("llama"), "someones_kernel")
    with pytest.raises(ConfigError, match="model.attn_implementation='someones_kernel' has no known way"):
        attention_path(model, packed=True)
    with pytest.raises(ConfigError, match="model.attn_implementation='no_such_kernel'"):
        use_attention(build_model("llama"), "no_such_kernel")
    with pytest.raises(ConfigError, match="model.attn_implementation='someones_kernel' has no known way"):
        check_before_launch(load_config(None, ["--model.name_or_path=micro-llama",
                                               "--model.attn_implementation=someones_kernel"]), 2)
    check_before_launch(load_config(None, ["--model.name_or_path=micro-llama", "--data.packing=false",
                                           "--model.attn_implementation=someones_kernel"]), 2)


def test_unpacked_rows_hold_one_record_and_documents_start_without_a_target(tmp_path):
    unpacked = Packer(6, pad_id=0, whole_documents=False, packing=False)
    rows = all_rows(unpacked, [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]])
    assert rows["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11]]
    assert rows["labels"].tolist() == [[-100, 2, 3, -100, -100, -100], [-100, 5, -100, -100, -100, -100],
                                       [-100, 7, 8, 9, 10, 11]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    packed = Packer(6, pad_id=0, whole_documents=False).add([[1, 2, 3], [4, 5, 6, 7]])
    assert packed["labels"].tolist() == [[-100, 2, 3, -100, 5, 6]]
    # unpacked text: a document longer than a row is dropped or truncated by data.overlong, like a conversation
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (3, 20, 5, 9)))
    for overlong, lengths in (("drop", [4, 6, 10]), ("truncate", [4, 16, 6, 10])):
        section = DataSection(path=str(path), cache_dir=str(tmp_path / "c"), seq_len=16, packing=False,
                              eval_fraction=0, overlong=overlong, shuffle=False)
        rows = load_data(section, byte_tokenizer()).train.take(range(len(lengths)))
        assert (rows["labels"][:, 1:] != -100).sum(1).tolist() == [n - 1 for n in lengths]
    streamed = load_data(DataSection(**{**vars(section), "streaming": True}), byte_tokenizer())
    first = torch.cat([b["input_ids"] for b in streamed.step_batches(3, 1, 0, 1).micro_batches(0)])
    assert torch.equal(first, rows["input_ids"][:3])  # streaming reads the same one-record rows


def test_context_parallel_parts_keep_the_rows_documents():
    ids = torch.arange(1, 8)[None]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    parts = [context_parallel_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, r, 2)
             for r in range(2)]
    assert torch.cat([p["position_ids"] for p in parts], 1).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_from_pretrained_builds_the_asked_attention(tmp_path):
    from fullshard import from_pretrained
    from fullshard.packed_attention import implementation_of

    build_model("llama").save_pretrained(tmp_path / "tiny")
    assert implementation_of(from_pretrained(str(tmp_path / "tiny"), attn_implementation="eager")) == "eager"
    assert implementation_of(from_pretrained(str(tmp_path / "tiny"))) == "sdpa"
