"""FSDP2Engine on real process groups: structure, policies and plans against a single-process reference."""

import pytest
import torch
from harness.compare import largest_gap, reference_gaps, train_against_reference, train_on_padded_batches
from safetensors import safe_open
from test_plan import BAD_PLANS, check_bad_plan

from fullshard import FSDP2Engine, PlanError, apply_fsdp2
from fullshard.checkpoint import export_hf
from fullshard.fsdp import fsdp_units
from fullshard.testing import ZOO, build_model, run_distributed
from fullshard.testing.zoo import TIED

TOL = 1e-5
BF16_LOSS_TOL = 5e-2

VARIANTS_2 = {
    "activation_checkpointing": {"activation_checkpointing": True},
    "reshard_false": {"reshard_after_forward": False},
    "cpu_offload": {"offload_params": True},
    "manual_plan": {"plan": {"mode": "manual", "modules": {
        "model.layers.*": ["free_full_weight"],
        "model.layers.*.mlp": ["keep_full_weight"],
        "model.embed_tokens + model.norm + lm_head": ["keep_full_weight"]}}},
}
VARIANTS_4 = {
    "reshard_to_2": {"reshard_after_forward": 2},
    "hsdp_2x2": {"dp_replicate": 2},
}


def _structure():
    """For every zoo model: the units fully_shard built are the plan's, each parameter in one."""
    out = {}
    for name in sorted(ZOO):
        engine = FSDP2Engine()
        model = engine.prepare_model(build_model(name))
        units = fsdp_units(model)
        managed = [id(p) for params in units.values() for p in params]
        all_params = {id(p) for p in model.parameters()}
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        out[name] = {
            "units": sorted(" + ".join(k) for k in units),
            "plan": sorted(engine.plan.unit_names() + [""]),
            "each_param_once": len(managed) == len(set(managed)) and set(managed) == all_params,
            "tied": head.weight is embed.weight,
        }
    return out


def _variants(variants, model_names):
    results = {}
    for variant, config in variants.items():
        engine = FSDP2Engine(dict({"mixed_precision": "fp32"}, **config))
        for name in model_names:
            results[(variant, name)] = train_against_reference(name, engine.prepare_model)
    return results


def _bf16():
    engine = FSDP2Engine({"mixed_precision": "bf16"})
    return {name: train_against_reference(name, engine.prepare_model) for name in ("llama", "gemma")}


def _bad_plans_on_every_rank():
    messages = {}
    for case in BAD_PLANS:
        check_bad_plan(case)  # raises if this rank did not get the named error
        name, spec, _ = BAD_PLANS[case]
        try:
            apply_fsdp2(build_model(name), fsdp_plan=spec)
        except PlanError as error:
            messages[case] = str(error)
    return messages


def _mesh_error():
    try:
        FSDP2Engine({"dp_replicate": 3})
    except ValueError as error:
        return str(error)
    return None


def _world_2_checks():
    return {"structure": _structure(), "variants": _variants(VARIANTS_2, ["llama", "gemma"]),
            "bf16": _bf16(), "bad_plans": _bad_plans_on_every_rank(), "mesh_error": _mesh_error()}


def _hsdp_export(tmp: str) -> dict:
    """HSDP 2 x 2: every row block sits on two replicas, and one of them writes it."""
    model = build_model("llama", seed=5)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model = FSDP2Engine({"dp_replicate": 2, "mixed_precision": "fp32"}).prepare_model(model)
    export_hf(model, f"{tmp}/hsdp_export", max_shard_size="20KB")
    return expected


def _world_4_checks(tmp: str):
    return {"variants": _variants(VARIANTS_4, ["llama", "gemma", "mixtral"]), "hsdp_export": _hsdp_export(tmp)}


def _diff(r):
    return (*reference_gaps(r), r["max_weight_diff"])


def _assert_matches_reference(results):
    bad = []
    for key, r in results.items():
        loss, norm, weight = _diff(r)
        if max(loss, norm, weight) > TOL:
            bad.append(f"{key}: loss {loss:.1e} norm {norm:.1e} weight {weight:.1e} ({r['worst_weight']})")
        if key[1] in TIED and not all(r["tied"]):
            bad.append(f"{key}: tie broken")
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def world_2():
    return run_distributed(_world_2_checks, 2)


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world_4")
    return tmp, run_distributed(_world_4_checks, 4, str(tmp))


def test_units_built_are_the_plans_units(world_2):
    for rank_result in world_2:
        for name, s in rank_result["structure"].items():
            assert s["units"] == s["plan"], name
            assert s["each_param_once"], name
            assert s["tied"] == (name in TIED), name


def test_policies_and_manual_plan_match_single_process(world_2):
    for rank_result in world_2:
        _assert_matches_reference(rank_result["variants"])


def test_hsdp_and_int_reshard_match_single_process(world_4):
    for rank_result in world_4[1]:
        _assert_matches_reference(rank_result["variants"])
        # HSDP 2x2 and FSDP 4 see the same first-step loss (both equal the single-process one)
        for name in ("llama", "gemma", "mixtral"):
            hsdp = rank_result["variants"][("hsdp_2x2", name)]["loss"][0]
            fsdp = rank_result["variants"][("reshard_to_2", name)]["loss"][0]
            assert abs(hsdp - fsdp) < TOL


def test_bf16_runs_close_to_fp32(world_2):
    for rank_result in world_2:
        for name, r in rank_result["bf16"].items():
            loss_diff = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"]))
            assert loss_diff < BF16_LOSS_TOL, (name, r["loss"], r["ref_loss"])
            assert r["loss"][-1] < r["loss"][0], "bf16 training still learns"
            assert loss_diff > 0, "bf16 compute really differs from fp32 (the policy was applied)"


def test_plan_errors_raised_on_every_rank(world_2):
    for rank_result in world_2:
        assert set(rank_result["bad_plans"]) == set(BAD_PLANS)


def test_mesh_that_does_not_divide_the_world_fails_on_every_rank(world_2):
    for rank_result in world_2:
        assert rank_result["mesh_error"] == "world size 2 is not divisible by dp_replicate=3"


WORLD_1_SCRIPT = """
from fullshard import FSDP2Engine
from harness.compare import train_against_reference
r = train_against_reference("gemma", FSDP2Engine().prepare_model, steps=2)
assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < 1e-6, r
assert all(r["tied"]) and r["max_weight_diff"] < 1e-6, r
print("ok")
"""


USERS_GROUP_SCRIPT = """
from datetime import timedelta
import torch.distributed as dist
from fullshard.distributed import find_free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1,
                        timeout=timedelta(seconds=77))
world = dist.group.WORLD
from fullshard import FSDP2Engine
from harness.compare import train_against_reference
r = train_against_reference("llama", FSDP2Engine().prepare_model, steps=1)
assert dist.group.WORLD is world and r["max_weight_diff"] < 1e-6, r  # the user's group, not a second one
print("ok")
"""


def test_world_size_one_without_a_launcher():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])])  # harness
    for script in (WORLD_1_SCRIPT, USERS_GROUP_SCRIPT):  # the engine's own group, then one the user made first
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_hsdp_export_equals_the_model(world_4):
    tmp, results = world_4
    expected = results[0]["hsdp_export"]
    files = sorted((tmp / "hsdp_export").glob("*.safetensors"))
    written = {}
    for file in files:
        with safe_open(file, "pt") as f:
            written.update({key: f.get_tensor(key) for key in f.keys()})
    assert len(files) > 2 and set(written) == set(expected)  # llama's head is untied: every key is written
    for key, tensor in written.items():
        assert torch.equal(tensor, expected[key]), key


AC_FAMILIES = ("llama", "qwen3", "gpt2", "mixtral")  # gpt2 hands its blocks the cache by position


def _checkpointing_on_padded_batches(model_dirs: dict) -> dict:
    """Every way into the engine, each family's config saying `use_cache` (its default), padded
    batches: activation checkpointing on against off."""
    from fullshard import from_pretrained

    entries = {
        "FSDP2Engine": lambda name, config: FSDP2Engine(config).prepare_model(build_model(name)),
        "apply_fsdp2": lambda name, config: apply_fsdp2(build_model(name), **config),
        "from_pretrained": lambda name, config: from_pretrained(model_dirs[name], engine=FSDP2Engine(config)),
    }
    gaps = {}
    for entry, make in entries.items():
        for name in AC_FAMILIES:
            plain, checkpointed = (train_on_padded_batches(name, lambda: make(name, {"activation_checkpointing": ac}))
                                   for ac in (False, True))
            gaps[(entry, name)] = largest_gap(plain, checkpointed)
    return gaps


def test_activation_checkpointing_on_padded_batches_equals_the_run_without(tmp_path):
    # before: "The size of tensor a (32) must match the size of tensor b (16)": the recompute wrote the cache twice
    model_dirs = {}
    for name in AC_FAMILIES:
        model_dirs[name] = str(tmp_path / name)
        build_model(name).save_pretrained(model_dirs[name])
    for rank, gaps in enumerate(run_distributed(_checkpointing_on_padded_batches, 2, model_dirs)):
        assert len(gaps) == 3 * len(AC_FAMILIES)
        assert all(gap < 1e-6 for gap in gaps.values()), (rank, gaps)
