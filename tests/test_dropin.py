"""Code and configs written for the seeds run unchanged, exactly: every checkpoint resumes (state that
was legitimately absent stays absent), LLaMA-Factory's engine configs, meta models and rank-0
initialisation, transformers' plan forms, and tail units found the way the model defines them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from test_checkpoint import _captured_warnings, _error_of

from fullshard import build_plan
from fullshard.engine import EngineConfig
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.testing.zoo import model_class, tiny_config

K = 3  # steps before and after the save


# ---------------------------------------------------------------------------- helpers (run on ranks)


def _held(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered to a plain tensor (a collective)."""
    from harness.compare import full_state

    return {**full_state(model), **{f"buffer/{k}": v.detach().clone() for k, v in model.named_buffers()}}


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


# -- item 1: a resume restores what was saved and leaves absent optimizer state absent

SILENT = "model.layers.1.self_attn"  # gets no gradient before the save (a module not yet in the loss)
AVOIDED_EXPERT = 3  # no token is routed to it before the save


def _avoid_expert(router, args, output):
    """Route as the router does, but never to AVOIDED_EXPERT (a router that sends it no token)."""
    logits, _, _ = output
    masked = logits.clone()
    masked[:, AVOIDED_EXPERT] = float("-inf")
    probs = torch.softmax(masked, dim=-1, dtype=torch.float)
    top, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


def _moe_model(seed: int):
    from fullshard import FSDP2Engine

    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model("qwen3_moe", seed=seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _steps(model, optimizer, first: int, count: int, early: bool) -> list[float]:
    """`count` steps from step `first`; `early`: the steps before the save (silent module, avoided expert)."""
    import torch.distributed as dist
    from harness.compare import data_slice

    from fullshard.distributed import get_rank, get_world_size

    hooks = [m.register_forward_hook(_avoid_expert) for n, m in model.named_modules()
             if n.endswith("mlp.gate")] if early else []
    losses = []
    for step in range(first, first + count):
        batch = data_slice(make_batch("qwen3_moe", batch_size=4, seed=step), get_rank(), get_world_size())
        loss = model(**batch).loss
        loss.backward()
        if early:
            for name, param in model.named_parameters():
                if name.startswith(SILENT):
                    param.grad = None
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    for hook in hooks:
        hook.remove()
    return losses


def _optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    from harness.compare import full_tensor
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {f"{fqn}/{key}": full_tensor(value).clone()
            for fqn, per_param in get_optimizer_state_dict(model, optimizer)["state"].items()
            for key, value in per_param.items()}


def _resume_with_absent_state(tmp: Path) -> dict:
    from fullshard.checkpoint import CheckpointManager

    reference, ref_opt = _moe_model(seed=0)
    _steps(reference, ref_opt, 0, K, early=True)
    ref_stateless = sorted(n for n, p in reference.named_parameters() if p not in ref_opt.state)
    ref_losses = _steps(reference, ref_opt, K, K, early=False)

    model, optimizer = _moe_model(seed=0)
    _steps(model, optimizer, 0, K, early=True)
    manager = CheckpointManager(tmp / "absent")
    manager.save(K, model, optimizer)
    resumed, res_opt = _moe_model(seed=5)  # other weights: the load must bring every one
    manager.load(resumed, res_opt)
    stateless = sorted(n for n, p in resumed.named_parameters() if p not in res_opt.state)
    losses = _steps(resumed, res_opt, K, K, early=False)
    return {"ref_stateless": ref_stateless, "stateless": stateless, "losses": (ref_losses, losses),
            "weights": _same(_held(reference), _held(resumed)),
            "optimizer": _same(_optimizer_state(reference, ref_opt), _optimizer_state(resumed, res_opt))}


# -- item 2: FSDPStrategy.load_ckpt of a checkpoint written without the strategy's state

def _strategy_loads_a_manager_checkpoint(tmp: Path) -> dict:
    from fullshard import FSDP2Engine
    from fullshard.checkpoint import CheckpointManager
    from fullshard.strategy import FSDPStrategy

    def llama(seed, **overrides):
        model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model("llama", seed=seed, **overrides))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)

    model, optimizer, _ = llama(0)
    CheckpointManager(tmp / "manager").save(4, model, optimizer, extra_state={"global_step": 4})
    loaded, loaded_opt, scheduler = llama(1)
    strategy = FSDPStrategy(bf16=False)
    counters = strategy.state_dict()
    with _captured_warnings() as warned:
        path, client = strategy.load_ckpt(loaded, tmp / "manager", optimizer=loaded_opt, scheduler=scheduler)
    other, other_opt, _ = llama(1, attention_bias=True)  # weights the checkpoint does not hold
    return {"client": client, "weights": _same(_held(model), _held(loaded)), "warned": warned,
            "counters": (counters, strategy.state_dict()),
            "missing_weights": _error_of(lambda: FSDPStrategy(bf16=False).load_ckpt(other, tmp / "manager",
                                                                                    optimizer=other_opt))}


# -- item 3: a meta model built the LLaMA-Factory way (accelerate.init_empty_weights + from_config)

def _save_pretrained(tmp: Path, name: str) -> Path:
    import torch.distributed as dist

    from fullshard.distributed import get_rank

    path = tmp / f"hf_{name}"
    if get_rank() == 0:
        build_model(name, seed=7).save_pretrained(path)
    dist.barrier()
    return path


def _llamafactory_meta_model(path: Path) -> dict:
    import accelerate

    from fullshard import FSDP2Engine

    config = transformers.AutoConfig.from_pretrained(path)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model._init_mode = "init_on_meta"
    untied_before = model.lm_head.weight is not model.model.embed_tokens.weight
    engine = FSDP2Engine({"name": "fsdp2", "reshard_after_forward": True, "offload_params": False,
                          "pin_memory": True, "dcp_path": None})  # LLaMA-Factory's FSDP2Params, as a dict
    model = engine.shard_model(model)  # the weights named by config.name_or_path, as LLaMA-Factory does
    normal = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {"untied_before": untied_before, "tied_after": model.lm_head.weight is model.model.embed_tokens.weight,
            "weights": _same(_held(model), _held(normal))}


# -- item 5: rank-0 initialisation (rank 0 loaded, the others on meta)

def _meta_elsewhere(name: str, seed: int, how: str, **overrides):
    """Rank 0: the model with its weights; other ranks: the same model on meta, built `how`."""
    import accelerate

    from fullshard.distributed import get_rank
    from fullshard.loading import meta_init

    if get_rank() == 0:
        return build_model(name, seed=seed)
    contexts = {"accelerate": accelerate.init_empty_weights, "meta_init": meta_init,
                "torch": lambda: torch.device("meta")}
    with contexts[how]():
        return model_class(name)._from_config(tiny_config(name, **overrides))


def _rank0_init() -> dict:
    from fullshard import FSDP2Engine
    from fullshard.strategy import FSDPStrategy

    out = {}
    for name, how in (("llama", "torch"), ("qwen3", "accelerate"), ("gpt2", "meta_init")):
        normal = build_model(name, seed=11)
        model = FSDP2Engine({"mixed_precision": "fp32"}).shard_model(_meta_elsewhere(name, 11, how))
        batch = make_batch(name, batch_size=2)
        with torch.no_grad():
            loss = (float(model(**batch).loss), float(normal(**batch).loss))
        out[name] = {"weights": _same(_held(model), _held(normal)), "loss": loss,
                     "tied": name == "llama"
                     or model.get_output_embeddings().weight is model.get_input_embeddings().weight}
    # LightRFT's way: the strategy's prepare_model
    strategy = FSDPStrategy(bf16=False, train_batch_size=2)
    model = strategy.prepare_model(_meta_elsewhere("llama", 12, "torch"), is_training=True)
    out["strategy"] = _same(_held(model), _held(build_model("llama", seed=12)))
    # what cannot be done: one error on every rank, before any collective of sharding
    from fullshard.distributed import get_rank

    if get_rank() == 1:
        flipped = build_model("llama")
    else:
        with torch.device("meta"):
            flipped = model_class("llama")._from_config(tiny_config("llama"))
    out["flipped"] = _error_of(lambda: FSDP2Engine().shard_model(flipped))
    out["differs"] = _error_of(lambda: FSDP2Engine().shard_model(
        _meta_elsewhere("llama", 0, "torch", intermediate_size=48)))
    out["tp"] = _error_of(lambda: FSDP2Engine({"tp_size": 2, "dp_shard": 1}).shard_model(
        _meta_elsewhere("llama", 0, "torch")))
    return out


# -- item 6: transformers' plan forms train as fullshard's own plan does

def _transformers_plans_train() -> dict:
    from harness.compare import train_against_reference

    from fullshard import apply_fsdp2

    out = {}
    for name, plan in (("qwen3", PEER_PLANS["qwen3"]), ("llama", PEER_PLANS["llama"])):
        tied = name == "qwen3"
        theirs = train_against_reference(name, lambda m: apply_fsdp2(m, fsdp_plan=plan), steps=3, check_tie=tied)
        ours = train_against_reference(name, lambda m: apply_fsdp2(m, fsdp_plan="auto"), steps=3, check_tie=tied)
        out[name] = (theirs, ours)
    return out


def _world_2(tmp: str) -> bytes:
    import io

    tmp = Path(tmp)
    out = {"resume": _resume_with_absent_state(tmp), "strategy": _strategy_loads_a_manager_checkpoint(tmp),
           "llamafactory_meta": _llamafactory_meta_model(_save_pretrained(tmp, "qwen3")),
           "rank0": _rank0_init(), "plans": _transformers_plans_train()}
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def _world_3() -> dict:
    from fullshard import FSDP2Engine

    out = {}
    for name, how in (("llama", "meta_init"), ("qwen3", "accelerate")):
        model = FSDP2Engine({"mixed_precision": "fp32"}).shard_model(_meta_elsewhere(name, 13, how))
        out[name] = _same(_held(model), _held(build_model(name, seed=13)))
    return out


@pytest.fixture(scope="module")
def world_2(tmp_path_factory):
    import io

    results = run_distributed(_world_2, 2, str(tmp_path_factory.mktemp("dropin")))
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


# ---------------------------------------------------------------------------- item 1


def test_a_resume_leaves_state_that_was_never_saved_absent_and_continues_exactly(world_2):
    for r in world_2:
        res = r["resume"]
        assert any(n.startswith(SILENT) for n in res["ref_stateless"]), res["ref_stateless"]
        assert res["stateless"] == res["ref_stateless"], "as a fresh optimizer: no state for what had no gradient"
        ref_losses, losses = res["losses"]
        assert losses == ref_losses
        assert res["weights"] == [] and res["optimizer"] == [], (res["weights"], res["optimizer"])


# ---------------------------------------------------------------------------- item 2


def test_strategy_loads_a_checkpoint_saved_without_its_counters(world_2):
    for r in world_2:
        res = r["strategy"]
        assert res["weights"] == [] and res["client"] == {"global_step": 4, "step": 4}
        assert res["counters"][0] == res["counters"][1], "the counters keep their current values"
    warned = " | ".join(world_2[0]["strategy"]["warned"])
    assert "holds no 'strategy' state" in warned and "saved without a scheduler" in warned, warned
    for r in world_2:  # missing model weights stay an error
        assert "does not fit this model: missing from the checkpoint: model.layers.0.self_attn" in \
            r["strategy"]["missing_weights"], r["strategy"]["missing_weights"]


# ---------------------------------------------------------------------------- items 3, 4


def test_a_llamafactory_meta_model_of_a_tied_config_loads_tied_and_exact(world_2):
    for r in world_2:
        res = r["llamafactory_meta"]
        assert res["untied_before"], "accelerate's init_empty_weights unties; the engine must tie again"
        assert res["tied_after"] and res["weights"] == [], res


@dataclass
class FSDP2Params:
    """LLaMA-Factory's own config object for its fsdp2 plugin (its fields, as it declares them)."""

    name: str = "fsdp2"
    reshard_after_forward: bool = True
    offload_params: bool = False
    pin_memory: bool = True
    dcp_path: str | None = None


class PluginConfig(dict):
    """LLaMA-Factory's `PluginConfig`: a dict with its plugin's name."""

    @property
    def name(self) -> str:
        return self["name"]


def test_llamafactory_engine_configs_are_accepted_and_their_unused_keys_named_once():
    with _captured_warnings() as warned:
        from_object = EngineConfig.from_any(FSDP2Params(reshard_after_forward=False))
        from_plugin = EngineConfig.from_any(PluginConfig(name="fsdp2", mixed_precision="bf16", pin_memory=False))
        with_flag = EngineConfig.from_any({"name": "fsdp2", "dcp_path": None}, bf16=True)
    assert from_object.reshard_after_forward is False and from_plugin.mixed_precision == "bf16"
    assert from_plugin.pin_memory is False and with_flag.mixed_precision == "bf16"
    assert len(warned) == 1 and "['name']" in warned[0], warned
    with pytest.raises(ValueError, match=r"unknown dist_config keys \['bogus'\]"):
        EngineConfig.from_any({"name": "fsdp2", "bogus": 1})
    with pytest.raises(ValueError, match="bf16 asks for fp32 but mixed_precision='bf16'"):
        EngineConfig.from_any({"mixed_precision": "bf16"}, bf16=False)


def test_llamafactory_forms_are_a_face_the_engine_reads():
    """LLaMA-Factory's forms live in `fullshard.faces.llamafactory`; the engine's old names still import."""
    from dataclasses import asdict

    from fullshard import engine
    from fullshard.faces import llamafactory

    assert engine.SEED_ONLY_KEYS is llamafactory.LLAMAFACTORY_ONLY_KEYS
    params = asdict(FSDP2Params(reshard_after_forward=False))  # its `name` is dropped (named once, above)
    assert llamafactory.engine_values(FSDP2Params(reshard_after_forward=False), bf16=True) == {
        **{k: v for k, v in params.items() if k != "name"}, "mixed_precision": "bf16"}
    assert EngineConfig.values_of(PluginConfig(tp_size=2)) == {"tp_size": 2}


# ---------------------------------------------------------------------------- item 5


def test_rank0_initialisation_equals_a_normal_load(world_2):
    for r in world_2:
        res = r["rank0"]
        for name in ("llama", "qwen3", "gpt2"):
            assert res[name]["weights"] == [] and res[name]["tied"], (name, res[name])
            loss, normal = res[name]["loss"]
            assert abs(loss - normal) < 1e-5, (name, loss, normal)
        assert res["strategy"] == []


def test_rank0_initialisation_refuses_what_it_cannot_do_on_every_rank(world_2):
    for r in world_2:
        res = r["rank0"]
        assert "rank 0: meta; rank 1: loaded" in res["flipped"], res["flipped"]
        assert "its model on meta differs from rank 0's loaded model: ('model.layers.0.mlp.gate_proj.weight', " \
               "(48, 32)" in res["differs"] and "rank 1" in res["differs"], res["differs"]
        assert "cannot do with tensor parallelism" in res["tp"], res["tp"]


def test_rank0_initialisation_at_world_3():
    for result in run_distributed(_world_3, 3):
        assert result == {"llama": [], "qwen3": []}, result


# ---------------------------------------------------------------------------- item 6


PEER_PLANS = {  # transformers' FSDP test mixin's manual plans: containers, and the tied embedding without its head
    "llama": {"model.embed_tokens": "free_full_weight", "model.layers": "free_full_weight",
              "model.norm": "keep_full_weight", "lm_head": "keep_full_weight"},
    "qwen3": {"model.layers": "free_full_weight", "model.norm": "keep_full_weight",
              "model.embed_tokens": "keep_full_weight"},
}


def _units(plan) -> set:
    """Each unit's modules and policies; a reshard policy left to the engine is its default, True."""
    return {(frozenset(u.modules), u.reshard_after_forward is not False, u.cpu_offload, u.mixed_precision)
            for u in plan.units}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_transformers_plans_mean_what_they_mean_in_transformers(name):
    model = build_model(name)
    # the test mixin's flat plan is fullshard's own auto plan
    assert _units(build_plan(model, PEER_PLANS[name])) == _units(build_plan(model, "auto"))
    # seed 003's manual mode: a container is its children; a tied embedding brings its head
    theirs = {"model.embed_tokens": ["free_full_weight"], "model.layers": ["free_full_weight", "cpu_offload"],
              "model.norm": ["keep_full_weight"]}
    ours = {"model.embed_tokens" + (" + lm_head" if name == "qwen3" else ""): ["free_full_weight"],
            "model.layers.*": ["free_full_weight", "cpu_offload"], "model.norm": ["keep_full_weight"]}
    plan = build_plan(model, {"mode": "manual", "modules": theirs})
    assert _units(plan) == _units(build_plan(model, {"mode": "manual", "modules": ours}))
    if name == "qwen3":
        assert "tied: model.embed_tokens.weight = lm_head.weight: one tensor, in unit model.embed_tokens + lm_head" \
            in plan.describe(model)
    # the other forms: {"modules": ...} without a mode, auto policies without a mode, tuple keys
    assert _units(build_plan(model, {"modules": theirs})) == _units(plan)
    assert _units(build_plan(model, {"mixed_precision": True})) == _units(build_plan(model, {
        "mode": "auto", "mixed_precision": True}))
    grouped = build_plan(model, {("model.norm", "lm_head"): "keep_full_weight", "model.layers": "free_full_weight"})
    assert frozenset({"model.norm", "lm_head"} | ({"model.embed_tokens"} if name == "qwen3" else set())) in \
        {frozenset(u.modules) for u in grouped.units}


def test_transformers_plans_train_as_fullshards_own(world_2):
    for r in world_2:
        for name, (theirs, ours) in r["plans"].items():
            assert theirs["loss"] == ours["loss"] and theirs["max_weight_diff"] == ours["max_weight_diff"], name
            assert max(abs(a - b) for a, b in zip(theirs["loss"], theirs["ref_loss"])) < 1e-5, name
            assert theirs["max_weight_diff"] < 1e-5 and all(theirs["tied"]), (name, theirs["max_weight_diff"])


# ---------------------------------------------------------------------------- item 7


def test_tail_unit_holds_the_final_norm_and_head_the_model_defines():
    lfm2 = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, layer_types=["conv", "full_attention"]))
    tail = build_plan(lfm2).units[-1]
    assert set(tail.modules) == {"model.embed_tokens", "model.embedding_norm", "lm_head"}, tail
    modernbert = transformers.ModernBertDecoderForCausalLM(transformers.ModernBertDecoderConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    tail = build_plan(modernbert).units[-1]
    assert set(tail.modules) == {"model.embeddings.tok_embeddings", "model.final_norm", "lm_head", "decoder"}, tail
    assert tail.reshard_after_forward is False
