"""Expert parallelism against one process on the whole batch: every MoE family transformers builds small,
ep 2 (experts further sharded over 2 efsdp ranks) and ep 4, AdamW with global clipping, experts that get
no token, each rank's share of the experts, and bad input refused on every rank. One 4-rank group."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fullshard import FSDP2Engine
from fullshard.errors import ConfigError, PlanError
from fullshard.parallel.ep import find_experts, owned_experts
from fullshard.testing import build_model, reported_by_every_rank, run_distributed
from fullshard.testing.compare import train_against_reference
from fullshard.testing.zoo import MOE_ZOO

TOL = 1e-5
MAX_NORM = 0.5  # below every model's first grad norm here (about 1 to 2), so clipping acts on every step
FAMILIES = sorted(MOE_ZOO)
EP4_FAMILIES = ["ep_mixtral", "ep_gpt_oss", "ep_deepseek_v3"]  # fused with and without biases, shared experts


def route_to_expert_0_and_1(model):
    """Every router picks only experts 0 and 1: at ep 4 three ranks of four receive no token."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda mod, args, out: (out[0], out[1], out[2].clamp(max=1)))
    return model


def _expert_shares(model) -> dict[str, tuple[int, int, range]]:
    """Each experts tensor's (elements this rank holds, elements of the whole tensor, experts its rows are)."""
    names = {f"{e.name}.{p}" for e in find_experts(model) for p in e.params}
    shares = {}
    for name, param in model.named_parameters():
        if name in names and isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            shares[name] = (param.to_local().numel(), param.numel(), range(offset[0], offset[0] + shape[0]))
    return shares


def _train(engine, name, **kwargs):
    return train_against_reference(name, engine.prepare_model, max_norm=MAX_NORM, inspect=_expert_shares, **kwargs)


def _refused(make) -> str | None:
    try:
        make()
    except (ConfigError, PlanError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _world_4_checks():
    results = {}
    for ep, families in ((2, FAMILIES), (4, EP4_FAMILIES)):
        engine = FSDP2Engine({"mixed_precision": "fp32", "ep_size": ep})
        for name in families:
            results[(ep, name)] = _train(engine, name)
        results[(ep, "idle_experts")] = _train(engine, "ep_qwen3_moe", prepare=route_to_expert_0_and_1, steps=2)
    errors = {
        "ep_not_dividing": _refused(lambda: FSDP2Engine({"ep_size": 3})),
        "experts_not_dividing": _refused(
            lambda: FSDP2Engine({"ep_size": 4}).prepare_model(build_model("ep_mixtral", num_local_experts=6))),
        "dense_model": _refused(lambda: FSDP2Engine({"ep_size": 2}).prepare_model(build_model("llama"))),
    }
    return {"parity": results, "errors": errors}


@pytest.fixture(scope="module")
def world_4():
    return run_distributed(_world_4_checks, 4)


def test_ep_matches_single_process_for_every_moe_family(world_4):
    bad = []
    for rank, result in enumerate(world_4):
        for key, r in result["parity"].items():
            loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"]))
            norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"]))
            if max(loss, norm, r["max_weight_diff"]) > TOL or r["missing"]:
                bad.append(f"rank {rank} {key}: loss {loss:.1e} norm {norm:.1e} weight {r['max_weight_diff']:.1e} "
                           f"({r['worst_weight']}) missing {r['missing']}")
            if not r["ref_norm"][0] > MAX_NORM:
                bad.append(f"{key}: first grad norm {r['ref_norm'][0]:.2f} is not clipped by {MAX_NORM}")
    assert not bad, "\n".join(bad)


def test_each_rank_holds_its_experts_share(world_4):
    """ep 2 on 4 ranks: a quarter of each experts tensor (the 4 experts of its ep rank, halved again by
    efsdp 2); ep 4: its 2 whole experts of 8. The rows held lie inside the experts its ep rank owns."""
    for rank, result in enumerate(world_4):
        for (ep, name), r in result["parity"].items():
            shares = r["inspect"]
            assert shares, (ep, name)
            owned = owned_experts(8, ep, rank % ep)
            for param, (local, whole, rows) in shares.items():
                assert local * 4 == whole, (ep, name, param, local, whole)
                assert len(rows) == 8 // 4 and rows.start in owned and rows[-1] in owned, (ep, name, param, rows)


def test_bad_ep_input_refused_on_every_rank(world_4):
    expected = {
        "ep_not_dividing": "ConfigError: ep_size=3 does not divide the data-parallel shard size dp_shard=4",
        "experts_not_dividing": "num_experts=6, not divisible by ep_size",
        "dense_model": "ep_size=2 but LlamaForCausalLM has no MoE experts to split",
    }
    for result in world_4:
        for key, text in expected.items():
            message = result["errors"][key]
            assert message is not None and text in message, (key, message)
            if key != "ep_not_dividing":  # raised by every rank alone, before any collective
                assert reported_by_every_rank(message, 4), message
