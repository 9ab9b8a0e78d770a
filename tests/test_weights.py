"""Hub-layout exports and the weight stream (`fullshard.hf_weights`), against the export and transformers.

- Every MoE family the tests build, at ep 1, 2 and 4: `export_hf` writes the key set and shapes of
  transformers' `save_pretrained` for the same model, and loads in transformers with its logits.
- `hf_weights` at world 2 and 4 yields exactly what `export_hf` writes (names, shapes, dtypes, bits)
  for FSDP, HSDP, TP, CP, EP, PP, LoRA merged and adapter-only, buffers, a bf16 cast; one all-gather
  per bucket; training after iterating goes on with the losses of a run that never iterated.
- A half-precision export (and stream) keeps in fp32 what transformers keeps there: a bf16 DeepSeek-V3
  its router weights and `e_score_correction_bias` (`_keep_in_fp32_modules_strict`), an fp16 GPT-OSS
  its norms (`_keep_in_fp32_modules`): the tensors of `from_pretrained(dtype=...)` + `save_pretrained`.
- Memory: a 224 MB model streamed in 16 MiB buckets peaks at most 2 buckets + its largest tensor
  above where it started, where gathering the full state dict needs the whole model.
- `checkpoint_hf_weights` (one process, no group) equals the offline export of the same checkpoint.
- The parts of a Hub tensor fused from several land where `torch.cat` puts them, any cut, any dim.
"""

from __future__ import annotations

import glob
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard import FSDP2Engine
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.testing.zoo import MOE_ZOO

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
FAMILIES = sorted(MOE_ZOO)


def read_dir(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(glob.glob(f"{path}/*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names, shapes, dtypes and bits that differ (empty when identical)."""
    problems = [f"only streamed: {sorted(set(got) - set(want))[:4]}"] if set(got) - set(want) else []
    problems += [f"never streamed: {sorted(set(want) - set(got))[:4]}"] if set(want) - set(got) else []
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            problems.append(f"{name}: values differ")
    return problems


def streamed(model, **kwargs) -> tuple[dict[str, torch.Tensor], int, int]:
    """Every (name, tensor) of `hf_weights`, the number of buckets and of all-gathers it ran."""
    import fullshard
    import fullshard.weights

    calls = []
    original = fullshard.weights.all_gather_slots

    def counted(*args, **kw):
        calls.append(1)
        return original(*args, **kw)

    with mock.patch.object(fullshard.weights, "all_gather_slots", counted):
        buckets = [[(n, t.to("cpu", copy=True)) for n, t in b] for b in fullshard.hf_weight_buckets(model, **kwargs)]
    out = {}
    for name, tensor in (pair for bucket in buckets for pair in bucket):
        assert name not in out, f"{name} streamed twice"
        out[name] = tensor
    return out, len(buckets), len(calls)


def to_first(model, **kwargs) -> dict:
    """What `buckets_to_first` (WeightSync's stream) gives the first rank, with the counts every rank
    reports and how many of its buckets lie in one run of their buffer (sent with no packing copy)."""
    from fullshard.weight_sync import buckets_to_first, lying_together

    pairs, tensors, nbytes, together, buckets = {}, 0, 0, 0, 0
    for bucket in buckets_to_first(model, lambda n: torch.full((n,), 7, dtype=torch.uint8), **kwargs):
        buckets, tensors, nbytes = buckets + 1, tensors + bucket.tensors, nbytes + bucket.nbytes
        together += lying_together(bucket.pairs, torch.device("cpu")) is not None
        pairs.update((n, t.clone()) for n, t in bucket.pairs)
    return {"pairs": pairs, "counts": (tensors, nbytes), "together": together, "buckets": buckets}


def _stream_vs_export(model, root: Path, label: str, **kwargs) -> dict:
    """`hf_weights` (and WeightSync's stream to the first rank) against the export it must equal, on every rank."""
    from fullshard.checkpoint import export_hf

    export_hf(model, root / label, dtype=kwargs.get("dtype"))
    exported = read_dir(root / label)
    got, buckets, gathers = streamed(model, bucket_bytes=4096, **kwargs)
    one, one_bucket, _ = streamed(model, **kwargs)
    first = to_first(model, bucket_bytes=4096, **kwargs)
    counts = (len(exported), sum(t.numel() * t.element_size() for t in exported.values()))
    return {"diff": differences(got, exported), "buckets": buckets, "gathers": gathers,
            "default_buckets": one_bucket, "default_diff": differences(one, got),
            "to_first": differences(first["pairs"], exported if dist.get_rank() == 0 else {}),
            "to_first_counts": first["counts"] == counts, "to_first_buckets": first["buckets"] == buckets,
            "to_first_together": first["together"] == (first["buckets"] if dist.get_rank() == 0 else 0)}


def _moe_export(name: str, ep: int, root: Path) -> dict:
    """The export of `name` at `ep` against transformers' `save_pretrained` of the same model: key set,
    shapes, and the logits of the export loaded in transformers."""
    import transformers

    from fullshard.checkpoint import export_hf

    model = FSDP2Engine({"ep_size": ep, "mixed_precision": "fp32"}).prepare_model(build_model(name))
    export_hf(model, root / f"{name}_ep{ep}")
    out = {}
    if dist.get_rank() == 0:
        reference = build_model(name).eval()
        reference.save_pretrained(root / f"{name}_hf")
        ours = {k: tuple(v.shape) for k, v in read_dir(root / f"{name}_ep{ep}").items()}
        theirs = {k: tuple(v.shape) for k, v in read_dir(root / f"{name}_hf").items()}
        out["keys"] = (sorted(set(ours) ^ set(theirs)), len(theirs))
        out["shapes"] = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
        loaded = getattr(transformers, type(reference).__name__).from_pretrained(root / f"{name}_ep{ep}").eval()
        batch = make_batch(name, batch_size=2)
        with torch.no_grad():
            out["logits"] = (loaded(input_ids=batch["input_ids"]).logits
                             - reference(input_ids=batch["input_ids"]).logits).abs().max().item()
    return out


def _lora_model(steps: int = 1):
    """A sharded LoRA llama whose adapters have trained (B is no longer zero), with its optimizer."""
    from fullshard.lora import apply_lora

    torch.manual_seed(7)
    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(apply_lora(build_model("llama"), LORA))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _steps(model, optimizer, range(steps), "llama")
    return model, optimizer


def _steps(model, optimizer, steps, name: str, dp: tuple[int, int] | None = None) -> list[float]:
    from harness.compare import data_slice

    rank, world = dp or (dist.get_rank(), dist.get_world_size())
    losses = []
    for step in steps:
        loss = model(**data_slice(make_batch(name, seed=200 + step), rank, world)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def _lora_checks(root: Path) -> dict:
    from fullshard.lora import export_merged, save_adapter

    model, _ = _lora_model()
    export_merged(model, root / "merged")
    save_adapter(model, root / "adapter")
    merged, _, _ = streamed(model, bucket_bytes=4096)
    adapter, _, _ = streamed(model, lora="adapter")
    first = dist.get_rank() == 0
    merged_first = to_first(model, bucket_bytes=4096)["pairs"]
    adapter_first = to_first(model, lora="adapter")["pairs"]
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return {"merged": differences(merged, read_dir(root / "merged")),
            "adapter": differences(adapter, read_dir(root / "adapter")),
            "to_first": (differences(merged_first, merged if first else {})
                         + differences(adapter_first, adapter if first else {})),
            "module_untouched": all(torch.equal(before[n], p.detach().to_local()) for n, p in model.named_parameters())}


def _continues(name: str, lora: bool = False) -> dict:
    """Two runs from the same start, one iterating the stream (and a LoRA one merging) between steps."""
    runs = []
    for iterate in (True, False):
        if lora:
            model, optimizer = _lora_model(steps=0)
        else:
            model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model(name))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = _steps(model, optimizer, range(2), name)
        if iterate:
            for _ in streamed(model, bucket_bytes=8192)[0]:
                pass
        losses += _steps(model, optimizer, range(2, 5), name)
        runs.append(losses)
    return {"losses": runs}


def _checkpoint_checks(root: Path) -> dict:
    """A checkpoint of an ep 2 MoE: its offline export, `checkpoint_hf_weights` and the live stream agree."""
    from fullshard import checkpoint_hf_weights
    from fullshard.checkpoint import CheckpointManager, export_checkpoint

    model = FSDP2Engine({"ep_size": 2, "mixed_precision": "fp32"}).prepare_model(build_model("ep_deepseek_v3"))
    CheckpointManager(root / "ckpt", async_save=False).save(1, model)
    live, _, _ = streamed(model)
    streamed_bf16, _, _ = streamed(model, dtype=torch.bfloat16)
    out = {}
    if dist.get_rank() == 0:
        export_checkpoint(root / "ckpt", root / "offline")
        offline = dict(checkpoint_hf_weights(root / "ckpt"))
        out["offline"] = differences(offline, read_dir(root / "offline"))
        out["live"] = differences(live, offline)
        bf16 = dict(checkpoint_hf_weights(root / "ckpt", dtype=torch.bfloat16))
        out["bf16"] = sorted({str(t.dtype) for t in bf16.values()})
        out["bf16_fp32"] = sorted(k for k, t in bf16.items() if t.dtype == torch.float32)
        export_checkpoint(root / "ckpt", root / "offline_bf16", dtype=torch.bfloat16)
        out["bf16_offline"] = differences(bf16, read_dir(root / "offline_bf16"))
        out["bf16_live"] = differences(streamed_bf16, bf16)
    return out


def _with_buffers(name: str):
    """`name` with its persistent buffers set to values a stream that skipped them would miss."""
    model = build_model(name)
    for key, buffer in model.named_buffers():
        if key.endswith("e_score_correction_bias"):
            buffer.copy_(torch.linspace(-1, 1, buffer.numel()))
    return model


def _half_save_pretrained(build, dtype: torch.dtype, root: Path, label: str) -> dict:
    """The export `label` of the model `build()` makes, cast to `dtype`, against transformers' own: the
    model's fp32 save loaded with `from_pretrained(dtype=dtype)`, then `save_pretrained` (rank 0)."""
    if dist.get_rank() != 0:
        return {}
    model = build()
    model.save_pretrained(root / f"{label}_fp32")
    type(model).from_pretrained(root / f"{label}_fp32", dtype=dtype).save_pretrained(root / f"{label}_hf")
    ours = read_dir(root / label)
    return {"diff": differences(ours, read_dir(root / f"{label}_hf")),
            "fp32": sorted(k for k, t in ours.items() if t.dtype == torch.float32)}


def _world_2(root: str) -> dict:
    root, out = Path(root), {}
    fsdp = lambda name: FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model(name))  # noqa: E731
    out["llama"] = _stream_vs_export(fsdp("llama"), root, "llama")
    out["qwen3_tied"] = _stream_vs_export(fsdp("qwen3"), root, "qwen3")
    out["llama_bf16"] = _stream_vs_export(fsdp("llama"), root, "llama_bf16", dtype=torch.bfloat16)
    ep2 = FSDP2Engine({"ep_size": 2, "mixed_precision": "fp32"})
    out["qwen3_moe_ep2"] = _stream_vs_export(ep2.prepare_model(build_model("ep_qwen3_moe")), root, "qwen3_moe_ep2")
    out["deepseek_v3_ep2"] = _stream_vs_export(ep2.prepare_model(_with_buffers("ep_deepseek_v3")), root, "dsv3")
    out["dsv3_bias_in_stream"] = [k for k in read_dir(root / "dsv3") if k.endswith("e_score_correction_bias")]
    dsv3 = lambda: _with_buffers("ep_deepseek_v3")  # noqa: E731
    out["dsv3_bf16"] = _stream_vs_export(ep2.prepare_model(dsv3()), root, "dsv3_bf16", dtype=torch.bfloat16)
    out["gpt_oss_fp16"] = _stream_vs_export(fsdp("ep_gpt_oss"), root, "gpt_oss_fp16", dtype=torch.float16)
    out["half_vs_save_pretrained"] = {
        "dsv3_bf16": _half_save_pretrained(dsv3, torch.bfloat16, root, "dsv3_bf16"),
        "gpt_oss_fp16": _half_save_pretrained(lambda: build_model("ep_gpt_oss"), torch.float16, root, "gpt_oss_fp16")}
    pp2 = FSDP2Engine({"pp_size": 2, "mixed_precision": "fp32"})
    out["llama_pp2"] = _stream_vs_export(pp2.prepare_model(build_model("llama")), root, "llama_pp2")
    out["qwen3_pp2_tied"] = _stream_vs_export(pp2.prepare_model(build_model("qwen3")), root, "qwen3_pp2")
    out["qwen3_pp2_head_written"] = "lm_head.weight" in read_dir(root / "qwen3_pp2")  # tied: once, as the embedding
    # per-expert ModuleList experts at ep 2: each rank holds its own experts' modules, the others' names elsewhere
    out["list_moe_ep2"] = _stream_vs_export(ep2.prepare_model(build_model("list_mixtral")), root, "list_moe_ep2")
    out["lora"] = _lora_checks(root)
    out["continues"] = _continues("llama")
    out["continues_lora"] = _continues("llama", lora=True)
    out["checkpoint"] = _checkpoint_checks(root)
    out["moe_export"] = {(name, ep): _moe_export(name, ep, root) for name in FAMILIES for ep in (1, 2)}
    return out


def _world_4(root: str) -> dict:
    root, out = Path(root), {}
    layouts = {"fsdp4": {}, "hsdp2x2": {"dp_replicate": 2}, "dp2_tp2": {"tp_size": 2}, "dp2_cp2": {"cp_size": 2}}
    for label, config in layouts.items():
        for name in ("llama", "qwen3"):
            engine = FSDP2Engine({"mixed_precision": "fp32", **config})
            out[(label, name)] = _stream_vs_export(engine.prepare_model(build_model(name)), root, f"{label}_{name}")
    ep4 = FSDP2Engine({"ep_size": 4, "mixed_precision": "fp32"})
    out[("ep4", "qwen3_moe")] = _stream_vs_export(ep4.prepare_model(build_model("ep_qwen3_moe")), root, "ep4")
    out[("ep2_efsdp2", "qwen3_moe")] = _stream_vs_export(
        FSDP2Engine({"ep_size": 2, "mixed_precision": "fp32"}).prepare_model(build_model("ep_qwen3_moe")), root, "ep2x2")
    out["moe_export"] = {(name, 4): _moe_export(name, 4, root) for name in FAMILIES}
    return out


@pytest.fixture(scope="module")
def world_2(tmp_path_factory):
    return run_distributed(_world_2, 2, str(tmp_path_factory.mktemp("weights2")))


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    return run_distributed(_world_4, 4, str(tmp_path_factory.mktemp("weights4")))


def _assert_stream(result: dict, label) -> None:
    assert result["diff"] == [] and result["default_diff"] == [], (label, result)
    assert result["to_first"] == [] and result["to_first_counts"] and result["to_first_buckets"], (label, result)
    assert result["to_first_together"], (label, result)  # every bucket sent from where it was put together
    assert result["buckets"] > 1 and result["gathers"] == result["buckets"], (label, result)  # one all-gather per bucket
    assert result["default_buckets"] == 1, (label, result)


@pytest.mark.parametrize("label", ["llama", "qwen3_tied", "llama_bf16", "qwen3_moe_ep2", "deepseek_v3_ep2", "llama_pp2",
                                   "qwen3_pp2_tied", "list_moe_ep2", "dsv3_bf16", "gpt_oss_fp16"])
def test_stream_equals_export_at_world_2(world_2, label):
    for r in world_2:
        _assert_stream(r[label], label)
    assert world_2[0]["dsv3_bias_in_stream"], "DeepSeek-V3's e_score_correction_bias buffers are exported and streamed"
    assert not world_2[0]["qwen3_pp2_head_written"]


def test_stream_equals_export_at_world_4(world_4):
    for r in world_4:
        for label, result in r.items():
            if label != "moe_export":
                _assert_stream(result, label)


def test_half_exports_keep_in_fp32_what_transformers_keeps(world_2):
    result = world_2[0]["half_vs_save_pretrained"]
    for label, r in result.items():
        assert r["diff"] == [], (label, r)
    layers = range(2)
    assert result["dsv3_bf16"]["fp32"] == [f"model.layers.{i}.mlp.gate.{leaf}" for i in layers
                                           for leaf in ("e_score_correction_bias", "weight")]
    assert result["gpt_oss_fp16"]["fp32"] == sorted([f"model.layers.{i}.{norm}.weight" for i in layers
                                                     for norm in ("input_layernorm", "post_attention_layernorm")]
                                                    + ["model.norm.weight"])


def test_lora_stream_merged_and_adapter_equal_their_exports(world_2):
    for r in world_2:
        assert r["lora"]["merged"] == [] and r["lora"]["adapter"] == [] and r["lora"]["to_first"] == [], r["lora"]
        assert r["lora"]["module_untouched"]


@pytest.mark.parametrize("run", ["continues", "continues_lora"])
def test_training_after_streaming_continues_as_if_never_streamed(world_2, run):
    for r in world_2:
        iterated, plain = r[run]["losses"]
        assert iterated == plain, (iterated, plain)


def test_checkpoint_weights_equal_the_offline_export_and_the_live_stream(world_2):
    result = world_2[0]["checkpoint"]
    assert result["offline"] == [] and result["live"] == [], result
    assert result["bf16"] == ["torch.bfloat16", "torch.float32"], result  # the router's, as transformers keeps it
    assert result["bf16_fp32"] == [f"model.layers.{i}.mlp.gate.{leaf}" for i in range(2)
                                   for leaf in ("e_score_correction_bias", "weight")], result
    assert result["bf16_offline"] == [] and result["bf16_live"] == [], result


def test_moe_exports_have_the_hub_layout_at_ep_1_2_and_4(world_2, world_4):
    checked = {**world_2[0]["moe_export"], **world_4[0]["moe_export"]}
    assert len(checked) == 3 * len(FAMILIES)
    for (name, ep), r in checked.items():
        assert r["keys"][0] == [] and r["shapes"] == [], (name, ep, r)
        assert r["logits"] < 1e-5, (name, ep, r)


# ------------------------------------------------------------------ memory

MiB = 2**20
BIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=3, num_attention_heads=8,
           num_key_value_heads=8)  # 224 MB in fp32, the largest tensors (MLP, embedding, head) 16 MiB


def _rss_peak_reset() -> int:
    """Reset the kernel's high-water mark of this process to its current RSS; that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _memory() -> dict:
    import gc

    from harness.compare import full_tensor

    import fullshard

    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model("llama", **BIG))
    sizes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    gc.collect()
    dist.barrier()
    start = _rss_peak_reset()
    count, checksum = 0, 0.0
    for name, tensor in fullshard.hf_weights(model, bucket_bytes=16 * MiB):
        count, checksum = count + 1, checksum + float(tensor[0].sum())
        del tensor
    stream_peak = _status("VmHWM") - start
    gc.collect()
    start = _rss_peak_reset()
    state = {k: full_tensor(v) for k, v in model.state_dict().items()}  # the full state dict, gathered
    full_peak = _status("VmHWM") - start
    del state
    return {"model_bytes": sum(sizes.values()), "largest": max(sizes.values()), "stream_peak": stream_peak,
            "full_peak": full_peak, "count": count}


def test_stream_memory_stays_within_two_buckets_and_the_largest_tensor(monkeypatch):
    # big allocations mapped and unmapped each time, so freed memory leaves the resident set
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    for r in run_distributed(_memory, 2, fresh=True):  # malloc reads the setting when a process starts
        print({k: f"{v / MiB:.1f} MiB" if k != "count" else v for k, v in r.items()})
        assert r["model_bytes"] >= 200 * 10**6 and r["count"] == 3 * 9 + 3, r
        assert r["stream_peak"] <= 2 * 16 * MiB + r["largest"], r
        assert r["full_peak"] >= 0.9 * r["model_bytes"], r


# ------------------------------------------------------------------ one process

@pytest.mark.parametrize("name", FAMILIES)
def test_one_process_export_and_stream_are_save_pretrained_bit_for_bit(tmp_path, name):
    import fullshard
    from fullshard.checkpoint import export_hf

    model = build_model(name)
    export_hf(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    assert differences(read_dir(tmp_path / "ours"), read_dir(tmp_path / "theirs")) == []
    assert differences(dict(fullshard.hf_weights(model, bucket_bytes=1024)), read_dir(tmp_path / "theirs")) == []


def test_a_fused_tensors_parts_land_where_torch_cat_puts_them():
    """The region writer's arithmetic for a Hub tensor fused from several (`slot_runs`): any rank's
    run of a part's elements (rows of FSDP's shards, or any cut) lands where `torch.cat` puts it,
    along every dim; one write per part when fused along the first dim (Qianfan-OCR's `qkv`)."""
    from fullshard.hf.export import Slot, slot_runs

    generator = torch.Generator().manual_seed(0)
    for dim in range(3):
        shapes = [[2 + i if d == dim else 3 + d for d in range(3)] for i in range(3)]
        parts = [torch.randn(*shape, generator=generator) for shape in shapes]
        fused = torch.cat(parts, dim)
        written, start = torch.full((fused.numel(),), float("nan")), 0
        for part in parts:
            slot, flat = Slot(dim, start, tuple(fused.shape)), part.reshape(-1)
            inner = torch.randint(0, flat.numel(), (3,), generator=generator).tolist()
            cuts = sorted({0, flat.numel(), *inner})
            for lo, hi in zip(cuts, cuts[1:]):
                runs = slot_runs(slot, tuple(part.shape), lo, hi)
                assert dim > 0 or len(runs) == 1, runs
                for at, a, b in runs:
                    written[at:at + b - a] = flat[a:b]
            start += part.shape[dim]
        assert torch.equal(written.view(fused.shape), fused), dim


def test_bad_stream_arguments_are_named():
    import fullshard

    model = build_model("llama")
    with pytest.raises(ValueError, match="lora must be 'merge' or 'adapter', got 'merged'"):
        next(fullshard.hf_weights(model, lora="merged"))
    with pytest.raises(ValueError, match="lora='adapter' needs a peft.PeftModel, got LlamaForCausalLM"):
        next(fullshard.hf_weights(model, lora="adapter"))
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        next(fullshard.hf_weights(model, bucket_bytes=0))
