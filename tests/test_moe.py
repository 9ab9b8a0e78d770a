"""MoE models: outermost decoder layer as the unit, idle experts, and experts spread over more ranks than experts."""

import pytest
from harness.compare import reference_gaps, train_against_reference
from torch.distributed.tensor import DTensor, Shard

from fullshard import FSDP2Engine
from fullshard.testing import run_distributed

TOL = 1e-5
MOE = ("mixtral", "qwen3_moe")


def route_to_first_two_experts(model):
    """Every router picks only experts 0 and 1, so the others receive no tokens at all."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda mod, args, out: (out[0], out[1], out[2].clamp(max=1)))
    return model


def _moe_checks(expert_counts):
    engine = FSDP2Engine({"mixed_precision": "fp32"})
    out = {}
    for name in MOE:
        out[(name, "idle_experts")] = train_against_reference(name, engine.prepare_model,
                                                              prepare=route_to_first_two_experts)
        for experts in expert_counts:
            key = "num_local_experts" if name == "mixtral" else "num_experts"
            holder = {}

            def shard_and_record(model, holder=holder):
                model = engine.prepare_model(model)
                holder.update({n: (p.placements, p.to_local().numel()) for n, p in model.named_parameters()
                               if "experts" in n and isinstance(p, DTensor)})
                return model

            result = train_against_reference(name, shard_and_record, model_kwargs={key: experts})
            result["expert_shards"] = holder
            out[(name, f"{experts}_experts")] = result
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_matches_single_process_with_idle_and_few_experts(world_size):
    results = run_distributed(_moe_checks, world_size, [2])
    for rank_result in results:
        for key, r in rank_result.items():
            loss, norm = reference_gaps(r)
            assert max(loss, norm, r["max_weight_diff"]) < TOL, (key, loss, norm, r["max_weight_diff"])
            assert r["loss"][-1] < r["loss"][0], key
            for param, (placements, local_numel) in r.get("expert_shards", {}).items():
                assert local_numel > 0, f"{key} {param}: a rank holds no part of the experts"
                if world_size > 2:  # 2 experts over 4 ranks: dim 0 would leave two ranks empty
                    assert placements[0] != Shard(0), (key, param, placements)
                else:
                    assert placements == (Shard(0),), (key, param, placements)
