"""The memory plan (`fullshard plan`, `fullshard.train.memory`): the dtypes training keeps, pipeline
stages, devices, composite configs, and the estimate against the measured peak of every layout."""

import re

import pytest
import torch

from fullshard.cli import main

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"])
EIGHT_GPUS = ["--nproc", "8", "--fsdp.mixed_precision=bf16", "--fsdp.activation_checkpointing=true", "--seq-len",
              "4096", "--micro-batch-size", "1", "--device", "h100"]


def _config_dir(root, name: str, dtype: str | None, **fields):
    from transformers import LlamaConfig

    config = LlamaConfig(**fields)
    config.dtype = None if dtype is None else getattr(torch, dtype)
    config.save_pretrained(root / name)
    text = (root / name / "config.json").read_text()
    assert ('"bfloat16"' in text) == (dtype == "bfloat16")  # what a Hub config says, or nothing
    return root / name


def _mib(printed: str, row: str) -> list[float]:
    return [float(v.replace(",", "")) for v in re.findall(re.escape(row) + r" +([\d,.]+) MiB", printed)]


def test_plan_counts_the_dtype_training_keeps_not_the_stored_one(tmp_path, capsys):
    """An 8B Llama's config with and without `torch_dtype: bfloat16` gives the same per-rank total:
    fp32 master weights, gradients and AdamW state (model.dtype), bf16 compute; model.dtype=bf16 less."""
    totals = {}
    for dtype in ("bfloat16", None):
        directory = _config_dir(tmp_path, str(dtype), dtype, **LLAMA3_8B)
        assert main(["plan", f"--model.name_or_path={directory}", *EIGHT_GPUS]) == 0
        printed = capsys.readouterr().out
        assert "assumed: master weights, gradients and adamw state in fp32, compute in bf16" in printed, printed
        assert ("config.json's torch_dtype bfloat16 is only what is read from disk" in printed) == (dtype is not None)
        totals[dtype] = _mib(printed, "total (parameters, optimizer, rounding, larger moment)")[0]
        # fp32 masters: 8.03e9 parameters x 4 bytes / 8 ranks, AdamW twice that
        assert _mib(printed, "parameters (shard)")[0] == pytest.approx(8.03e9 * 4 / 8 / 2**20, rel=0.01)
        assert re.search(r"fits: [\d.]+ of 79\.2 GiB \(h100\)", printed) and "largest micro batch that fits" in printed
    assert totals["bfloat16"] == totals[None] > 1.3 * 15_676, totals  # 15,676 MiB: the bf16 masters it assumed before
    assert main(["plan", f"--model.name_or_path={tmp_path / 'None'}", *EIGHT_GPUS, "--model.dtype=bf16"]) == 0
    assert _mib(capsys.readouterr().out, "total (parameters, optimizer, rounding, larger moment)")[0] < totals[None]


def test_pipeline_stages_hold_their_own_layers_and_only_the_head_stage_the_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.train.memory import estimate_run

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    engine = {"mixed_precision": "bf16", "pp_size": 2, "tp_size": 2, "pp_microbatches": 4}
    gpipe, one_f_one_b = (estimate_run(model, {**engine, "pp_schedule": schedule}, 8, 4, 8192)
                          for schedule in ("GPipe", "1F1B"))
    head, body = gpipe.stages[1].estimate, gpipe.stages[0].estimate
    assert "lm_head" in gpipe.stages[1].label and "lm_head" not in gpipe.stages[0].label
    assert body.loss == body.saved_loss == 0 and head.loss > 0 and head.saved_loss > 0
    # GPipe keeps all 4 micro-batches in flight on every stage; 1F1B at most 2 on stage 0, 1 on the last
    assert one_f_one_b.stages[0].estimate.activations == body.activations / 2
    assert one_f_one_b.stages[1].estimate.activations == head.activations / 4
    assert gpipe.per_rank == max(s.estimate.total for s in gpipe.stages)


def test_plan_devices_and_model_forms(tmp_path, capsys):
    """--model.name_or_path alone (as train takes it), a VLM config (its text config), --device."""
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, bos_token_id=1, eos_token_id=2)
    Qwen2_5_VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2,
                                                          intermediate_size=64),
                     architectures=["Qwen2_5_VLForConditionalGeneration"]).save_pretrained(tmp_path / "vlm")
    assert main(["plan", "--model.name_or_path", str(tmp_path / "vlm"), "--nproc", "2", "--device", "a100-40g"]) == 0
    printed = capsys.readouterr().out
    assert "model.language_model.layers.1" in printed and re.search(r"fits: [\d.]+ of 39\.4 GiB", printed), printed
    assert main(["plan", "--model.name_or_path=micro-llama", "--nproc", "2", "--device", "cpu"]) == 0
    assert "largest micro batch that fits" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["plan", "micro-llama", "--device", "cuda"]) == 2
        assert "--device=cuda plans for this machine's GPU, and it has none" in capsys.readouterr().err


def test_estimate_is_at_most_10_percent_above_the_measured_peak_in_every_layout():
    """Every layout of `memory_matrix.CELLS` (per pipeline stage): estimate / measured peak in [1.00, 1.10]."""
    from harness.memory_matrix import run_cells

    ratios = {f"{name} / stage {row['stage']}": row["estimate"] / row["peak"]
              for name, rows in run_cells().items() for row in rows}
    assert len(ratios) >= 16
    off = {cell: round(ratio, 4) for cell, ratio in ratios.items() if not 1.0 <= ratio <= 1.10}
    assert not off, off


def test_every_plan_path_prints_its_estimate_and_largest_micro_batch(tmp_path, capsys):
    """`fullshard plan` in-process on every path: pp or not, --device or this machine's, LoRA, ep
    and a VLM config; each prints its tables, whether it fits and the largest micro batch."""
    from transformers import MixtralConfig, Qwen2VLConfig

    eight_b = _config_dir(tmp_path, "llama8b", None, **LLAMA3_8B)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)
    MixtralConfig(**text, num_local_experts=4, architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path / "moe")
    Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
                  architectures=["Qwen2VLForConditionalGeneration"]).save_pretrained(tmp_path / "vlm")
    eight = EIGHT_GPUS[:-2]  # without --device: this machine's
    runs = {
        "pp": [str(eight_b), *eight, "--fsdp.pp_size=2"],
        "pp_h100": [str(eight_b), *EIGHT_GPUS, "--fsdp.pp_size=2"],
        "dense": [str(eight_b), *eight],
        "dense_h100": [str(eight_b), *EIGHT_GPUS],
        "lora_pp": [str(eight_b), *EIGHT_GPUS, "--fsdp.pp_size=2", "--lora.r=8"],
        "ep": [str(tmp_path / "moe"), "--nproc", "4", "--fsdp.ep_size=2"],
        "ep_a100": [str(tmp_path / "moe"), "--nproc", "4", "--fsdp.ep_size=2", "--device", "a100-40g"],
        "moe_pp": [str(tmp_path / "moe"), "--nproc", "4", "--fsdp.pp_size=2"],
        "vlm": [str(tmp_path / "vlm"), "--nproc", "2"],
        "vlm_lora": [str(tmp_path / "vlm"), "--nproc", "2", "--device", "h200", "--lora.r=8",
                     "--lora.target_modules=[q_proj,v_proj]"],
    }
    for name, args in runs.items():
        assert main(["plan", *args]) == 0, (name, capsys.readouterr().err)
        printed = capsys.readouterr().out
        assert re.search(r"(fits|does NOT fit): [\d.]+ of [\d.]+ GiB", printed), (name, printed)
        assert re.search(r"(largest micro batch that fits at \d+ tokens: [1-9]|no micro batch fits)", printed), \
            (name, printed)
        assert ("stage 1" in printed) == ("pp" in name), (name, printed)
        assert ("LoRA" in printed) == ("lora" in name), (name, printed)
    # PEFT has no default modules for most VLMs: one line naming the key, not peft's ValueError
    assert main(["plan", str(tmp_path / "vlm"), "--nproc", "2", "--lora.r=8"]) == 2
    assert "lora.target_modules: PEFT has no default modules to adapt for 'qwen2_vl'" in capsys.readouterr().err


def test_plan_of_a_dpo_run_counts_its_reference_and_says_which(tmp_path, capsys):
    """`fullshard plan --train.objective=dpo` states the reference strategy it assumed and counts it:
    a sharded copy of the weights (model), on the host (offloaded), nothing (precompute, or LoRA's
    adapters off beyond a second forward); the log-probs' chunk costs more than the SFT loss's."""
    llama = _config_dir(tmp_path, "llama8b", "bfloat16", **LLAMA3_8B)
    dpo = ["--train.objective=dpo", "--data.format=preference"]

    def plan(*extra):
        assert main(["plan", str(llama), *EIGHT_GPUS, *extra]) == 0
        return capsys.readouterr().out

    sft, model = plan(), plan(*dpo)
    offloaded = plan(*dpo, "--preference.offload_reference=true")
    precompute = plan(*dpo, "--preference.reference=precompute")
    adapter = plan(*dpo, "--lora.r=8")
    for printed, strategy in ((model, "model"), (offloaded, "offloaded"), (precompute, "precompute"),
                              (adapter, "adapter")):
        assert f"reference strategy assumed: {strategy} (" in printed, printed
    assert "reference strategy" not in sft
    total = "total (parameters, optimizer, rounding, larger moment)"
    shard = _mib(model, "parameters (shard)")[0]
    assert _mib(model, "reference model (shard)") == [shard]
    assert _mib(offloaded, "reference model offloaded (host memory)") == [shard]
    assert not _mib(offloaded, "reference model (shard)") and not _mib(precompute, "reference model")
    gathered = _mib(model, "all-gathered units (2 largest)")[0]
    assert _mib(model, "reference forward: all-gathered units") == [gathered]
    assert _mib(adapter, "reference forward: all-gathered units") and not _mib(adapter, "reference model (shard)")
    assert _mib(model, total)[0] >= _mib(offloaded, total)[0] + shard - 0.02
    assert _mib(precompute, total)[0] < _mib(offloaded, total)[0]
    assert _mib(precompute, "loss: logits (all, or a chunk's) and gradients")[0] > _mib(
        sft, "loss: logits (all, or a chunk's) and gradients")[0]


def test_grpo_phases_and_a_reward_step_are_estimated_within_10_percent_of_their_peaks():
    """A tiny Llama's colocated GRPO step at world 2 (`harness.rl_memory`: 8 completions a rank,
    32 + 96 tokens, a reference model, two update micro-batches; fp32, and bf16 compute sampling
    with top-p), each phase's peak measured apart; generation where the sampled scores are most
    of the peak (32 rows over a 32K vocabulary, with and without top-p);
    and a one-output reward model's step: estimate / peak in [1.00, 1.10] for each; the step's
    estimate is its largest phase's. The causal LM's estimate for the reward step's shape (the
    vocabulary's logits it does not have) is out of the band: the head counted is the score's."""
    from harness.memory_matrix import LLAMA
    from harness.rl_memory import REWARD_ROWS, REWARD_SEQ, run
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.plan.memory import estimate_run

    results = run()
    reward = results["reward"]
    ratios = {f"{case}: {phase}": grpo["estimate"][phase.replace("logprobs", "log-probs")] / peak
              for case, grpo in results["grpo"].items() for phase, peak in grpo["peak"].items()}
    ratios.update({f"sampling, {name}": row["estimate"] / row["peak"]
                   for name, row in results["sampling"].items()})
    ratios["reward"] = reward["estimate"] / reward["peak"]
    assert len(ratios) == 9, ratios
    off = {name: round(ratio, 4) for name, ratio in ratios.items() if not 1.0 <= ratio <= 1.10}
    assert not off, (off, ratios)
    assert all(grpo["total"] == max(grpo["estimate"].values()) for grpo in results["grpo"].values())
    with torch.device("meta"):
        causal = LlamaForCausalLM._from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
    as_causal = estimate_run(causal, {"mixed_precision": "fp32"}, 2, REWARD_ROWS, REWARD_SEQ,
                             accumulation_steps=1, device_type="cpu").per_rank
    assert as_causal / reward["peak"] > 1.10, as_causal / reward["peak"]


def test_plan_of_a_grpo_run_names_each_phase_and_of_a_reward_run_its_score_head(tmp_path, capsys):
    """`fullshard plan --train.objective=grpo` prints each phase's figure and the largest as the
    total: generation's KV cache (every layer's keys and values in bf16), the reference's shards
    on the device only for its log-probs, with engines no generation on the trainer ranks but the
    weight push's buffers; and
    `--train.objective=reward` no logits over the vocabulary."""
    llama = _config_dir(tmp_path, "llama8b", "bfloat16", **LLAMA3_8B)
    grpo = ["--train.objective=grpo", "--train.global_batch_size=64", "--rl.max_new_tokens=1024"]

    def plan(*extra):
        assert main(["plan", str(llama), *EIGHT_GPUS, *extra]) == 0
        return capsys.readouterr().out

    colocated, kl, engines = (plan(*grpo), plan(*grpo, "--rl.kl_coef=0.04"),
                              plan(*grpo, "--rl.rollout=engines"))
    # 8 completions a rank of 4096 + 1024 positions, 32 layers of 8 kv heads x 128, bf16
    assert _mib(colocated, "generation: KV cache (8 sequences x 5120 positions)") == [
        pytest.approx(2 * 32 * 8 * 8 * 128 * 5120 * 2 / 2**20, abs=0.01)]
    assert "prompts of 4096 tokens (the plan's seq-len" in colocated
    assert "log-probs phase" not in colocated  # kl_coef 0, one epoch: on-policy, no reference
    phases = {row: _mib(kl, f"{row} phase total")[0]
              for row in ("generation", "log-probs", "update")}
    total = re.search(r"total \(the largest phase: ([\w-]+)\) +([\d,.]+) MiB", kl)
    largest = max(phases.values())
    assert float(total[2].replace(",", "")) == largest and phases[total[1]] == largest
    shard = _mib(kl, "update: parameters (shard)")[0]
    assert _mib(kl, "log-probs: reference model (shard, on the device for its forward)") == [shard]
    assert "generation: reference" not in kl and "reference model" in kl
    assert "generation phase" not in engines and "engines: the engine processes generate" in engines
    # the first rank's two 256 MiB buckets in turn and a third for the 2 GiB fp32 embedding
    embedding = 128256 * 4096 * 4 / 2**20
    assert _mib(engines, "weight push: the first rank's bucket buffers") == [512 + embedding]
    assert re.search(r"most completions per rank that fit: \d+", colocated)
    sft, reward = plan(), plan("--train.objective=reward", "--data.format=preference")
    head = "loss: logits (all, or a chunk's) and gradients"
    assert _mib(reward, head)[0] < 0.001 * _mib(sft, head)[0]  # a score a token, not 128K logits
    activations = "activations (one micro-batch)"
    assert _mib(sft, activations)[0] - _mib(reward, activations)[0] > 0
