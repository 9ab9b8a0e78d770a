"""PEFT LoRA under FSDP2: adapters in their own units, trained exactly as in one process."""

import pytest
import torch
from harness.compare import data_slice, full_state, train_against_reference
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from fullshard import FSDP2Engine
from fullshard.errors import CheckpointError
from fullshard.fsdp import fsdp_units
from fullshard.testing import build_model, make_batch, run_distributed

TOL = 1e-5
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def add_lora(model):
    torch.manual_seed(7)  # the same adapter init in the reference and the sharded copy
    return get_peft_model(model, LoraConfig(**LORA))


def _after_training(model):
    """Adapter gradients of one more step, base weights, and the units fully_shard built."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model(**data_slice(make_batch("llama", seed=100), rank, world)).loss.backward()
    grad_norms = {n: p.grad.full_tensor().norm().item() for n, p in model.named_parameters() if p.requires_grad}
    base = build_model("llama").state_dict()
    frozen = full_state(model)
    prefix = "base_model.model."
    base_diff = max((frozen[n] - base[n[len(prefix):].replace(".base_layer", "")]).abs().max().item()
                    for n, p in model.named_parameters() if not p.requires_grad)
    units = fsdp_units(model)
    mixed_units = [k for k, params in units.items() if len({p.requires_grad for p in params}) > 1]
    return {"grad_norms": grad_norms, "base_diff": base_diff, "mixed_units": mixed_units}


def _lora_checks():
    engine = FSDP2Engine({"mixed_precision": "fp32"})
    return train_against_reference("llama", engine.prepare_model, prepare=add_lora, inspect=_after_training,
                                   check_tie=False)


def test_lora_matches_single_process_and_trains_every_adapter():
    for r in run_distributed(_lora_checks, 2):
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"]))
        assert loss < TOL and r["max_weight_diff"] < TOL, (loss, r["max_weight_diff"], r["worst_weight"])
        assert r["loss"][-1] < r["loss"][0]
        info = r["inspect"]
        adapters = [n for n in info["grad_norms"] if "lora_" in n]
        assert len(adapters) == 2 * 3 * 2, adapters  # A and B, 3 targets, 2 layers
        assert all(info["grad_norms"][n] > 0 for n in adapters), info["grad_norms"]
        assert info["base_diff"] == 0.0, "frozen base weights must not move"
        assert info["mixed_units"] == [], "no unit holds both frozen and trainable parameters"


# ----------------------------------------------------------------- LoRA on fullshard's meta-device path

STEPS = 3


def _peft_reference(base_dir):
    """Plain transformers + PEFT in one process: the reference for the sharded meta-loaded copy."""
    from transformers import AutoModelForCausalLM

    return add_lora(AutoModelForCausalLM.from_pretrained(base_dir))


def _gathered_numel(fn):
    """Run `fn` and count the elements every gather of a whole DTensor in it returned."""
    from fullshard.checkpoint import export

    original, counts = export.replicated, []

    def counting(tensor):
        full = original(tensor)
        counts.append(full.numel())
        return full

    export.replicated = counting
    try:
        fn()
    finally:
        export.replicated = original
    return counts


def _meta_lora_checks(tmp):
    import fullshard
    from fullshard.lora import export_merged, save_adapter

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base_dir = f"{tmp}/base"
    reference = _peft_reference(base_dir)
    torch.manual_seed(7)  # what add_lora does before get_peft_model
    model = fullshard.from_pretrained(base_dir, engine=FSDP2Engine({"mixed_precision": "fp32"}), lora=LORA)
    out = {"kept": model.fullshard_load_report.kept, "units_mixed": [
        k for k, params in fsdp_units(model).items() if len({p.requires_grad for p in params}) > 1]}
    ref_params = dict(reference.named_parameters())
    out["init_diff"] = max((v - ref_params[k]).abs().max().item() for k, v in full_state(model).items())

    model.train(), reference.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    out["loss"], out["ref_loss"] = [], []
    for step in range(STEPS):
        batch = make_batch("llama", seed=200 + step)
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        loss = model(**data_slice(batch, rank, world)).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        out["loss"].append(float(total) / world)
        out["ref_loss"].append(float(ref_loss.detach()))
    trained = full_state(model)
    out["weight_diff"] = max((v - ref_params[k]).abs().max().item() for k, v in trained.items())
    out["adapter_moved"] = min((trained[k] - v).abs().max().item()
                               for k, v in full_state(_peft_reference(base_dir)).items() if "lora_B" in k)
    model.eval()
    probe = make_batch("llama", batch_size=2, seed=300)
    with torch.no_grad():
        out["logits"] = model(input_ids=probe["input_ids"]).logits.tolist()  # tensors do not outlive the rank
    out["adapter_gathers"] = _gathered_numel(lambda: save_adapter(model, f"{tmp}/adapter"))
    out["adapter_numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["merged_gathers"] = _gathered_numel(lambda: export_merged(model, f"{tmp}/merged", max_shard_size="20KB"))
    out["largest_tensor"] = max(p.numel() for p in model.parameters())
    out["total_numel"] = sum(p.numel() for p in model.parameters())
    out["bf16"] = _fp32_adapters_on_bf16_base(tmp)
    out["trainer"] = _trainer_with_lora(tmp)
    out["trainer_tp"] = _trainer_with_lora(tmp, "run_tp", "--fsdp.tp_size=2")
    out["trainer_pp"] = _trainer_with_lora(tmp, "run_pp", "--fsdp.pp_size=2", "--fsdp.pp_schedule=GPipe")
    out["moe"] = _moe_saves_resumes_and_exports(tmp)
    return out


def _fp32_adapters_on_bf16_base(tmp):
    """A bf16 checkpoint: the base loads in bf16, the adapters stay fp32 (PEFT's autocast), in their own units."""
    from transformers import AutoModelForCausalLM

    import fullshard

    reference = add_lora(AutoModelForCausalLM.from_pretrained(f"{tmp}/base_bf16", dtype=torch.bfloat16))
    torch.manual_seed(7)
    model = fullshard.from_pretrained(f"{tmp}/base_bf16", lora=LORA)
    ref_params = dict(reference.named_parameters())
    diff = max((v.float() - ref_params[k].float()).abs().max().item() for k, v in full_state(model).items())
    dtypes = {flag: sorted({str(p.dtype) for p in model.parameters() if p.requires_grad == flag}) for flag in (True, False)}
    model.train()
    model(**data_slice(make_batch("llama"), torch.distributed.get_rank(), 2)).loss.backward()
    return {"diff": diff, "dtypes": dtypes, "adapter_grads": all(p.grad is not None for p in model.parameters()
                                                                  if p.requires_grad)}


def _trainer_with_lora(tmp, run: str = "run", *extra):
    """`fullshard train` with a `lora:` section, on the saved base directory: what it writes."""
    import warnings

    from fullshard.train import load_config, train

    config = load_config(None, [f"--model.name_or_path={tmp}/trainer_base", "--data.seq_len=32",
                                "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.steps=3",
                                "--train.log_every=1", "--optim.warmup_steps=0", "--train.eval_batches=1",
                                "--train.plot=false", f"--train.output_dir={tmp}/{run}", "--lora.r=4", "--optim.lr=0.03",
                                "--lora.target_modules=[q_proj, o_proj, up_proj]", "--lora.alpha=8", *extra])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary = train(config)
    return {**{k: summary.get(k) for k in ("export", "adapter", "losses")}, "warnings": [str(w.message) for w in seen]}


def _moe_saves_resumes_and_exports(tmp):
    """A Mixtral-shaped model checkpoints, resumes exactly and exports like a dense one."""
    from fullshard.checkpoint import CheckpointManager, export_hf

    def setup():
        model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model("mixtral"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optimizer, seed):
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        loss = model(**data_slice(make_batch("mixtral", seed=seed), rank, world)).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        return float(loss.detach())

    model, optimizer = setup()
    step(model, optimizer, 400)
    manager = CheckpointManager(f"{tmp}/moe_ckpt")
    manager.save(1, model, optimizer)
    after = [step(model, optimizer, 401 + i) for i in range(2)]
    resumed, resumed_opt = setup()
    manager.load(resumed, resumed_opt)
    again = [step(resumed, resumed_opt, 401 + i) for i in range(2)]
    weights, resumed_weights = full_state(model), full_state(resumed)
    export_hf(resumed, f"{tmp}/moe_hf", max_shard_size="20KB")
    probe = make_batch("mixtral", batch_size=2, seed=300)["input_ids"]
    resumed.eval()
    with torch.no_grad():
        logits = resumed(input_ids=probe).logits.tolist()
    return {"after": after, "again": again, "logits": logits,
            "resume_diff": max((weights[k] - resumed_weights[k]).abs().max().item() for k in weights)}


@pytest.fixture(scope="module")
def meta_lora_run(tmp_path_factory):
    """One spawned group at world 2 for every check below (a group start is the expensive part)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.train.config import BUILTIN_MODELS
    from fullshard.train.data import byte_tokenizer

    tmp = tmp_path_factory.mktemp("lora")
    build_model("llama").save_pretrained(tmp / "base")
    build_model("llama", dtype=torch.bfloat16).save_pretrained(tmp / "base_bf16")
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=32,
                                 **BUILTIN_MODELS["micro-llama"])).save_pretrained(tmp / "trainer_base")
    tokenizer.save_pretrained(tmp / "trainer_base")
    return tmp, run_distributed(_meta_lora_checks, 2, str(tmp))


def test_meta_loaded_lora_matches_peft_and_saves_adapter_and_merged_export(meta_lora_run):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tmp_path, results = meta_lora_run
    for r in results:
        assert len(r["kept"]) == 12 and all("lora_" in n for n in r["kept"]), r["kept"]
        assert r["units_mixed"] == []
        assert r["init_diff"] == 0.0, "adapters must start exactly as get_peft_model makes them"
        assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < TOL, (r["loss"], r["ref_loss"])
        assert r["weight_diff"] < TOL and r["adapter_moved"] > 0
        # only adapters were gathered for the adapter save; the merged export one tensor at a time
        assert sum(r["adapter_gathers"]) == r["adapter_numel"], (sum(r["adapter_gathers"]), r["adapter_numel"])
        assert max(r["merged_gathers"]) <= r["largest_tensor"] < r["total_numel"] / 4
    logits = torch.tensor(results[0]["logits"])
    probe = make_batch("llama", batch_size=2, seed=300)["input_ids"]

    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = sorted(f.keys())
    assert len(keys) == 12 and all(k.startswith("base_model.model.") and "lora_" in k for k in keys), keys
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(input_ids=probe).logits, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged.eval()(input_ids=probe).logits, logits, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(input_ids=probe).logits
    assert (plain - logits).abs().max() > 1e-3, "the trained adapters must change the logits"


def test_fp32_adapters_on_a_bf16_base_start_as_peft_makes_them(meta_lora_run):
    for r in meta_lora_run[1]:
        assert r["bf16"]["dtypes"] == {True: ["torch.float32"], False: ["torch.bfloat16"]}, r["bf16"]["dtypes"]
        assert r["bf16"]["diff"] == 0.0 and r["bf16"]["adapter_grads"]


def test_trainer_lora_section_writes_adapter_and_merged_model(meta_lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, results = meta_lora_run
    summary = results[0]["trainer"]
    assert summary["adapter"] == str(tmp / "run" / "adapter") and summary["export"] == str(tmp / "run" / "hf")
    losses = list(summary["losses"].values())
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    base = AutoModelForCausalLM.from_pretrained(tmp / "trainer_base")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, tmp / "run" / "adapter").eval()
    assert sorted(adapted.peft_config["default"].target_modules) == ["o_proj", "q_proj", "up_proj"]
    merged = AutoModelForCausalLM.from_pretrained(tmp / "run" / "hf").eval()
    changed = sorted({k.split(".")[-2] for k, v in merged.state_dict().items() if not torch.equal(v, base_state[k])})
    assert changed == ["o_proj", "q_proj", "up_proj"], "only the adapted projections differ from the frozen base"
    # tp_plan auto under LoRA (the model's plan through PEFT's names): the same run split over tp, quietly
    for result in results:
        tp = result["trainer_tp"]
        assert max(abs(tp["losses"][s] - summary["losses"][s]) for s in summary["losses"]) < 1e-5, tp["losses"]
        assert not [w for w in tp["warnings"] if "view" in w or "is_gradient_checkpointing" in w], tp["warnings"]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # under pipeline parallelism (the two stages over the two ranks): the same losses, adapter and merged model
    for result in results:
        pp = result["trainer_pp"]
        assert max(abs(pp["losses"][s] - summary["losses"][s]) for s in summary["losses"]) < 1e-5, pp["losses"]
    for name in ("adapter/adapter_model.safetensors", "hf/model.safetensors"):
        pipelined, whole = load_file(tmp / "run_pp" / name), load_file(tmp / "run" / name)
        assert pipelined.keys() == whole.keys(), name
        assert max((pipelined[k] - whole[k]).abs().max().item() for k in whole) < 1e-5, name


def test_lora_config_errors_name_the_key():
    from fullshard.lora import lora_config
    from fullshard.train import ConfigError, load_config

    for args, message in ((["--lora.r=0"], "lora.r=0"), (["--lora.dropout=1.5"], "lora.dropout"),
                          (["--lora.target_modules=[]"], "lora.target_modules"), (["--lora.rank=4"], "lora.rank")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["--model.name_or_path=micro-llama", *args])
    with pytest.raises(ValueError, match="bad LoRA config"):
        lora_config({"r": 4, "no_such_field": 1})
    # a merge that would be wrong is refused, naming the layers
    from fullshard.lora import apply_lora, merge_recipe

    dora = apply_lora(build_model("llama"), {"r": 2, "target_modules": ["q_proj"], "use_dora": True})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj \(DoRA"):
        merge_recipe(dora, dora.state_dict())


def test_offline_export_of_an_unmergeable_lora_checkpoint_is_refused(tmp_path):
    """The save goes on (training needs it); the export is refused by name and writes nothing."""
    from fullshard.checkpoint import CheckpointManager, export_checkpoint
    from fullshard.lora import apply_lora

    dora = apply_lora(build_model("llama"), {"r": 2, "target_modules": ["q_proj"], "use_dora": True})
    CheckpointManager(tmp_path / "ckpt").save(1, dora)
    with pytest.raises(CheckpointError, match=r"cannot be exported.*layers\.0\.self_attn\.q_proj \(DoRA"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_offline_export_of_a_lora_run_loads_in_plain_transformers(meta_lora_run):
    """`fullshard export` of the trainer's LoRA checkpoint: the merged model under the base names with
    the run's own merged logits, the PEFT adapter beside it, and the tokenizer saved with the checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fullshard.checkpoint import export_checkpoint

    tmp, _ = meta_lora_run
    out = export_checkpoint(tmp / "run" / "checkpoints", tmp / "offline")
    offline = AutoModelForCausalLM.from_pretrained(out).eval()
    own = AutoModelForCausalLM.from_pretrained(tmp / "run" / "hf").eval()
    assert sorted(offline.state_dict()) == sorted(own.state_dict())
    assert not any("lora" in k or "base_layer" in k for k in offline.state_dict())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "trainer_base"), out / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(offline(input_ids=ids).logits, own(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(adapted.eval()(input_ids=ids).logits, own(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(tmp / "trainer_base")
    assert tokenizer("a checkpoint")["input_ids"] == reference("a checkpoint")["input_ids"]


def test_moe_model_saves_resumes_and_exports_like_a_dense_one(meta_lora_run):
    from transformers import AutoModelForCausalLM

    tmp, results = meta_lora_run
    for r in results:
        moe = r["moe"]
        assert moe["after"] == moe["again"], "a resumed MoE run continues with the same losses"
        assert moe["resume_diff"] == 0.0
    exported = AutoModelForCausalLM.from_pretrained(tmp / "moe_hf").eval()
    probe = make_batch("mixtral", batch_size=2, seed=300)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=probe).logits, torch.tensor(results[0]["moe"]["logits"]),
                                   atol=1e-5, rtol=1e-5)
