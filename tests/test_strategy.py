"""The strategy API trains like one big batch, clips by the true global norm and skips bad steps together.

Everything distributed runs in one spawned group of 2 ranks; the parent asserts on what it returns.
"""

import math

import pytest
import torch
from harness.compare import data_slice, full_state, full_tensor, largest_gap, train_on_padded_batches

from fullshard import FSDPStrategy
from fullshard.optim import (
    clip_grad_norm,
    global_grad_norm,
    offload_model,
    offload_optimizer,
    reload_model,
    reload_optimizer,
)
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.train.loss import IGNORE_INDEX
from fullshard.train.step import train_step

TOL = 1e-6
# weights after 3 AdamW steps at lr 1e-2: Adam turns last-bit differences of tiny gradients (sums in
# another order) into lr-sized steps; the house rule for fp32 is 1e-5
WEIGHT_TOL = 1e-5
NAME = "llama"


def masked_batch(step: int, batch_size: int = 8) -> dict:
    """Rows with different numbers of ignored labels, so micro-batches hold different token counts."""
    batch = make_batch(NAME, batch_size=batch_size, seq_len=16, seed=step)
    for row in range(batch_size):
        batch["labels"][row, : (row * 3) % 11] = IGNORE_INDEX
    return batch


def split(batch: dict, parts: int) -> list[dict]:
    size = next(iter(batch.values())).shape[0] // parts
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(parts)]


def make_strategy(micro: int, train: int = 8, max_norm: float = 1.0, accumulation_policy: str = "reduce_scatter_every",
                  **engine) -> FSDPStrategy:
    strategy = FSDPStrategy(seed=0, max_norm=max_norm, micro_train_batch_size=micro, train_batch_size=train,
                            bf16=False, config=engine, accumulation_policy=accumulation_policy)
    strategy.setup_distributed()
    return strategy


def run(strategy: FSDPStrategy, steps: int = 3, rank_batch=None, hook=None):
    """Train a fresh model; returns losses, norms and the gathered weights."""
    model = strategy.prepare_model(build_model(NAME), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-2, weight_decay=0.0, eps=1e-6)
    losses, norms = [], []
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(steps):
        batch = rank_batch(step) if rank_batch else data_slice(masked_batch(step), rank, world)
        if hook:
            hook(step, model, optimizer)
        out = train_step(strategy, model, optimizer, None, split(batch, strategy.accumulated_gradient))
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
    return {"loss": losses, "norm": norms, "weights": full_state(model), "model": model, "optimizer": optimizer}


def reference_run(steps: int = 3, max_norm: float = 1.0):
    """The same training in this process on the whole batch, with torch's own clipping."""
    model = build_model(NAME)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-6)
    losses, norms = [], []
    for step in range(steps):
        batch = masked_batch(step)
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"loss": losses, "norm": norms}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _strategy_checks():
    out = {}
    rank = torch.distributed.get_rank()

    # ---- accumulation: 2 micro-batches of 2 equal 1 micro-batch of 4, both policies, FSDP and HSDP
    for layout in ({}, {"dp_replicate": 2}):
        big = run(make_strategy(micro=4, **layout))
        for policy in ("reduce_scatter_every", "defer_sync"):
            small = run(make_strategy(micro=2, accumulation_policy=policy, **layout))
            key = f"accum/{policy}/{'hsdp' if layout else 'fsdp'}"
            out[key] = {
                "loss": max(abs(a - b) for a, b in zip(small["loss"], big["loss"])),
                "norm": max(abs(a - b) for a, b in zip(small["norm"], big["norm"])),
                "weights": max_diff(small["weights"], big["weights"]),
            }
        if not layout:
            out["fsdp_losses"], out["fsdp_norms"] = big["loss"], big["norm"]

    # ---- clipping on a model with two meshes: the body sharded, the head a plain replicated tensor
    strategy = make_strategy(micro=8, train=16)
    model = build_model(NAME)
    strategy.engine().prepare_model(model.model)  # lm_head stays a plain tensor
    batch = masked_batch(0)
    model(**batch).loss.backward()  # same batch on both ranks: the plain head's grad is the same everywhere
    mixed_norm = float(global_grad_norm(model.parameters()))
    clip_grad_norm(model.parameters(), max_norm=0.05)
    clipped = {n: full_tensor(p.grad).numpy().copy() for n, p in model.named_parameters()}  # tensors do not survive the queue
    out["mixed_mesh_norm"] = mixed_norm
    out["mixed_mesh_clipped"] = clipped

    # ---- max_norm=0.0 leaves gradients exactly as they are
    model.zero_grad()
    model(**batch).loss.backward()
    before = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    clip_grad_norm(model.parameters(), max_norm=0.0)
    after = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    out["max_norm_0_untouched"] = all(torch.equal(before[n], after[n]) for n in before)

    # ---- NaN in one rank's loss skips the step on every rank, then training goes on
    strategy = make_strategy(micro=2)
    model = strategy.prepare_model(build_model(NAME), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-2)
    weights_before = full_state(model)
    batches = split(data_slice(masked_batch(0), rank, 2), 2)
    if rank == 1:
        poisoned = model.model.embed_tokens.register_forward_hook(lambda m, i, o: o * float("nan"))
    step = train_step(strategy, model, optimizer, None, batches)
    if rank == 1:
        poisoned.remove()
    out["nan_skipped"] = step.result.skipped
    out["nan_weights_unchanged"] = max_diff(full_state(model), weights_before) == 0.0
    out["nan_grads_cleared"] = all(p.grad is None for p in model.parameters())
    step = train_step(strategy, model, optimizer, None, batches)
    out["after_nan_finite"] = math.isfinite(step.loss) and not step.result.skipped
    out["skipped_steps"] = strategy.skipped_steps

    # ---- optimizer (and parameter) offload and reload: bit-identical training
    plain = run(make_strategy(micro=2), steps=3)
    moves = []

    def offload_between_steps(step, model, optimizer):
        if step:
            def states():
                return [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k != "step"]

            on_device = states()
            moves.append(offload_optimizer(optimizer)["bytes_moved"])
            # the state really left its storage (on a CPU host "cpu" is the same device, so check the copy)
            moves.append(all(a.data_ptr() != b.data_ptr() for a, b in zip(on_device, states())))
            offload_model(model)
            reload_model(model)
            reload_optimizer(optimizer)

    offloaded = run(make_strategy(micro=2), steps=3, hook=offload_between_steps)
    out["offload_bit_identical"] = all(torch.equal(plain["weights"][k], offloaded["weights"][k]) for k in plain["weights"])
    out["offload_losses_equal"] = plain["loss"] == offloaded["loss"]
    out["offload_moves"] = moves
    return out


def test_strategy_distributed():
    results = run_distributed(_strategy_checks, 2)
    reference = reference_run()
    single = build_model(NAME)
    single(**masked_batch(0)).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(single.parameters(), max_norm=0.05))
    ref_clipped = {n: p.grad for n, p in single.named_parameters()}
    for rank, r in enumerate(results):
        for policy in ("reduce_scatter_every", "defer_sync"):
            for layout in ("fsdp", "hsdp"):
                diffs = r[f"accum/{policy}/{layout}"]
                assert diffs["loss"] < TOL and diffs["norm"] < TOL, (rank, policy, layout, diffs)
                assert diffs["weights"] < WEIGHT_TOL, (rank, policy, layout, diffs)
        # the FSDP run with token-normalised loss and global clipping is the single-process run
        assert max(abs(a - b) for a, b in zip(r["fsdp_losses"], reference["loss"])) < 1e-5
        assert max(abs(a - b) for a, b in zip(r["fsdp_norms"], reference["norm"])) < 1e-5
        assert abs(r["mixed_mesh_norm"] - ref_norm) < 1e-5 * ref_norm
        worst = max((torch.from_numpy(r["mixed_mesh_clipped"][n]) - ref_clipped[n]).abs().max().item() for n in ref_clipped)
        assert worst < 1e-7, worst
        assert r["max_norm_0_untouched"]
        assert r["nan_skipped"] and r["nan_weights_unchanged"] and r["nan_grads_cleared"], r
        assert r["after_nan_finite"] and r["skipped_steps"] == 1
        assert r["offload_bit_identical"] and r["offload_losses_equal"]
        assert r["offload_moves"][0] > 0 and all(r["offload_moves"][1::2])


def _checkpointing_on_padded_batches():
    gaps = {}
    for name in ("llama", "qwen3"):
        plain, checkpointed = (
            train_on_padded_batches(name, lambda: make_strategy(micro=2, activation_checkpointing=ac).prepare_model(
                build_model(name), is_training=True)) for ac in (False, True))
        gaps[name] = largest_gap(plain, checkpointed)
    return gaps


def test_activation_checkpointing_on_padded_batches_equals_the_run_without():
    # the call: prepare_model, then model(input_ids, attention_mask with padding, labels).loss.backward()
    for rank, gaps in enumerate(run_distributed(_checkpointing_on_padded_batches, 2)):
        assert set(gaps) == {"llama", "qwen3"} and all(gap < 1e-6 for gap in gaps.values()), (rank, gaps)


# ---------------------------------------------------------------------------------------------- options


def test_options_are_an_engine_config_and_a_few_named_ones():
    """Seed 001's call keeps working; the engine config is taken whole; a mistyped key is refused by name."""
    from dataclasses import asdict, fields, replace

    from fullshard import ConfigError, EngineConfig

    seed_001 = FSDPStrategy(seed=42, max_norm=1.0, micro_train_batch_size=2, train_batch_size=16, bf16=True)
    assert seed_001.config.mixed_precision == "bf16" and seed_001.bf16 and seed_001.scaler is None
    config = EngineConfig(mixed_precision="fp16", reduce_dtype="bf16", reshard_after_forward=False, offload_params=True,
                          pin_memory=False, activation_checkpointing=True, plan={"mode": "auto"}, dp_replicate=2,
                          dp_shard=1, dcp_path="/some/dcp", timeout_s=7.0, compile=True, prefetch=1, tp_size=2,
                          tp_plan={"model.layers.*.mlp.up_proj": "colwise"}, cp_size=2, ep_size=2, pp_size=2,
                          pp_schedule="Interleaved1F1B", pp_microbatches=2, pp_virtual_stages=2,
                          pp_layers_per_stage=[1, 1, 1, 1], freeze=["vision", "projector"], ac_every=3,
                          activation_offload=True, float8_skip=["model.layers.0.*"])
    float8 = replace(config, float8="tensorwise", tp_size=1)  # float8 is refused with tp_size > 1
    changed = {f.name for f in fields(EngineConfig) for c in (config, float8) if getattr(c, f.name) != f.default}
    assert changed == {f.name for f in fields(EngineConfig)}  # the checks below could fail on any field
    strategy = FSDPStrategy(config=config, accumulation_policy="defer_sync", adam_offload=True)
    assert asdict(strategy.config) == asdict(config)
    assert asdict(FSDPStrategy(config=float8).config) == asdict(float8)
    assert strategy.fp16 and strategy.scaler is not None and strategy.adam_offload
    assert FSDPStrategy(config={"mixed_precision": "fp32"}, bf16=False).config.mixed_precision == "fp32"
    with pytest.raises(ConfigError, match="unknown dist_config keys.*'mixed_precison'"):
        FSDPStrategy(config={"mixed_precison": "bf16"})
    with pytest.raises(ConfigError, match="bf16=True.*mixed_precision='fp16'"):
        FSDPStrategy(config=config, bf16=True)
    with pytest.raises(ConfigError, match="exclusive"):
        FSDPStrategy(bf16=True, fp16=True)
    with pytest.raises(ConfigError, match="accumulation_policy must be one of"):
        FSDPStrategy(accumulation_policy="sometimes")


def test_batch_arithmetic_is_one_function_naming_the_keys():
    from fullshard import ConfigError
    from fullshard.strategy import batch_arithmetic

    assert batch_arithmetic(16, 2, 4) == 2
    with pytest.raises(ConfigError, match=r"train_batch_size=10 is not divisible by micro_train_batch_size=2 x "
                                          r"data-parallel size 4 = 8"):
        batch_arithmetic(10, 2, 4)
    with pytest.raises(ConfigError, match=r"train.global_batch_size=10 is not divisible by train.micro_batch_size=2"):
        batch_arithmetic(10, 2, 4, names=("train.global_batch_size", "train.micro_batch_size"))
    with pytest.raises(ConfigError, match="micro_train_batch_size must be a positive integer, got 0"):
        batch_arithmetic(8, 0, 1)


def test_more_ranks_than_devices_is_one_line_naming_both(monkeypatch):
    from fullshard import ConfigError
    from fullshard.distributed import init_distributed

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"^2 processes per node but this node has 1 cuda device\(s\)"):
        init_distributed("cuda")
    with pytest.raises(ConfigError, match="timeout_s must be a positive number of seconds, got 0"):
        init_distributed("cpu", timeout_s=0)


# ---------------------------------------------------------------------------------------------- timeout


def _stalled_rank(flag: str) -> dict:
    """Rank 1 stops calling collectives until rank 0 has given up; rank 0 must not wait for it."""
    import os
    import time
    from pathlib import Path

    from fullshard.distributed import detect_device_type

    strategy = FSDPStrategy(bf16=False, train_batch_size=2, config={"timeout_s": 3})
    strategy.setup_distributed()  # the harness started no group: the strategy's timeout is the one in force
    rank = torch.distributed.get_rank()
    out = {"device": detect_device_type(), "error": None}
    try:
        if rank == 1:
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.1)
        out["peer_stalled_at_error"] = not os.path.exists(flag)
        torch.distributed.all_reduce(torch.ones(1))
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        out["error"] = f"{type(err).__name__}: {err}"
        out["peer_stalled_at_error"] = rank == 0 and not os.path.exists(flag)
    finally:
        if rank == 0:
            Path(flag).touch()
    return out


def test_a_stalled_rank_makes_every_rank_fail_within_the_timeout(tmp_path):
    # run_distributed's own timeout only guards the test: without the process-group timeout rank 0
    # would wait for the backend default (30 minutes) and this would fail with "timed out after 120s"
    results = run_distributed(_stalled_rank, 2, str(tmp_path / "released"), init=False, timeout=120)
    assert [r["device"] for r in results] == ["cpu", "cpu"]  # the harness runs CPU ranks on any machine
    assert results[0]["error"] and "timed out" in results[0]["error"].lower(), results[0]
    assert results[0]["peer_stalled_at_error"]  # it gave up while rank 1 was still away
    assert results[1]["error"], results[1]  # the stalled rank fails too when it comes back


# ---------------------------------------------------------------------------------------------- GPUs


def _gpu_checks() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", rank)
    out = run(make_strategy(micro=8 // world),
              rank_batch=lambda step: {k: v.to(device) for k, v in data_slice(masked_batch(step), rank, world).items()})
    return {"loss": out["loss"], "norm": out["norm"], "backend": torch.distributed.get_backend()}


def test_strategy_on_gpus_matches_one_cpu_process():
    """The same training on one or two GPUs (NCCL; skipped without one): what the CPU tests show, on the device."""
    world = min(2, torch.cuda.device_count()) or 1
    results = run_distributed(_gpu_checks, world, device="cuda")
    assert all("nccl" in r["backend"] for r in results), results
    reference = reference_run()
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["loss"], reference["loss"])) < 1e-4
        assert max(abs(a - b) for a, b in zip(r["norm"], reference["norm"])) < 1e-4


def _resume_on_another_window():
    saving = FSDPStrategy(micro_train_batch_size=1, train_batch_size=4, bf16=False)  # window 4 at world 1
    saving.setup_distributed()
    saving._micro_step = 12  # 3 optimizer steps
    state = saving.state_dict()
    state["window"] = 2  # as saved where the window was 2 (twice the ranks): 12 micro-steps are 6 steps there
    loading = FSDPStrategy(micro_train_batch_size=1, train_batch_size=4, bf16=False)
    loading.setup_distributed()
    loading.load_state_dict(state)
    return loading._micro_step, loading.is_last_micro_step()


def test_micro_step_counter_resumes_in_optimizer_steps_on_another_window():
    """A checkpoint from another world size has another window: the step count, not the micro count, carries over."""
    micro_step, last = run_distributed(_resume_on_another_window, 1)[0]
    assert micro_step == 6 * 4 and not last


# ---------------------------------------------------------------------------------------------- meta context


def _from_pretrained_in_meta_context(model_dir: str, out: str):
    """The README's natural form: transformers' own `from_pretrained` inside the meta context, then
    `prepare_model` loads each rank's slice; the model's exports name the model's own class."""
    from transformers import AutoModelForCausalLM

    from fullshard import CheckpointManager, export_hf

    strategy = make_strategy(micro=2, train=4)
    with strategy.init_model_context(meta_init=True):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    on_meta = all(p.is_meta for p in model.parameters())
    model = strategy.prepare_model(model, is_training=True)
    export_hf(model, f"{out}/hf")
    CheckpointManager(f"{out}/checkpoints").save(1, model)
    return {"on_meta": on_meta, "weights": full_state(model)}


def test_from_pretrained_in_the_meta_context_loads_and_exports_name_the_model_class(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from fullshard import export_checkpoint

    build_model(NAME).save_pretrained(tmp_path / "model")
    results = run_distributed(_from_pretrained_in_meta_context, 2, str(tmp_path / "model"), str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    for r in results:
        assert r["on_meta"]
        assert max_diff(r["weights"], reference) == 0.0
    export_checkpoint(tmp_path / "checkpoints", tmp_path / "offline")
    for exported in ("hf", "offline"):
        config = json.loads((tmp_path / exported / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"], (exported, config["architectures"])
        AutoModelForCausalLM.from_pretrained(tmp_path / exported)
