"""Context parallelism (all-to-all attention over a split sequence) with FSDP over dp x cp, and with TP,
against a single process on the whole batch. Every 4-rank check runs in one process group."""

import pytest
import torch
import torch.distributed as dist
from harness.compare import data_slice, reference_gaps, train_against_reference

from fullshard import FSDP2Engine
from fullshard.errors import PlanError
from fullshard.parallel.cp import context_parallel_batch
from fullshard.testing import build_model, make_batch, reported_by_every_rank, run_distributed
from fullshard.testing.zoo import TIED

TOL = 1e-5
SEQ = 15  # odd: cp 2 splits it 8 + 7 real tokens (the last part padded with an ignored target)
LAYOUTS = {"cp2_tp2": {"cp_size": 2, "tp_size": 2}, "dp2_cp2": {"cp_size": 2},
           "hsdp_2x1_cp2": {"dp_replicate": 2, "cp_size": 2}}  # FSDP mesh (dp_replicate, dp_shard x cp)
MODELS = {"cp2_tp2": ["llama", "qwen3", "gemma", "mixtral"], "dp2_cp2": ["llama", "qwen3", "mistral"],
          "hsdp_2x1_cp2": ["llama"]}


def _train_cp(engine, name: str) -> dict:
    """5 AdamW steps sharded (dp slices of the batch, cp parts of each sequence) and whole in this process."""
    coords, dims = engine.dims.coordinates(dist.get_rank()), engine.dims

    def split(batch: dict) -> dict:
        return context_parallel_batch(data_slice(batch, coords["dp"], dims.dp_size), coords["cp"], dims.cp)

    return train_against_reference(name, engine.prepare_model, seq_len=SEQ, split=split)


def _heads_error():
    try:
        FSDP2Engine({"cp_size": 2, "tp_size": 2}).prepare_model(build_model("llama", hidden_size=48, num_attention_heads=6))
    except PlanError as error:
        return str(error)
    return None


def _world_4_checks():
    results = {}
    for layout, config in LAYOUTS.items():
        engine = FSDP2Engine(dict({"mixed_precision": "fp32"}, **config))
        for name in MODELS[layout]:
            results[(layout, name)] = _train_cp(engine, name)
    return {"parity": results, "heads_error": _heads_error()}


@pytest.fixture(scope="module")
def world_4():
    return run_distributed(_world_4_checks, 4)


def test_cp_layouts_match_single_process(world_4):
    bad = []
    for rank, result in enumerate(world_4):
        for key, r in result["parity"].items():
            loss, norm = reference_gaps(r)
            if key[1] in TIED and not all(r["tied"]):
                bad.append(f"rank {rank} {key}: tie broken")
            if max(loss, norm, r["max_weight_diff"]) > TOL:
                bad.append(f"rank {rank} {key}: loss {loss:.1e} norm {norm:.1e} weight {r['max_weight_diff']:.1e} "
                           f"({r['worst_weight']})")
    assert not bad, "\n".join(bad)


def test_cp_heads_error_named_on_every_rank(world_4):
    for result in world_4:
        message = result["heads_error"]
        assert message is not None and "num_attention_heads=6 over tp_size=2 does not divide by cp_size" in message
        assert reported_by_every_rank(message, 4), message


def test_cp_batch_splits_whole_sequence_targets():
    batch = make_batch("llama", batch_size=2, seq_len=SEQ)
    parts = [context_parallel_batch(batch, rank, 2) for rank in range(2)]
    assert [p["input_ids"].shape[1] for p in parts] == [8, 8]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1)[:, :SEQ], batch["input_ids"])
    # the last token of part 0 predicts the first of part 1; the pad and the final token predict nothing
    assert torch.equal(parts[0]["labels"][:, -1], batch["input_ids"][:, 8])
    assert (parts[1]["labels"][:, -2:] == -100).all()
    assert all(float(p["num_items_in_batch"]) == 2 * (SEQ - 1) / 2 for p in parts)  # whole-sequence targets / cp
    assert torch.equal(parts[1]["position_ids"][0], torch.arange(8, 16))


def _without_deprecated_collectives() -> dict:
    """A cp run and an ep run (whose router loss gathers every rank's logits) with torch's deprecation
    warnings of the functional collectives turned into errors."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*_functional_collectives", category=FutureWarning)
        cp = _train_cp(FSDP2Engine({"mixed_precision": "fp32", "cp_size": 2}), "llama")
        ep = train_against_reference("ep_mixtral", FSDP2Engine({"mixed_precision": "fp32", "ep_size": 2}).prepare_model,
                                     steps=2)
    return {"cp": max(reference_gaps(cp)), "ep": max(reference_gaps(ep))}


def test_cp_and_ep_runs_use_no_deprecated_collective():
    # before: "FutureWarning: `..._functional_collectives.all_gather_tensor_autograd` is deprecated", per rank
    for gaps in run_distributed(_without_deprecated_collectives, 2):
        assert gaps["cp"] < TOL and gaps["ep"] < 1e-4, gaps
