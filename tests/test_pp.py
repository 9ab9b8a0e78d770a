"""Pipeline parallelism (`fullshard.parallel.pp`, `fullshard.train.pp_step`) against one process: dp x pp,
pp x tp, virtual stages, tied embeddings, checkpoints across pp sizes, the export, and bad input.
Every 4-rank check runs in one process group."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness.compare import data_slice, full_tensor, reference_gaps

from fullshard import optim
from fullshard.errors import CheckpointError, ConfigError, PlanError
from fullshard.lora import apply_lora
from fullshard.objectives.logprobs import _RETURNS_HEAD_OUTPUT
from fullshard.parallel import pp
from fullshard.parallel.cp import context_parallel_batch
from fullshard.strategy import FSDPStrategy
from fullshard.tensors import parameter_counts
from fullshard.testing import build_model, make_batch, reported_by_every_rank, run_distributed
from fullshard.train.loss import aligned_targets, causal_lm_loss_sum, target_count, token_loss_sum
from fullshard.train.metrics import model_flops_per_token

TOL = 1e-5
GLOBAL, MICRO, SEQ, STEPS = 8, 2, 16, 5
LAYOUTS = {  # name -> (model, model overrides, engine config)
    "llama_dp2_pp2_gpipe": ("llama", {}, {"pp_size": 2, "pp_schedule": "GPipe"}),
    "llama_dp2_pp2_1f1b": ("llama", {}, {"pp_size": 2, "pp_schedule": "1F1B"}),
    "qwen3_dp2_pp2_gpipe": ("qwen3", {}, {"pp_size": 2, "pp_schedule": "GPipe"}),
    "qwen3_dp2_pp2_1f1b": ("qwen3", {}, {"pp_size": 2, "pp_schedule": "1F1B"}),
    "qwen3_pp2_interleaved": ("qwen3", {"num_hidden_layers": 4},
                              {"pp_size": 2, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2}),
    "llama_pp2_tp2": ("llama", {}, {"pp_size": 2, "tp_size": 2}),
    "qwen3_pp4_gpipe": ("qwen3", {"num_hidden_layers": 4},
                        {"pp_size": 4, "pp_schedule": "GPipe", "pp_microbatches": 2}),
    "qwen3_pp2_cp2": ("qwen3", {}, {"pp_size": 2, "cp_size": 2, "pp_schedule": "GPipe"}),
    # LoRA seen through PEFT's wrapper (a tied and an untied model), HSDP and compiled blocks under pp
    "qwen3_dp2_pp2_lora": ("qwen3", {}, {"pp_size": 2, "pp_schedule": "GPipe", "lora": True}),
    "llama_dp2_pp2_lora": ("llama", {}, {"pp_size": 2, "lora": True}),
    "llama_hsdp2_pp2": ("llama", {}, {"pp_size": 2, "dp_replicate": 2, "dp_shard": 1}),
    "llama_dp2_pp2_compile": ("llama", {}, {"pp_size": 2, "compile": True}),
}
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _strategy(config: dict) -> FSDPStrategy:
    strategy = FSDPStrategy(seed=0, max_norm=0.5, micro_train_batch_size=MICRO, train_batch_size=GLOBAL,
                            config={"mixed_precision": "fp32", **config})
    strategy.setup_distributed()
    return strategy


def _step(strategy, model, optimizer, name: str, step: int) -> float:
    """One optimizer step of this rank's share of the global batch of `step`."""
    from fullshard.train.pp_step import pipeline_train_step
    from fullshard.train.step import train_step

    dims = strategy.parallel_dims
    mine = data_slice(make_batch(name, batch_size=GLOBAL, seq_len=SEQ, seed=100 + step),
                      dims.coordinates(dist.get_rank())["dp"], dims.dp_size)
    micro = [data_slice(mine, i, len(mine["input_ids"]) // MICRO) for i in range(len(mine["input_ids"]) // MICRO)]
    if dims.cp > 1:
        cp_rank = dims.coordinates(dist.get_rank())["cp"]
        micro = [context_parallel_batch(batch, cp_rank, dims.cp) for batch in micro]
    step_fn = pipeline_train_step if pp.pipeline_of(model) is not None else train_step
    return step_fn(strategy, model, optimizer, None, micro)


def _steps(run: tuple, name: str, steps: tuple) -> list[float]:
    strategy, model, optimizer = run
    return [_step(strategy, model, optimizer, name, step).loss for step in steps]


def _reference_step(model, optimizer, name: str, step: int) -> tuple[float, float]:
    batch = make_batch(name, batch_size=GLOBAL, seq_len=SEQ, seed=100 + step)
    loss = causal_lm_loss_sum(model, batch) / target_count(batch)
    loss.backward()
    return float(loss.detach()), optim.clip_and_step(optimizer, 0.5).grad_norm


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _lora_model(name: str, lora: bool, **overrides):
    model = build_model(name, **overrides)
    if lora:
        torch.manual_seed(3)  # the adapters' init, the same in every process
        model = apply_lora(model, LORA)
    return model


def _parity(name: str, overrides: dict, config: dict) -> dict:
    """5 clipped AdamW steps sharded and pipelined, and whole in this process."""
    config = dict(config)
    lora = config.pop("lora", False)
    strategy = _strategy(config)
    model = strategy.prepare_model(_lora_model(name, lora, **overrides), is_training=True)
    opt = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.01, eps=1e-6)
    reference = _lora_model(name, lora, **overrides)
    ref_opt = optim.create_optimizer(reference, lr=1e-3, weight_decay=0.01, eps=1e-6)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": []}
    # the run's first line and its MFU count the whole model, not this rank's stages
    out["counts"] = (parameter_counts(model), parameter_counts(reference))
    out["flops"] = (model_flops_per_token(model, SEQ), model_flops_per_token(reference, SEQ))
    for step in range(STEPS):
        result = _step(strategy, model, opt, name, step)
        out["loss"].append(result.loss)
        out["norm"].append(result.result.grad_norm)
        loss, norm = _reference_step(reference, ref_opt, name, step)
        out["ref_loss"].append(loss)
        out["ref_norm"].append(norm)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    out["weight_diff"] = max((w - ref[n].detach()).abs().max().item() for n, w in _weights(model).items())
    # the last stage's loss went through the head a chunk at a time, as without pp
    pipeline = pp.pipeline_of(model)
    out["chunked"] = [_RETURNS_HEAD_OUTPUT.get(s.get_submodule(s.fullshard_stage.lm)) for s in pipeline.stages
                      if s.fullshard_stage.last] if pipeline is not None else [True]
    return out


def _checkpoints(tmp: str) -> dict:
    """A pp 2 checkpoint resumes at pp 2 and at pp 1 (dp 4), and a dp 4 one at pp 2, like the run
    that wrote it, weights and optimizer state by their full-model names; one in the older format
    (optimizer groups by index) still resumes at dp 4, and at pp 2 its weights alone load (its
    groups are refused by name); eval through the pipeline (a batch padded to its micro-batches)
    equals the whole model's; the export loads in transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    from fullshard.checkpoint import CheckpointManager, export_hf
    from fullshard.train.pp_step import pipeline_evaluate

    name, out = "qwen3", {}
    runs = {}
    for label, config in (("pp", {"pp_size": 2}), ("pp_resumed", {"pp_size": 2}), ("dp", {})):
        strategy = _strategy(config)
        model = strategy.prepare_model(build_model(name, seed=len(runs)), is_training=True)
        runs[label] = (strategy, model, strategy.create_optimizer(model, lr=1e-3, weight_decay=0.01, eps=1e-6))
    _steps(runs["pp"], name, (0, 1))
    CheckpointManager(f"{tmp}/from_pp", async_save=False).save(2, *runs["pp"][1:])
    saved = _gather_stages(runs["pp"][1])
    # two steps after each resume: the first checks the weights, the second the AdamW moments
    expected = _steps(runs["pp"], name, (2, 3))
    CheckpointManager(f"{tmp}/from_pp", async_save=False).load(*runs["pp_resumed"][1:])
    out["pp_resume"] = (_steps(runs["pp_resumed"], name, (2, 3)), expected)
    _, d_model, d_opt = runs["dp"]
    CheckpointManager(f"{tmp}/from_pp", async_save=False).load(d_model, d_opt)
    out["pp_to_dp_weights"] = max((w - saved[n]).abs().max().item() for n, w in _weights(d_model).items())
    out["pp_to_dp"] = (_steps(runs["dp"], name, (2, 3)), expected)
    CheckpointManager(f"{tmp}/from_dp", async_save=False).save(4, d_model, d_opt)
    with _optimizer_groups_by_index():
        CheckpointManager(f"{tmp}/from_dp_old", async_save=False).save(4, d_model, d_opt)
    saved = _weights(d_model)
    expected = _steps(runs["dp"], name, (4, 5))
    _, r_model, r_opt = runs["pp_resumed"]
    CheckpointManager(f"{tmp}/from_dp", async_save=False).load(r_model, r_opt)
    out["dp_to_pp"] = (_steps(runs["pp_resumed"], name, (4, 5)), expected)
    CheckpointManager(f"{tmp}/from_dp_old", async_save=False).load(d_model, d_opt)
    out["old_dp_resume"] = (_steps(runs["dp"], name, (4, 5)), expected)
    try:
        CheckpointManager(f"{tmp}/from_dp_old", async_save=False).load(r_model, r_opt)
    except CheckpointError as err:
        out["old_to_pp_optimizer_error"] = str(err)
    CheckpointManager(f"{tmp}/from_dp_old", async_save=False).load(r_model, r_opt, load_optimizer=False)
    out["dp_to_pp_weights"] = max((w - saved[n]).abs().max().item() for n, w in _gather_stages(r_model).items())

    exported = _gather_stages(r_model)
    export_hf(r_model, f"{tmp}/hf")
    batch = make_batch(name, batch_size=3, seq_len=SEQ, seed=7)  # 3 rows: padded to the 2 micro-batches
    reference = build_model(name)
    reference.load_state_dict(exported)
    with torch.no_grad():
        out["eval"] = (pipeline_evaluate(r_model, [batch]),
                       float(causal_lm_loss_sum(reference, batch) / target_count(batch)))
    if dist.get_rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/hf", dtype=torch.float32)
        with torch.no_grad():
            out["export_logits_diff"] = (loaded(**batch).logits - reference(**batch).logits).abs().max().item()
    return out


@contextlib.contextmanager
def _optimizer_groups_by_index():
    """Saves in the format of checkpoints written before every save was keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fullshard.checkpoint import manager

    original = manager._options

    def by_index(metadata=None, **kwargs):
        if metadata is None:  # saving
            return StateDictOptions(flatten_optimizer_state_dict=False, **kwargs)
        return original(metadata, **kwargs)

    with mock.patch.object(manager, "_options", by_index):
        yield


def _gather_stages(model) -> dict[str, torch.Tensor]:
    """Every stage's weights, whole, on every rank (a collective over the world)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _weights(model))
    return {n: w for weights in gathered for n, w in weights.items()}


def _load_pretrained(tmp: str) -> dict:
    """A transformers directory loaded into pipeline stages: each rank reads only its stage's slices."""
    import fullshard
    from fullshard import FSDP2Engine

    reference = build_model("qwen3", num_hidden_layers=4)
    if dist.get_rank() == 0:
        reference.save_pretrained(f"{tmp}/pretrained")
    dist.barrier()
    model = fullshard.from_pretrained(f"{tmp}/pretrained", engine=FSDP2Engine({"pp_size": 2}))
    ref = dict(reference.named_parameters(remove_duplicate=False))
    report = model.fullshard_load_report
    return {"diff": max((w - ref[n]).abs().max().item() for n, w in _weights(model).items()),
            "share_read": report.bytes_read / report.checkpoint_bytes}


def _lora_pipeline(tmp: str) -> dict:
    """LoRA at pp 2 x dp 2 from a transformers directory (each stage loads its own slices, the adapters
    keep their init): after two steps beside a one-process PEFT model, the adapter save and the merged
    export (live, and offline from the pp checkpoint) equal that model's, and the checkpoint resumes at pp 1."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    import fullshard
    from fullshard.checkpoint import CheckpointManager, export_checkpoint

    name, out = "qwen3", {}
    if dist.get_rank() == 0:
        build_model(name).save_pretrained(f"{tmp}/lora_base")
    dist.barrier()
    strategy = _strategy({"pp_size": 2, "pp_schedule": "GPipe"})
    torch.manual_seed(3)
    model = fullshard.from_pretrained(f"{tmp}/lora_base", engine=strategy.engine(), lora=LORA).train()
    opt = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.01, eps=1e-6)
    reference = _lora_model(name, True)
    ref_opt = optim.create_optimizer(reference, lr=1e-3, weight_decay=0.01, eps=1e-6)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    out["loaded"] = max((w - ref[n].detach()).abs().max().item() for n, w in _weights(model).items())
    out["losses"] = [(_step(strategy, model, opt, name, s).loss, _reference_step(reference, ref_opt, name, s)[0])
                     for s in range(2)]
    fullshard.save_adapter(model, f"{tmp}/lora_adapter")
    fullshard.export_merged(model, f"{tmp}/lora_merged")
    CheckpointManager(f"{tmp}/lora_ckpt", async_save=False).save(2, model, opt)
    saved = _gather_stages(model)
    dims = {"pp_size": 1}
    whole = _strategy(dims)
    resumed = whole.prepare_model(_lora_model(name, True, seed=9), is_training=True)
    CheckpointManager(f"{tmp}/lora_ckpt", async_save=False).load(resumed, whole.create_optimizer(resumed, lr=1e-3))
    out["resumed_at_pp1"] = max((w - saved[n]).abs().max().item() for n, w in _weights(resumed).items())
    if dist.get_rank() == 0:
        export_checkpoint(f"{tmp}/lora_ckpt", f"{tmp}/lora_offline")
        adapter = load_file(f"{tmp}/lora_adapter/adapter_model.safetensors")
        expected = get_peft_model_state_dict(reference)
        out["adapter"] = (sorted(adapter) == sorted(expected),
                          max((adapter[k] - expected[k]).abs().max().item() for k in expected))
        merged = copy.deepcopy(reference).merge_and_unload().state_dict()
        live, offline = load_file(f"{tmp}/lora_merged/model.safetensors"), load_file(f"{tmp}/lora_offline/model.safetensors")
        out["merged"] = (sorted(live) == sorted(k for k in merged if k != "lm_head.weight"),  # tied: written once
                         max((live[k] - merged[k]).abs().max().item() for k in live),
                         sorted(offline) == sorted(live) and all(torch.equal(offline[k], live[k]) for k in live))
    return out


def _errors() -> dict:
    """Bad input: one named error, raised on every rank."""
    found = {}
    for label, (name, config) in {"too_many_stages": ("llama", {"pp_size": 4}),
                                  "unsplittable": ("gpt2", {"pp_size": 2})}.items():
        try:
            _strategy(config).prepare_model(build_model(name), is_training=True)
        except (ConfigError, PlanError) as err:
            found[label] = (type(err).__name__, str(err))
    return found


def _world_4_checks(tmp: str) -> dict:
    results = {"parity": {label: _parity(*layout) for label, layout in LAYOUTS.items()}}
    results["checkpoints"] = _checkpoints(tmp)
    results["pretrained"] = _load_pretrained(tmp)
    results["lora"] = _lora_pipeline(tmp)
    results["errors"] = _errors()
    return results


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    return run_distributed(_world_4_checks, 4, str(tmp_path_factory.mktemp("pp")), timeout=900)


def test_pipeline_matches_single_process(world_4):
    bad = []
    for rank, result in enumerate(world_4):
        for label, r in result["parity"].items():
            loss, norm = reference_gaps(r)
            if max(loss, norm, r["weight_diff"]) > TOL:
                bad.append(f"rank {rank} {label}: loss {loss:.1e} norm {norm:.1e} weight {r['weight_diff']:.1e}")
            if not all(r["chunked"]):
                bad.append(f"rank {rank} {label}: the last stage's loss was not chunked ({r['chunked']})")
            if r["counts"][0] != r["counts"][1] or r["flops"][0] != r["flops"][1]:
                bad.append(f"rank {rank} {label}: counts {r['counts']} flops/token {r['flops']}, not the whole model's")
    assert not bad, "\n".join(bad)


def test_pipeline_checkpoints_carry_full_model_names_and_export(world_4):
    for rank, result in enumerate(world_4):
        checks = result["checkpoints"]
        for key in ("pp_resume", "pp_to_dp", "dp_to_pp", "old_dp_resume"):  # the steps after the resume
            resumed, uninterrupted = checks[key]
            assert max(abs(a - b) for a, b in zip(resumed, uninterrupted)) < TOL, (rank, key, checks[key])
        assert checks["pp_to_dp_weights"] == 0 and checks["dp_to_pp_weights"] == 0, (rank, checks)
        message = checks["old_to_pp_optimizer_error"]  # named, not a KeyError
        assert "by index" in message and "load_optimizer=False" in message and "from_dp_old" in message, message
        pipelined, whole = checks["eval"]
        assert abs(pipelined - whole) < TOL, (rank, checks["eval"])
    assert world_4[0]["checkpoints"]["export_logits_diff"] < TOL


def test_lora_under_pipeline_loads_saves_and_exports_like_one_process(world_4):
    for rank, result in enumerate(world_4):
        lora = result["lora"]
        assert lora["loaded"] == 0, (rank, lora)
        assert max(abs(a - b) for a, b in lora["losses"]) < TOL, (rank, lora["losses"])
        assert lora["resumed_at_pp1"] == 0, (rank, lora)
    lora = world_4[0]["lora"]
    assert lora["adapter"][0] and lora["adapter"][1] < TOL, lora["adapter"]
    same_names, gap, offline_equal = lora["merged"]
    assert same_names and gap < TOL and offline_equal, lora["merged"]


def test_pipeline_stages_load_only_their_own_slices(world_4):
    for result in world_4:
        assert result["pretrained"]["diff"] == 0
        # a stage's half of the layers over 2 dp ranks, plus the tied embedding both ends hold
        assert result["pretrained"]["share_read"] < 0.35, result["pretrained"]


def test_pipeline_bad_input_is_one_error_on_every_rank(world_4):
    for result in world_4:
        kind, message = result["errors"]["too_many_stages"]
        assert kind == "ConfigError" and "4 pipeline stages" in message and "2 decoder layers" in message, message
        assert reported_by_every_rank(message, 4), message
        kind, message = result["errors"]["unsplittable"]
        assert kind == "PlanError" and "cannot split GPT2LMHeadModel" in message, message
        assert reported_by_every_rank(message, 4), message


def test_stages_chained_in_one_process_equal_the_model():
    """The cut alone (no pipelining, no sharding): the stages run one after another give the model's
    loss and every parameter's gradient, for an untied and a tied model."""
    for name in ("llama", "qwen3"):
        reference, model = build_model(name, num_hidden_layers=3), build_model(name, num_hidden_layers=3)
        parts = pp.decoder_parts(model)
        ranges = pp.stage_layers(model, parts, 3)
        stages = [pp.build_stage(model, parts, ranges, i) for i in range(3)]
        batch = make_batch(name, batch_size=2, seq_len=SEQ)
        (causal_lm_loss_sum(reference, batch, chunk_tokens=0)).backward()  # whole logits, as the last stage
        hidden = batch["input_ids"]
        for stage in stages:
            hidden = stage(hidden)
        token_loss_sum(hidden, aligned_targets(batch)).backward()
        grads = {}
        for stage in stages:
            for n, p in stage.named_parameters(remove_duplicate=False):
                grads[n] = grads.get(n, 0) + p.grad  # a tied weight: both ends add up
        ref = dict(reference.named_parameters(remove_duplicate=False))
        assert set(grads) == set(ref)
        assert max((grads[n] - ref[n].grad).abs().max().item() for n in ref) < 1e-6, name


def test_balanced_split_and_config_errors():
    model = build_model("llama", num_hidden_layers=5)
    parts = pp.decoder_parts(model)
    assert [len(r) for r in pp.stage_layers(model, parts, 2, [1, 4])] == [1, 4]
    ranges = pp.stage_layers(model, parts, 2)
    assert ranges[0].start == 0 and ranges[-1].stop == 5 and all(len(r) >= 1 for r in ranges)
    with pytest.raises(ConfigError, match="fewer than the 2 pipeline stages"):
        pp.check_pipeline_config(2, "1F1B", 1, 1, None)
    with pytest.raises(ConfigError, match="pp_virtual_stages"):
        pp.check_pipeline_config(2, "Interleaved1F1B", None, 1, None)


def test_preflight_names_pipeline_mistakes_before_launch(tmp_path):
    from fullshard.train.config import load_config
    from fullshard.train.preflight import check_before_launch

    def config(**fsdp):
        overrides = [f"--fsdp.{k}={v}" for k, v in fsdp.items()]
        return load_config(overrides=overrides + ["--model.name_or_path=micro-llama", "--train.micro_batch_size=2",
                                                  "--train.global_batch_size=4", f"--train.output_dir={tmp_path}"])

    with pytest.raises(ConfigError, match=r"fsdp.pp_size=4: 4 pipeline stages .* has 2 decoder layers"):
        check_before_launch(config(pp_size=4, pp_microbatches=2, pp_schedule="GPipe"), 4)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=2 does not split into fsdp.pp_microbatches=3"):
        check_before_launch(config(pp_size=2, pp_microbatches=3, pp_schedule="GPipe"), 2)
    with pytest.raises(ConfigError, match="fewer than the 2 pipeline stages"):
        config(pp_size=2, pp_microbatches=1)
