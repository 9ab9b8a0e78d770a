"""The trainer with tensor and context parallelism trains what data parallelism trains.

One spawned group of 4 ranks runs the same short `Trainer` job at dp 4, dp 2 x tp 2 and
dp 2 x cp 2 (the last two stopped half-way and resumed from their checkpoints), and shards a
model at both layouts so the memory estimate can be checked against what each rank holds.
(Packed rows of several documents under cp: `tests/test_packing.py`.)
"""

import pytest
import torch

from fullshard.testing import run_distributed
from fullshard.train import load_config, train

TOL = 1e-5
LAYOUTS = {"dp4": [], "tp2": ["--fsdp.tp_size=2"], "cp2": ["--fsdp.cp_size=2"]}


def config(root: str, layout: str, *extra):
    args = ["--model.name_or_path=micro-llama", f"--data.path={root}/doc.txt", "--data.seq_len=32",
            "--data.eval_fraction=0.1", "--train.micro_batch_size=2", "--train.global_batch_size=8",
            "--train.steps=4", "--train.log_every=1", "--train.eval_batches=1", "--train.plot=false",
            "--optim.warmup_steps=1", "--checkpoint.every=2",
            f"--train.output_dir={root}/{layout}", *LAYOUTS[layout], *extra]
    return load_config(None, args)


def _held_bytes(layout: str) -> dict:
    """What each rank holds of micro-llama sharded at `layout`, and the TP plan the engine applied."""
    from fullshard.strategy import FSDPStrategy

    strategy = FSDPStrategy(bf16=False, train_batch_size=8, micro_train_batch_size=2,
                            config={"tp_size": 2} if layout == "tp2" else {"cp_size": 2})
    model = strategy.prepare_model(micro_llama(), is_training=True)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"held": held, "assignments": strategy.engine().tp_assignments, "dims": vars(strategy.engine().dims)}


def micro_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.train.config import BUILTIN_MODELS

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=257, max_position_embeddings=32, **BUILTIN_MODELS["micro-llama"]))


def _parallel_runs(root: str) -> dict:
    out = {"dp4": train(config(root, "dp4"))}
    for layout in ("tp2", "cp2"):
        first = train(config(root, layout, "--train.stop_after=2"))
        out[layout] = {"first": first, "second": train(config(root, layout))}
    out["held"] = {layout: _held_bytes(layout) for layout in ("tp2", "cp2")}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    words = [f"w{(i * 7919) % 613} " for i in range(3000)]  # one document: no packing boundary in a row
    (root / "doc.txt").write_text("".join(words))
    return run_distributed(_parallel_runs, 4, str(root), timeout=300)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_tp_and_cp_train_the_dp_losses_and_resume(runs, layout):
    for r in runs:
        whole, first, second = r["dp4"], r[layout]["first"], r[layout]["second"]
        assert (first["start_step"], first["end_step"], second["start_step"], second["end_step"]) == (0, 2, 2, 4)
        losses = {**first["losses"], **second["losses"]}
        assert sorted(losses) == sorted(whole["losses"]) == [0, 1, 2, 3]
        assert max(abs(losses[s] - whole["losses"][s]) for s in losses) < TOL, (layout, losses, whole["losses"])
        assert {**first["batch_hashes"], **second["batch_hashes"]} == whole["batch_hashes"]
        assert whole["losses"][3] < whole["losses"][0]  # it trained, so equal losses say something


def test_tp_and_cp_evaluate_alike(runs):
    """Both split the eval rows 2 ways (dp 4 evaluates other rows): the eval losses of a layer split
    and of a sequence split agree."""
    for r in runs:
        tp, cp = r["tp2"]["second"]["eval_loss"], r["cp2"]["second"]["eval_loss"]
        assert abs(tp - cp) < TOL, (tp, cp)


def test_memory_estimate_matches_what_tp_and_cp_ranks_hold(runs):
    from fullshard.parallel.tp import plan_assignments, resolve_tp_plan
    from fullshard.plan import auto_plan
    from fullshard.train.memory import estimate_memory

    model = micro_llama()
    assignments = plan_assignments(model, resolve_tp_plan(model, "auto"), 2)
    for layout, tp, cp in (("tp2", 2, 1), ("cp2", 1, 2)):
        held = [r["held"][layout] for r in runs]
        assert all(h["dims"]["tp"] == tp and h["dims"]["cp"] == cp and h["dims"]["dp_shard"] == 2 for h in held)
        if tp > 1:
            assert all(h["assignments"] == assignments for h in held)
        estimate = estimate_memory(model, auto_plan(model), shard_size=2, micro_batch_size=2, seq_len=32,
                                   tp_assignments=assignments if tp > 1 else None, tp_size=tp, cp_size=cp)
        assert estimate.parameters == max(h["held"] for h in held), layout
    plain = estimate_memory(model, auto_plan(model), 2, 2, 32)
    assert plain.parameters > estimate.parameters  # dp 2 x cp 2 shards over 4: the check above could fail
    halved = estimate_memory(model, auto_plan(model), 2, 2, 16)
    split = estimate_memory(model, auto_plan(model), 2, 2, 32, cp_size=2)
    # a cp rank saves its half of each sequence's activations, plus what its all-to-all attention keeps
    assert halved.activations < split.activations < plain.activations


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_the_export_is_the_dp_model(runs, layout):
    """`export_hf` gathers TP x FSDP and dp x cp shards into the same weights dp 4 trained."""
    from safetensors.torch import load_file

    root = runs[0]["dp4"]["export"].rsplit("/dp4/", 1)[0]
    whole, split = (load_file(f"{root}/{name}/hf/model.safetensors") for name in ("dp4", layout))
    assert sorted(whole) == sorted(split) and len(whole) > 10
    assert max((whole[k] - split[k]).abs().max().item() for k in whole) < TOL
