"""The trainer: a resumed run is the uninterrupted run, the export is the trained model, the data
is split and resumed exactly, and the memory estimate matches what a run holds."""

import json

import pytest
import torch

from fullshard.testing import run_distributed
from fullshard.train import ConfigError, load_config, train
from fullshard.train.data import StepBatches, byte_tokenizer, load_data, read_texts
from fullshard.train.loss import causal_lm_loss_sum, target_count
from fullshard.train.metrics import read_metrics

TINY = ["--model.name_or_path=micro-llama", "--data.seq_len=32", "--train.micro_batch_size=2",
        "--train.global_batch_size=8", "--train.log_every=1", "--optim.warmup_steps=2", "--train.steps=6",
        "--train.eval_batches=2"]


def tiny_config(output_dir, *extra):
    return load_config(None, [*TINY, f"--train.output_dir={output_dir}", *extra])


def _trainer_runs(root: str):
    out = {}
    whole = train(tiny_config(f"{root}/whole", "--checkpoint.every=3"))
    first = train(tiny_config(f"{root}/resumed", "--checkpoint.every=3", "--train.stop_after=3"))
    second = train(tiny_config(f"{root}/resumed", "--checkpoint.every=3"))
    out["whole"], out["first"], out["second"] = whole, first, second
    # resuming on other data is refused on every rank, naming both fingerprints
    try:
        train(tiny_config(f"{root}/resumed", "--data.seq_len=16", "--train.steps=8"))
        out["other_data"] = None
    except ConfigError as err:
        out["other_data"] = str(err)
    # the shards a run holds, for the memory estimate: parameters, gradients, AdamW moments
    from fullshard.strategy import FSDPStrategy
    from fullshard.testing import build_model
    from fullshard.testing.compare import data_slice
    from fullshard.testing.zoo import make_batch

    strategy = FSDPStrategy(bf16=False, micro_train_batch_size=2, train_batch_size=4)
    model = strategy.prepare_model(build_model("llama"), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    batch = data_slice(make_batch("llama", batch_size=4), torch.distributed.get_rank(), 2)
    model(**batch).loss.backward()
    optimizer.step()

    def local_bytes(tensors):
        return sum(t.to_local().numel() * t.element_size() for t in tensors)

    out["held"] = {"parameters": local_bytes(model.parameters()),
                   "gradients": local_bytes(p.grad for p in model.parameters()),
                   "optimizer": local_bytes(v for s in optimizer.state.values() for k, v in s.items() if k != "step")}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    return root, run_distributed(_trainer_runs, 2, str(root))


def test_resumed_run_sees_the_same_batches_and_losses(runs):
    root, results = runs
    for r in results:
        whole, first, second = r["whole"], r["first"], r["second"]
        assert (first["start_step"], first["end_step"], second["start_step"], second["end_step"]) == (0, 3, 3, 6)
        resumed_hashes = {**first["batch_hashes"], **second["batch_hashes"]}
        assert resumed_hashes == whole["batch_hashes"]
        assert len(set(whole["batch_hashes"].values())) == 6  # the check could fail: batches differ by step
        resumed_losses = {**first["losses"], **second["losses"]}
        assert max(abs(resumed_losses[s] - whole["losses"][s]) for s in whole["losses"]) < 1e-6
        assert whole["losses"][5] < whole["losses"][0]
        assert "fingerprint" in r["other_data"] and "trained on other data" in r["other_data"]
    # the resumed run's log continues the first part's: every step logged once, in order
    steps = [rec["step"] for rec in read_metrics(root / "resumed" / "metrics.jsonl") if rec["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (root / "resumed" / "loss.png").stat().st_size > 0


def test_export_is_the_trained_model(runs):
    """The exported HF directory, loaded by plain transformers, gives the trainer's final eval loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, results = runs
    hf = root / "whole" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    config = tiny_config(root / "whole")
    data = load_data(config.data, tokenizer)
    total = tokens = 0.0
    with torch.no_grad():
        for rank in range(2):  # the eval batches of both ranks, as the trainer split them
            from fullshard.train.data import eval_batches

            for batch in eval_batches(data.eval, 2, rank, 2, 2):
                total += float(causal_lm_loss_sum(model, batch))
                tokens += target_count(batch)
    assert abs(total / tokens - results[0]["whole"]["eval_loss"]) < 1e-5
    trainer_state = json.loads((root / "whole" / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert trainer_state["extra_state"]["data"]["position"] == 6


def test_memory_estimate_matches_the_shards_a_run_holds(runs):
    from fullshard.plan import auto_plan
    from fullshard.testing import build_model
    from fullshard.train.memory import estimate_memory, measured_activation_bytes

    _, results = runs
    model = build_model("llama")
    estimate = estimate_memory(model, auto_plan(model), shard_size=2, micro_batch_size=2, seq_len=16)
    for key in ("parameters", "gradients", "optimizer"):
        assert getattr(estimate, key) == max(r["held"][key] for r in results), key
    # activations: what autograd saves for one micro-batch, counted on the real model
    for checkpointing in (False, True):
        model = build_model("llama", vocab_size=256)
        if checkpointing:
            from fullshard.engine import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        batch = {"input_ids": torch.randint(0, 256, (2, 64))}
        batch["labels"] = batch["input_ids"]
        measured = measured_activation_bytes(model, lambda: causal_lm_loss_sum(model, batch))
        predicted = estimate_memory(model, auto_plan(model), 2, 2, 64, activation_checkpointing=checkpointing).activations
        assert 0.8 < predicted / measured < 1.25, (checkpointing, predicted, measured)


def test_batches_split_ranks_and_survive_world_size_changes():
    sequences = torch.arange(40 * 4).view(40, 4)
    one = StepBatches(sequences, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=3)
    for step in (0, 4, 5, 11):  # 5 steps per epoch: 5 and 11 are in later epochs
        whole = torch.cat([b["input_ids"] for b in one.micro_batches(step)])
        for dp in (2, 4):
            parts = [StepBatches(sequences, 8, 2, r, dp, seed=3).micro_batches(step) for r in range(dp)]
            assert torch.equal(torch.cat([b["input_ids"] for p in parts for b in p]), whole)
    epoch = torch.cat([torch.cat([b["input_ids"] for b in one.micro_batches(s)]) for s in range(5)])
    assert sorted(epoch[:, 0].tolist()) == list(range(0, 160, 4))  # an epoch sees every sequence once
    assert not torch.equal(one.micro_batches(0)[0]["input_ids"], one.micro_batches(5)[0]["input_ids"])
    with pytest.raises(ConfigError, match="fewer than one train.global_batch_size=64"):
        StepBatches(sequences, 64, 2, 0, 1)


def test_data_sources_and_their_errors(tmp_path):
    tokenizer = byte_tokenizer()
    assert tokenizer.decode(tokenizer("héllo wörld")["input_ids"]) == "héllo wörld"
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third"}\n')
    config = tiny_config(tmp_path, f"--data.path={tmp_path}")
    assert read_texts(config.data) == ["first document", "second", "third"]
    (tmp_path / "c.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"c.jsonl:1 has no field 'text'"):
        read_texts(config.data)
    with pytest.raises(ConfigError, match="fewer than two sequences of data.seq_len=32"):
        load_data(tiny_config(tmp_path, f"--data.path={tmp_path / 'a.txt'}").data, tokenizer)
