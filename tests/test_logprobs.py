"""`fullshard.token_logprobs` on sharded models against one process's `log_softmax(logits / T).gather`.

Each layout gets the same check (`_against_reference`): the values of this rank's rows and the
gradients of a random weighting of log-probs and entropies, through the chunked head on the sharded
model and through whole fp32 logits on one process with the whole batch. World 2 runs FSDP (untied
Llama, tied Qwen3), Qwen3-MoE at ep 2, tp 2, LoRA and a Qwen2-VL batch with an image on one rank
only, in one spawned group; world 4 runs dp 2 x tp 2 and the tied model, in another.
"""

import copy

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

from fullshard import FSDP2Engine, token_logprobs
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.testing.compare import full_tensor

TOL = 1e-5
VOCAB, CHUNK, T = 1000, 16, 0.7
LLAMA_LAYERS_TP = {f"model.layers.*.{m}": s for m, s in {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}.items()}


def reference_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's log-probs and entropies from whole fp32 logits (what TRL computes)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logp = torch.log_softmax(model(**inputs, use_cache=False).logits[:, :-1].float() / T, dim=-1)
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    picked = logp.gather(-1, torch.where(valid, targets, 0)[..., None]).squeeze(-1) * valid
    return picked, -(logp.exp() * logp).sum(-1) * valid


def _weights(shape) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _against_reference(reference, model, batch: dict, dp_rank: int, dp_size: int) -> dict:
    """Largest differences of values (this rank's rows, the max over ranks) and of gradients."""
    mine = batch.pop("mine", None)
    lp, ent = reference_logprobs(reference, batch)
    w1, w2 = _weights(lp.shape)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    rows = slice(dp_rank * len(lp) // dp_size, (dp_rank + 1) * len(lp) // dp_size)
    if mine is None:  # a VLM batch brings this rank's rows with their images
        mine = {k: v[rows] for k, v in batch.items()}
    got, got_ent = token_logprobs(model, mine.pop("input_ids"), mine.pop("labels"), temperature=T,
                                  chunk_tokens=CHUNK, return_entropy=True, **mine)
    # FSDP averages gradients over the dp ranks: each rank's part times dp_size sums them
    (((got * w1[rows]).sum() + (got_ent * w2[rows]).sum()) * dp_size).backward()
    values = torch.tensor([(got - lp[rows]).abs().max().item(), (got_ent - ent[rows]).abs().max().item()])
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    ref = dict(reference.named_parameters())
    grads = {n: (full_tensor(p.grad) - ref[n].grad).abs().max().item()
             for n, p in model.named_parameters() if p.requires_grad}
    return {"logprobs": values[0].item(), "entropy": values[1].item(), "grad": max(grads.values()),
            "scale": max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None),
            "grads": len(grads)}


def _text_case(name: str, engine_settings: dict, dp_rank: int, dp_size: int, lora: bool = False) -> dict:
    reference = build_model(name, vocab_size=VOCAB)
    if lora:
        torch.manual_seed(7)
        reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = FSDP2Engine({"mixed_precision": "fp32", **engine_settings}).prepare_model(copy.deepcopy(reference))
    batch = make_batch(name, batch_size=8, seq_len=16, seed=3)
    batch["labels"][0, :5] = -100
    return _against_reference(reference, model, batch, dp_rank, dp_size)


def _vlm_case() -> dict:
    """Qwen2-VL with an image in rank 0's rows only: rank 1 runs the vision path on a stand-in."""
    from fullshard.testing.vlm_zoo import VLMInputs, build_vlm

    reference = build_vlm("qwen2_vl")
    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(copy.deepcopy(reference))
    inputs, flags, rank = VLMInputs(reference), [True, False, False, False], dist.get_rank()
    batch = inputs.batch(flags)
    batch["mine"] = inputs.batch(flags, rows=range(2 * rank, 2 * rank + 2))
    return _against_reference(reference, model, batch, rank, 2)


def _pipelined_case(name: str, dp_rank: int, dp_size: int) -> dict:
    """pp 2 (x dp): the last stage computes the log-probs and entropies, every rank gets them; the
    data ranks hold different numbers of rows and columns (the pipeline pads to agreed shapes)."""
    from fullshard.errors import ConfigError

    reference = build_model(name, vocab_size=VOCAB)
    engine = FSDP2Engine({"mixed_precision": "fp32", "pp_size": 2, "pp_schedule": "GPipe"})
    model = engine.prepare_model(copy.deepcopy(reference))
    batch = make_batch(name, batch_size=8, seq_len=16, seed=3)
    batch["labels"][0, :5] = -100
    with torch.no_grad():
        lp, ent = reference_logprobs(reference, batch)
    rows, width = (slice(0, 5), 16) if dp_rank == 0 else (slice(5, 8), 11)
    ids, labels = batch["input_ids"][rows, :width], batch["labels"][rows, :width]
    with torch.no_grad():
        got, got_ent = token_logprobs(model, ids, labels, temperature=T, chunk_tokens=CHUNK,
                                      return_entropy=True)
    values = torch.tensor([(got - lp[rows, :width - 1]).abs().max().item(),
                           (got_ent - ent[rows, :width - 1]).abs().max().item()])
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    try:
        token_logprobs(model, ids, labels)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return {"logprobs": values[0].item(), "entropy": values[1].item(), "shape": tuple(got.shape),
            "refused_with_grad": refused}


def _check_pipelined(per_rank: list[dict], name: str) -> list[str]:
    problems = []
    for rank, result in enumerate(per_rank):
        r = result[name]
        for key in ("logprobs", "entropy"):
            if not r[key] <= TOL:
                problems.append(f"rank {rank} {name}: {key} differ by {r[key]:.2e}")
        if "torch.no_grad()" not in r["refused_with_grad"]:
            problems.append(f"rank {rank} {name}: a call with gradients enabled was not refused")
    return problems


def _world_2() -> dict:
    rank = dist.get_rank()
    return {
        "llama": _text_case("llama", {}, rank, 2),
        "qwen3_tied": _text_case("qwen3", {}, rank, 2),
        "qwen3_moe_ep2": _text_case("ep_qwen3_moe", {"ep_size": 2}, rank, 2),
        "tp2": _text_case("llama", {"tp_size": 2, "tp_plan": LLAMA_LAYERS_TP}, 0, 1),
        "lora": _text_case("llama", {}, rank, 2, lora=True),
        "qwen2_vl_image_on_one_rank": _vlm_case(),
        "pp2": _pipelined_case("qwen3", 0, 1),
    }


def _world_4() -> dict:
    rank = dist.get_rank()
    return {
        "dp2_tp2": _text_case("llama", {"tp_size": 2, "tp_plan": LLAMA_LAYERS_TP}, rank // 2, 2),
        "qwen3_tied": _text_case("qwen3", {}, rank, 4),
        "dp2_pp2": _pipelined_case("llama", rank % 2, 2),
    }


def _problems(results: dict) -> list[str]:
    problems = []
    for name, r in results.items():
        if r["grads"] == 0:
            problems.append(f"{name}: no trainable parameter compared")
        for key in ("logprobs", "entropy"):
            if not r[key] <= TOL:
                problems.append(f"{name}: {key} differ by {r[key]:.2e}")
        if not r["grad"] <= TOL * max(1.0, r["scale"]):
            problems.append(f"{name}: gradients differ by {r['grad']:.2e} (largest {r['scale']:.2e})")
    return problems


def test_token_logprobs_world_2_matches_one_process():
    per_rank = run_distributed(_world_2, world_size=2)
    problems = _check_pipelined(per_rank, "pp2")
    results = {k: v for k, v in per_rank[0].items() if k != "pp2"}
    assert not _problems(results) + problems, _problems(results) + problems


def test_token_logprobs_world_4_matches_one_process():
    per_rank = run_distributed(_world_4, world_size=4)
    problems = _check_pipelined(per_rank, "dp2_pp2")
    results = {k: v for k, v in per_rank[0].items() if k != "dp2_pp2"}
    assert not _problems(results) + problems, _problems(results) + problems


def test_token_logprobs_plain_model_and_default_labels():
    """On a plain model, labels default to the inputs; entries past an ignored label are 0."""
    model = build_model("qwen3", vocab_size=VOCAB)
    batch = make_batch("qwen3", batch_size=2, seq_len=10, seed=4)
    ref, _ = reference_logprobs(model, {**batch, "labels": batch["input_ids"]})
    got = token_logprobs(model, batch["input_ids"], temperature=T, chunk_tokens=3)
    assert got.shape == (2, 9) and (got - ref).abs().max() <= TOL
    labels = batch["input_ids"].clone()
    labels[:, 4] = -100
    assert (token_logprobs(model, batch["input_ids"], labels, temperature=T)[:, 3] == 0).all()
