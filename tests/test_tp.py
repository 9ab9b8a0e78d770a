"""Tensor parallelism composed with FSDP2 on one mesh, against a single process on the whole batch.

Every 4-rank check runs inside one spawned process group (`_world_4_checks`).
"""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from harness.compare import data_slice, full_tensor, reference_gaps, train_against_reference
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FSDP2Engine, apply_fsdp2
from fullshard.distributed import ParallelDims
from fullshard.errors import ConfigError, PlanError
from fullshard.optim import clip_grad_norm, global_grad_norm
from fullshard.testing import build_model, make_batch, reported_by_every_rank, run_distributed
from fullshard.testing.zoo import TIED

TOL = 1e-5
BF16_LOSS_TOL = 5e-2  # the engine tests' bound for bf16 compute against an fp32 reference
PARITY_MODELS = ["llama", "qwen3", "mistral", "gemma", "mixtral"]
LLAMA_LAYER_PLAN = {f"model.layers.*.{m}": s for m, s in {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}.items()}
# Qwen3 without its per-head norms in the plan: their gradients stay per-rank partial sums
QWEN3_WITHOUT_NORM_STYLE = LLAMA_LAYER_PLAN
BAD_TP = {
    # case -> (model, model overrides, engine config, text the error must contain)
    "unknown_style": ("llama", {}, {"tp_plan": {"model.layers.*.mlp.up_proj": "diagonal"}},
                      "tp_plan entry 'model.layers.*.mlp.up_proj': unknown style 'diagonal'"),
    "matches_nothing": ("llama", {}, {"tp_plan": {"model.layers.*.mlp.fc9": "colwise"}},
                        "tp_plan entry 'model.layers.*.mlp.fc9': pattern matches no module"),
    "heads": ("llama", {"num_key_value_heads": 1}, {"tp_plan": "auto"},
              "num_key_value_heads=1 is not divisible by tp_size=2"),
    "split_dim": ("llama", {"intermediate_size": 63}, {"tp_plan": "auto"},
                  "model.layers.0.mlp.gate_proj.weight dim 0 is 63, not divisible by tp_size=2"),
    "tied_split": ("qwen3", {"vocab_size": 102}, {"tp_plan": {"lm_head": "colwise_gather_output"}}, "would split the tied weight"),
}
# LoRA: a PEFT-wrapped layer splits its base layer and one adapter factor, with colwise or rowwise only,
# and without dropout where the adapter's input is whole on every tp rank
LORA_PLANS = {"lora_style": ({"base_model.model.model.layers.*.self_attn.q_proj": "colwise_gather_output"}, 0.0),
              "lora_dropout": ("auto", 0.1)}
LORA_MESSAGES = {"lora_style": "'base_model.model.model.layers.0.self_attn.q_proj' carries LoRA adapters, which split "
                               "only with colwise or rowwise, not 'colwise_gather_output'",
                 "lora_dropout": "LoRA dropout 0.1 on 'base_model.model.model.layers.0.self_attn.q_proj' would drop "
                                 "other inputs on each tp rank"}
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # colwise and rowwise layers


def _engine(**config):
    return FSDP2Engine(dict({"mixed_precision": "fp32", "tp_size": 2}, **config))


def _train(engine, name, **kwargs):
    coords = engine.dims.coordinates(dist.get_rank())
    return train_against_reference(name, engine.prepare_model, dp_rank=coords["dp"], dp_size=engine.dims.dp_size,
                                   **kwargs)


def _parity():
    engine = _engine()
    results = {("dp2_tp2", name): _train(engine, name) for name in PARITY_MODELS}
    hsdp = _engine(dp_replicate=2)
    results.update({("hsdp_1x2_tp2", name): _train(hsdp, name) for name in ("llama", "qwen3")})
    # seed 003's face: the caller's ("fsdp", "tp") mesh, TP on the dim named tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    results[("seed003_fsdp_tp_mesh", "qwen3")] = train_against_reference(
        "qwen3", lambda m: apply_fsdp2(m, mesh, {"mode": "auto"}, mixed_precision="fp32"),
        dp_rank=mesh.get_local_rank("fsdp"), dp_size=2)
    # the vocabulary split too (untied Llama, vocab 102): embedding_rowwise and colwise_gather_output
    vocab_split = _engine(tp_plan=dict(LLAMA_LAYER_PLAN, **{"model.embed_tokens": "embedding_rowwise",
                                                             "lm_head": "colwise_gather_output"}))
    results[("dp2_tp2_vocab_split", "llama")] = _train(vocab_split, "llama", model_kwargs={"vocab_size": 102})
    checkpointed = _engine(activation_checkpointing=True)
    results.update({("dp2_tp2_activation_checkpointing", name): _train(checkpointed, name) for name in ("llama", "qwen3")})
    return results


def _bf16():
    return {name: _train(_engine(mixed_precision="bf16"), name) for name in ("llama", "gemma")}


def _norm_trap():
    """The same training with Qwen3's q_norm / k_norm left out of the plan: must drift."""
    return _train(_engine(tp_plan=QWEN3_WITHOUT_NORM_STYLE), "qwen3")


def _layout():
    """What one rank holds: a colwise weight split over dp and tp, a norm split over dp only."""
    engine = _engine()
    model = engine.prepare_model(build_model("qwen3"))
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    return {
        "q_proj": (tuple(q_proj.device_mesh.mesh_dim_names), q_proj.to_local().numel() * 4 == q_proj.numel()),
        "q_norm": (tuple(q_norm.device_mesh.mesh_dim_names), q_norm.to_local().numel() * 2 == q_norm.numel()),
        "assigned": engine.tp_assignments["model.layers.0.self_attn.q_norm"],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def _clipping(name="llama", max_norm=0.05):
    """Global grad-norm clipping over the whole (dp, tp) mesh clips exactly like one process."""
    engine = _engine()
    coords = engine.dims.coordinates(dist.get_rank())
    reference, model = build_model(name), engine.prepare_model(build_model(name))
    batch = make_batch(name, batch_size=4, seed=7)
    reference(**batch).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
    model(**data_slice(batch, coords["dp"], engine.dims.dp_size)).loss.backward()
    norm = clip_grad_norm(model.parameters(), max_norm)
    ref_grads = dict((n, p.grad) for n, p in reference.named_parameters())
    diff = max((full_tensor(p.grad) - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
    return {"norm": norm, "ref_norm": ref_norm, "grad_diff": diff}


def _bad_plans():
    messages = {}
    for case, (name, overrides, config, _) in BAD_TP.items():
        try:
            _engine(**config).prepare_model(build_model(name, **overrides))
            messages[case] = None
        except PlanError as error:
            messages[case] = str(error)
    try:
        _engine(tp_size=3)
    except ConfigError as error:
        messages["world"] = str(error)
    for case, (plan, dropout) in LORA_PLANS.items():
        try:
            _engine(tp_plan=plan).prepare_model(_lora_llama(lora_dropout=dropout))
            messages[case] = None
        except PlanError as error:
            messages[case] = str(error)
    return messages


def _lora_llama(model=None, **lora):
    from peft import LoraConfig

    from fullshard.lora import apply_lora

    torch.manual_seed(0)  # the adapters' init: the same in the reference and the sharded model
    return apply_lora(model or build_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, **lora))


def _lora_tp():
    """LoRA with tp_plan auto: the model's own plan mapped through PEFT's wrapper; one process's training."""
    engine = _engine()

    def layout(model):
        attn, mlp = model.base_model.model.model.layers[0].self_attn, model.base_model.model.model.layers[0].mlp
        return {"assigned": {k: v for k, v in engine.tp_assignments.items() if ".layers.0." in k},
                "q_B": tuple(attn.q_proj.lora_B["default"].weight.device_mesh.mesh_dim_names),
                "q_A": tuple(attn.q_proj.lora_A["default"].weight.device_mesh.mesh_dim_names),
                "down_A": tuple(mlp.down_proj.lora_A["default"].weight.device_mesh.mesh_dim_names)}

    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = _train(engine, "llama", prepare=_lora_llama, check_tie=False, inspect=layout)
    result["warnings"] = [str(w.message) for w in seen]
    return result


def _world_4_checks():
    return {"parity": _parity(), "bf16": _bf16(), "trap": _norm_trap(), "layout": _layout(), "clip": _clipping(),
            "bad": _bad_plans(), "lora": _lora_tp()}


@pytest.fixture(scope="module")
def world_4():
    return run_distributed(_world_4_checks, 4)


def _diff(r):
    return (*reference_gaps(r), r["max_weight_diff"])


def test_dp2_tp2_and_hsdp_tp2_match_single_process(world_4):
    for rank, result in enumerate(world_4):
        bad = []
        for key, r in result["parity"].items():
            if max(_diff(r)) > TOL or r["missing"]:
                bad.append(f"rank {rank} {key}: loss/norm/weight diffs {_diff(r)} ({r['worst_weight']}) {r['missing']}")
            if key[1] in TIED and not all(r["tied"]):
                bad.append(f"rank {rank} {key}: tie broken")
        assert not bad, "\n".join(bad)


def test_lora_with_tp_plan_auto_matches_single_process(world_4):
    """The plan's patterns did not match PEFT's wrapped names: LoRA with tp_plan auto failed."""
    for rank, result in enumerate(world_4):
        r = result["lora"]
        assert max(_diff(r)) < TOL and not r["missing"], (rank, _diff(r), r["worst_weight"], r["missing"])
        assert r["ref_loss"][-1] < r["ref_loss"][0]  # the adapters trained, so the comparison could fail
        layer = "base_model.model.model.layers.0"
        assert r["inspect"]["assigned"] == {
            **{f"{layer}.self_attn.{m}.{part}": "colwise" for m in ("q_proj", "v_proj")
               for part in ("base_layer", "lora_B.default")},
            f"{layer}.self_attn.k_proj": "colwise",
            **{f"{layer}.self_attn.o_proj.{part}": "rowwise" for part in ("base_layer", "lora_A.default")},
            f"{layer}.mlp.gate_proj": "colwise",
            **{f"{layer}.mlp.up_proj.{part}": "colwise" for part in ("base_layer", "lora_B.default")},
            **{f"{layer}.mlp.down_proj.{part}": "rowwise" for part in ("base_layer", "lora_A.default")},
        }
        # the split factor lives on both dims, the whole one on dp only
        assert r["inspect"]["q_B"] == ("dp_shard", "tp") and r["inspect"]["down_A"] == ("dp_shard", "tp")
        assert r["inspect"]["q_A"] == ("dp_shard",)
        assert not r["warnings"], r["warnings"]


def test_bf16_compute_on_the_2d_mesh_tracks_fp32_reference(world_4):
    for result in world_4:
        for name, r in result["bf16"].items():
            assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < BF16_LOSS_TOL, name


def test_qwen3_norms_without_grad_allreduce_drift(world_4):
    # the control for the check above: the replicated_with_grad_allreduce style is what keeps Qwen3 exact
    assert world_4[0]["trap"]["max_weight_diff"] > 1e-3
    assert world_4[0]["trap"]["worst_weight"].endswith(("q_norm.weight", "k_norm.weight"))


def test_layout_splits_over_both_dims(world_4):
    layout = world_4[0]["layout"]
    assert layout["q_proj"] == (("dp_shard", "tp"), True)
    assert layout["q_norm"] == (("dp_shard", "tp"), True)  # replicated over tp, sharded over dp
    assert layout["assigned"] == "replicated_with_grad_allreduce"
    assert layout["tied"]


def test_global_clipping_reduces_over_whole_mesh(world_4):
    for result in world_4:
        clip = result["clip"]
        assert clip["norm"] == pytest.approx(clip["ref_norm"], abs=TOL)
        assert clip["ref_norm"] > 0.05  # the clip did act
        assert clip["grad_diff"] < TOL


@pytest.mark.parametrize("case", [*BAD_TP, *LORA_PLANS, "world"])
def test_plan_errors_named_on_every_rank(world_4, case):
    expected = {**{k: v[3] for k, v in BAD_TP.items()}, **LORA_MESSAGES,
                "world": "world size 4 is not divisible by dp_replicate=1 x tp=3 = 3"}[case]
    for result in world_4:
        message = result["bad"][case]
        assert message is not None and expected in message, message
        if case != "world":
            assert reported_by_every_rank(message, 4), message


def test_parallel_dims_tp_cp_layout():
    dims = ParallelDims(dp_replicate=2, world_size=16, cp=2, tp=2)
    assert (dims.dp_shard, dims.dp_size, dims.fsdp_shard_size) == (2, 4, 4)
    # row-major over (pp, dp_replicate, dp_shard, cp, tp): tp neighbours are adjacent ranks
    assert dims.coordinates(0b1011) == {"dp": 2, "dp_replicate": 1, "dp_shard": 0, "cp": 1, "tp": 1, "pp": 0}
    staged = ParallelDims(dp_replicate=2, world_size=32, cp=2, tp=2, pp=2)
    assert staged.coordinates(16 + 0b1011) == {**dims.coordinates(0b1011), "pp": 1}
    with pytest.raises(ConfigError, match="dp_replicate=1 x dp_shard=3 x tp=2 = 6, but the world size is 4"):
        ParallelDims(dp_shard=3, world_size=4, tp=2)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by dp_replicate=1 x cp=2 x tp=2 = 4"):
        ParallelDims(world_size=6, cp=2, tp=2)


# ------------------------------------------------------------------ loading and checkpoints on the 2-D mesh

K = 3  # steps before and after the save
CKPT_MODEL = "qwen3"  # tied, with the per-head norms: the hardest layout to carry through a checkpoint


def _engine_for(layout: str):
    tp = 2 if "tp2" in layout else 1
    return FSDP2Engine({"mixed_precision": "fp32", "tp_size": tp})


def _steps(engine, model, optimizer, first: int, count: int) -> list[float]:
    """Steps on fixed global batches (seeded by step), each dp rank its slice: any layout sees the same data."""
    coords = engine.dims.coordinates(dist.get_rank())
    losses = []
    for step in range(first, first + count):
        batch = make_batch(CKPT_MODEL, batch_size=4, seed=1000 + step)
        loss = model(**data_slice(batch, coords["dp"], engine.dims.dp_size)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # tp ranks repeat their dp rank's loss, so the world mean is the dp mean
        losses.append(float(total) / dist.get_world_size())
    return losses


def _ckpt_setup(layout: str, seed: int = 0):
    engine = _engine_for(layout)
    model = engine.prepare_model(build_model(CKPT_MODEL, seed=seed))
    return engine, model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _save_at_dp2_tp2(tmp: str, hf_dir: str) -> dict:
    from harness.compare import full_state
    from test_checkpoint import _full_train_state

    from fullshard.checkpoint import CheckpointManager, export_hf

    engine, model, optimizer = _ckpt_setup("dp2_tp2")
    first = _steps(engine, model, optimizer, 0, K)
    CheckpointManager(f"{tmp}/ckpt").save(K, model, optimizer)
    saved = _full_train_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(saved, f"{tmp}/saved_state.pt")
    nxt = _steps(engine, model, optimizer, K, K)
    with redistribute_warnings() as warned:
        model(**make_batch(CKPT_MODEL, batch_size=2)).loss.backward()
        global_grad_norm(model.parameters())  # each group's norm reduced over dp and tp
        optimizer.zero_grad()
        export_hf(model, f"{tmp}/export")  # every rank gathers one tensor at a time; none holds the model
    return {"first": first, "next": nxt, "exported": full_state(model), "load": _load_sliced(hf_dir),
            "export_warnings": warned}


@contextlib.contextmanager
def redistribute_warnings():
    """What DTensor logs about redistributions inside the block (its warnings, once per layout, start over)."""
    import logging

    from torch.distributed.tensor import _redistribute

    _redistribute._warned_flatten_issues.clear()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    _redistribute.logger.addHandler(handler)
    try:
        yield seen
    finally:
        _redistribute.logger.removeHandler(handler)


def _resume(tmp: str, layout: str) -> dict:
    from test_checkpoint import _full_train_state

    from fullshard.checkpoint import CheckpointManager

    engine, model, optimizer = _ckpt_setup(layout, seed=5)  # other weights: the checkpoint must replace them
    CheckpointManager(f"{tmp}/ckpt").load(model, optimizer)
    saved, loaded = torch.load(f"{tmp}/saved_state.pt", weights_only=True), _full_train_state(model, optimizer)
    different = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
    return {"different": different, "keys_match": set(saved) == set(loaded),
            "next": _steps(engine, model, optimizer, K, K)}


def _load_sliced(hf_dir: str) -> dict:
    """`from_pretrained` straight into dp2 x tp2 shards against transformers' own load."""
    from harness.compare import full_state

    from fullshard import from_pretrained
    from fullshard.testing.zoo import model_class

    model = from_pretrained(hf_dir, engine=_engine_for("dp2_tp2"))
    reference = model_class(CKPT_MODEL).from_pretrained(hf_dir)
    weights, ref_weights = full_state(model), dict(reference.named_parameters())
    batch = make_batch(CKPT_MODEL, batch_size=2, seq_len=8)
    with torch.no_grad():
        logits, ref_logits = model(**batch).logits, reference(**batch).logits
    # what this rank may read: each tensor's share over the ranks it is split across, plus one
    # slice along its split dim (uneven splits); a tensor split over none is read whole
    allowance = 0
    for t in {id(t): t for t in model.state_dict().values()}.values():
        shards = [(t.device_mesh.size(i), pl.dim) for i, pl in enumerate(t.placements) if pl.is_shard()]
        split = math.prod(n for n, _ in shards) if shards else 1
        allowance += t.numel() * t.element_size() // split + (t.numel() // t.shape[shards[0][1]] * t.element_size() if shards else 0)
    return {"weights_equal": set(weights) == set(ref_weights) and all(torch.equal(weights[k], ref_weights[k]) for k in weights),
            "logits_diff": (logits - ref_logits).abs().max().item(),
            "bytes_read": model.fullshard_load_report.bytes_read, "allowance": allowance,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_ckpt")
    hf_dir = tmp / "hf"
    build_model(CKPT_MODEL, seed=1).save_pretrained(hf_dir)
    return str(tmp), run_distributed(_save_at_dp2_tp2, 4, str(tmp), str(hf_dir))


def test_sliced_load_into_tp_fsdp_shards(saved):
    for rank, result in enumerate(saved[1]):
        load = result["load"]
        assert load["weights_equal"] and load["tied"], f"rank {rank}"
        # rowwise TP sums each matmul in two halves, so logits agree to rounding, not bit for bit
        assert load["logits_diff"] < 1e-6, f"rank {rank}: {load['logits_diff']}"
        assert load["bytes_read"] <= load["allowance"], f"rank {rank}: {load}"


def test_export_from_dp2_tp2_loads_in_plain_transformers(saved):
    from fullshard.testing.zoo import model_class

    tmp, first_life = saved
    exported = model_class(CKPT_MODEL).from_pretrained(f"{tmp}/export")
    trained = first_life[0]["exported"]
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert {n: p for n, p in exported.named_parameters()}.keys() == trained.keys()
    assert all(torch.equal(p, trained[n]) for n, p in exported.named_parameters())
    # the grad norm over dp x tp and the export's gathers of FSDP x TP's _StridedShard weights warned on every rank
    assert all(not r["export_warnings"] for r in first_life), first_life[0]["export_warnings"]


@pytest.mark.parametrize("layout, world", [("dp4", 4), ("dp1_tp2", 2), ("world1", 1)])
def test_checkpoint_from_dp2_tp2_resumes_on(saved, layout, world):
    tmp, first_life = saved
    for rank, result in enumerate(run_distributed(_resume, world, tmp, layout)):
        assert result["keys_match"] and not result["different"], f"rank {rank}: {result['different']}"
        assert result["next"] == pytest.approx(first_life[0]["next"], abs=TOL), f"rank {rank}"
