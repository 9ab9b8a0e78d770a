"""Token-budget micro-batches, and a policy update from fixed rollouts that does not depend on the
split: the ranks agree on the number of micro-batches; offload + onload between steps changes
nothing; log-probs without gradients (the policy's, an offloaded reference's, LoRA's adapter-off
reference's) equal one process's; the same rollouts at world 4 (dp 4 with a 64-token and a 4096-token budget, dp 2 x tp 2, LoRA,
Qwen3-MoE at ep 2) give one process's losses, grad norms and weights (fp32, AdamW eps 1e-5, two steps: the second
with the ratio away from 1, so the clips act; losses within 1e-5 relative to max(1, |loss|), as
`token-sum` losses are sums of ~100 terms). One spawned group runs every layout."""

import pytest
import torch
import torch.distributed as dist

from fullshard import rl
from fullshard.rl.update import Rollouts, UpdateConfig, policy_update
from fullshard.testing.spawn import run_distributed

# ---------------------------------------------------------------------------------- token_batches


@pytest.mark.parametrize("padded", [False, True])
def test_token_batches_respect_the_budget(padded):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (37,), generator=generator).tolist() + [90]
    batches = rl.token_batches(lengths, 64, padded=padded)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))

    def cost(b):
        return max(lengths[i] for i in b) * len(b) if padded else sum(lengths[i] for i in b)

    for b in batches:
        assert cost(b) <= 64 or b == [len(lengths) - 1], (b, cost(b))  # the 90-token one alone
        assert b == sorted(b)
    for a in batches:  # no two micro-batches would fit in one
        assert all(cost(a + b) > 64 for b in batches if b is not a)
    assert rl.token_batches(lengths, 64, padded=padded) == batches  # deterministic


def test_token_batches_edges():
    assert rl.token_batches([5, 5, 5], 4096) == [[0, 1, 2]]
    assert rl.token_batches([], 64) == [[]]  # a rank with nothing still runs one (stand-in) forward
    with pytest.raises(ValueError, match="max_tokens=0"):
        rl.token_batches([3], 0)


# ---------------------------------------------------------------------------------- the update


SEQUENCES, GROUP, LR = 16, 4, 1e-2


def _rollouts(seed: int = 0) -> Rollouts:
    """Prompts and completions of varied lengths, right-padded; rewards, GRPO advantages; old and
    reference log-probs near the starting model's (so ratios fall on both sides of the clips)."""
    from fullshard.testing.zoo import build_model

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 6, (SEQUENCES,), generator=generator)
    completion = torch.randint(1, 24, (SEQUENCES,), generator=generator)
    width = int((prompt + completion).max())
    ids = torch.randint(1, 101, (SEQUENCES, width), generator=generator)
    positions = torch.arange(width)[None]
    attention = (positions < (prompt + completion)[:, None]).long()
    ids = ids * attention
    # next-token position t scores token t + 1: a completion token sits at t + 1 >= prompt
    response = ((positions[:, 1:] + 1 >= prompt[:, None]) & (attention[:, 1:] == 1)).float()
    rewards = torch.rand(SEQUENCES, generator=generator)
    with torch.no_grad():
        logits = build_model("llama")(input_ids=ids, attention_mask=attention).logits
        base = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    noise = torch.randn(2, *base.shape, generator=generator) * 0.3
    return Rollouts(ids, attention, response, rl.group_advantages(rewards, GROUP),
                    (base + noise[0]) * response, (base + noise[1]) * response)


CASES = {  # name -> (layout, UpdateConfig)
    "dp4_ppo_64": ("dp", UpdateConfig(max_tokens=64, kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=1.5)),
    "dp4_ppo_4096": ("dp", UpdateConfig(max_tokens=4096, kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=1.5)),
    "dp4_cispo_norm": ("dp", UpdateConfig(max_tokens=40, loss_type="cispo", agg="seq-mean-token-sum-norm",
                                          loss_scale_factor=16, kl_coef=0.05, kl_kind="k2")),
    "dp2tp2_gspo": ("tp", UpdateConfig(max_tokens=48, loss_type="gspo", agg="seq-mean-token-mean",
                                       clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
    "dp2tp2_ppo_sum": ("tp", UpdateConfig(max_tokens=64, agg="token-sum", max_norm=0.5)),
    "lora_dp4": ("lora", UpdateConfig(max_tokens=64, kl_coef=0.1)),
    "qwen3_moe_ep2": ("ep", UpdateConfig(max_tokens=64, kl_coef=0.1, agg="seq-mean-token-sum")),
    # dp 2 x pp 2 (tied Qwen3): the last stage computes the loss inside the schedule
    "dp2pp2_seq_mean": ("pp", UpdateConfig(max_tokens=64, kl_coef=0.1, entropy_coef=0.01,
                                           clip_ratio_c=1.5, agg="seq-mean-token-mean")),
    # Qwen2-VL at dp 4, images in the rows of ranks 0 and 1 only (ranks 2 and 3 run a stand-in)
    "qwen2_vl_dp4": ("vlm", UpdateConfig(max_tokens=64, kl_coef=0.1)),
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _model(layout):
    """The case's starting model, the same in every process: LoRA adapters drawn from the seed."""
    from fullshard import apply_lora
    from fullshard.testing.zoo import build_model

    if layout == "lora":
        model = build_model("llama")
        torch.manual_seed(5)
        return apply_lora(model, LORA)
    if layout == "vlm":
        from fullshard.testing.vlm_zoo import build_vlm

        return build_vlm("qwen2_vl")
    return build_model({"ep": "qwen3_moe", "pp": "qwen3"}.get(layout, "llama"))


VLM_IMAGES = [True, False, False, False, False, True, False, False]  # rows 0, 5: dp ranks 0, 1 of 4


def _vlm_rollouts() -> Rollouts:
    """Qwen2-VL rows (two text tokens, an image's tokens in the rows flagged, then text), each row's
    image as its own dict (`Rollouts.model_inputs["images"]`), the response after the image."""
    from fullshard import token_logprobs
    from fullshard.testing.vlm_zoo import VLMInputs

    model = _model("vlm")
    inputs = VLMInputs(model)
    batch = inputs.batch(VLM_IMAGES)
    ids = batch["input_ids"]
    generator = torch.Generator().manual_seed(1)
    lengths = ids.shape[1] - torch.randint(0, 5, (len(ids),), generator=generator)
    positions = torch.arange(ids.shape[1])[None]
    attention = (positions < lengths[:, None]).long()
    response = ((positions[:, 1:] + 1 >= 4 + inputs.tokens) & (attention[:, 1:] == 1)).float()
    extra = {"images": [inputs.images([r]) if flag else {} for r, flag in enumerate(VLM_IMAGES)],
             "mm_token_type_ids": batch["mm_token_type_ids"]}
    with torch.no_grad():
        base = token_logprobs(model, ids, attention_mask=attention, **extra)
    noise = torch.randn(2, *base.shape, generator=generator) * 0.3
    rewards = torch.rand(len(ids), generator=generator)
    return Rollouts(ids, attention, response, rl.group_advantages(rewards, GROUP),
                    (base + noise[0]) * response, (base + noise[1]) * response, extra)


def _optimizer(model):
    from fullshard.optim import create_optimizer

    return create_optimizer(model, lr=LR, weight_decay=0.0, eps=1e-5)


def _run(model, rollouts, config, steps=2, **kwargs):
    optimizer = _optimizer(model)
    return [policy_update(model, optimizer, rollouts, config, **kwargs) for _ in range(steps)]


def _reference(config, layout="dp"):
    model = _model(layout)
    results = _run(model, _vlm_rollouts() if layout == "vlm" else _rollouts(), config)
    return results, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_cases(cases):
    from harness.compare import full_state

    from fullshard import FSDP2Engine

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (layout, config) in cases.items():
        tp, pp = 2 if layout == "tp" else 1, 2 if layout == "pp" else 1
        dp = world // (tp * pp)
        dp_rank = rank // tp % dp  # pp outermost, tp innermost
        # a VLM's vision tower trained too: its stand-in path on the ranks without images
        engine = {"mixed_precision": "fp32", "tp_size": tp, "ep_size": 2 if layout == "ep" else 1,
                  "pp_size": pp, "freeze": "none"}
        model = FSDP2Engine(engine).shard_model(_model(layout))
        rollouts = _vlm_rollouts() if layout == "vlm" else _rollouts()
        mine = list(range(dp_rank, len(rollouts), dp))  # every dp-th row: uneven lengths per rank
        results = _run(model, rollouts.rows(mine), config, dp_size=dp, repeats=tp * pp)
        state = full_state(model)
        if pp > 1:  # each rank holds its stage: every stage's weights
            stages = [None] * world
            dist.all_gather_object(stages, state)
            state = {n: w for part in stages for n, w in part.items()}
        out[name] = (results, state)
    return {"cases": out if rank == 0 else None, "batches": rl.token_batches(RANK_LENGTHS[rank], 10),
            "phases": _phases()}


RANK_LENGTHS = [[9, 9, 9, 9, 3], [2, 2, 2], [1], [4, 4, 4, 4]]


def test_update_at_world_4_equals_one_process():
    per_rank = run_distributed(_sharded_cases, 4, CASES)
    _check_balanced([r["batches"] for r in per_rank])
    _check_phases([r["phases"] for r in per_rank])
    per_rank = [r["cases"] for r in per_rank]
    problems, gaps = [], {}
    for name, (results, weights) in per_rank[0].items():
        reference, ref_weights = _reference(CASES[name][1], CASES[name][0])
        gap = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(results, reference)
                  for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "approx_kl"))
        weight_gap = max(float((weights[n] - w).abs().max()) for n, w in ref_weights.items())
        start = {n: p.detach() for n, p in _model(CASES[name][0]).named_parameters()}
        moved = max(float((w - start[n]).abs().max()) for n, w in ref_weights.items())
        gaps[name] = (gap, weight_gap)
        if gap > 1e-5 or weight_gap > 1e-5 or moved < 1e-3:
            problems.append(f"{name}: loss/norm gap {gap:.1e}, weights {weight_gap:.1e}, moved {moved:.1e}")
        assert results[0]["micro_batches"] >= 1
    print(gaps)
    assert not problems, problems
    assert per_rank[0]["dp4_ppo_64"][0][0]["micro_batches"] > 1  # the small budget split the rows
    assert per_rank[0]["dp4_ppo_4096"][0][0]["micro_batches"] == 1
    assert reference_clips(), "the second step's ratios should reach the clips"


def _check_balanced(per_rank):
    """Ranks needing fewer micro-batches split their own, or get empty ones, to match the most."""
    assert [len(b) for b in per_rank] == [5, 5, 5, 5]
    assert per_rank[0] == [[0], [1], [2], [3], [4]]
    assert sorted(i for b in per_rank[1] for i in b) == [0, 1, 2] and per_rank[1].count([]) == 2
    assert per_rank[2] == [[0], [], [], [], []]
    assert sorted(len(b) for b in per_rank[3]) == [0, 1, 1, 1, 1]


def reference_clips() -> bool:
    results, _ = _reference(CASES["dp4_ppo_64"][1])
    second = results[1]
    return second["clip_fraction"] > 0 and second["clip_fraction_lower"] > 0


# ---------------------------------------------------------------------------------- the phases


def _shard(model):
    from fullshard import FSDP2Engine

    return FSDP2Engine({"mixed_precision": "fp32"}).shard_model(model)


def _phases():
    """On every rank of the group: offload + onload between two steps changes nothing (bitwise);
    log-probs without gradients, the offloaded reference's, the adapter-off reference's."""
    from harness.compare import full_state

    from fullshard import FSDPStrategy
    from fullshard.rl.phases import offload, reference_logprobs, sequence_logprobs
    from fullshard.testing.zoo import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    rollouts = _rollouts().rows(list(range(rank, SEQUENCES, world)))
    config = UpdateConfig(max_tokens=64, kl_coef=0.1)
    models = [_shard(build_model("llama")) for _ in range(2)]
    optimizers = [_optimizer(m) for m in models]
    first = [policy_update(m, o, rollouts, config, dp_size=world) for m, o in zip(models, optimizers)]
    before = next(models[0].parameters())._local_tensor.data_ptr()
    expected = sum(_local_bytes(p) * 3 for p in models[0].parameters()) + \
        sum(_local_bytes(b) for b in models[0].buffers())
    strategy = FSDPStrategy()  # its RL phase calls: the functions below
    moved = strategy.offload_states(models[0], optimizers[0]), strategy.reload_states(models[0], optimizers[0])
    copied = next(models[0].parameters())._local_tensor.data_ptr() != before
    second = [policy_update(m, o, rollouts, config, dp_size=world) for m, o in zip(models, optimizers)]
    states = [full_state(m) for m in models]
    bitwise = all(torch.equal(states[0][n], states[1][n]) for n in states[0]) and first == \
        [first[0]] * 2 and second[0] == second[1]
    ids, mask = rollouts.input_ids, rollouts.attention_mask
    small = sequence_logprobs(models[0], ids, mask, max_tokens=24, return_entropy=True)
    whole = sequence_logprobs(models[0], ids, mask, max_tokens=4096, return_entropy=True)
    reference = _shard(build_model("llama"))
    offload(reference)
    ref = reference_logprobs(reference, ids, mask, max_tokens=40)
    return dict(moved=moved, expected=expected, copied=copied, bitwise=bitwise,
                grad=small[0].requires_grad, small=small, whole=whole, ref=ref,
                state=states[0] if rank == 0 else None, mine=rollouts, adapter=_adapter_phase(rollouts))


def _adapter_phase(rollouts):
    """LoRA: after a step the adapters are nonzero; with them disabled the log-probs are the base
    model's (a plain sharded copy), with them enabled they differ."""
    from fullshard import apply_lora
    from fullshard.rl.phases import reference_logprobs, sequence_logprobs
    from fullshard.testing.zoo import build_model

    world = dist.get_world_size()
    policy = _shard(apply_lora(build_model("llama"), {"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    policy_update(policy, _optimizer(policy), rollouts, UpdateConfig(max_tokens=64), dp_size=world)
    ids, mask = rollouts.input_ids, rollouts.attention_mask
    off = reference_logprobs("adapter", ids, mask, policy=policy)
    on = sequence_logprobs(policy, ids, mask)
    base = sequence_logprobs(_shard(build_model("llama")), ids, mask)
    return float((off - base).abs().max()), float((on - base).abs().max())


def _local_bytes(t):
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()


def _whole_logprobs(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logp = torch.log_softmax(logits, -1)
    return (logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:],
            -(logp.exp() * logp).sum(-1) * mask[:, 1:])


def _check_phases(per_rank):
    from fullshard.testing.zoo import build_model

    plain = build_model("llama")
    for rank, phases in enumerate(per_rank):
        assert phases["moved"][0] == phases["moved"][1] == phases["expected"] > 0, phases["moved"]
        assert phases["copied"] and phases["bitwise"], f"rank {rank}: offload/onload changed the step"
        assert not phases["grad"]
        for got in (phases["small"], phases["whole"]):
            for a, b in zip(got, phases["whole"]):
                assert float((a - b).abs().max()) < 1e-5  # other micro-batch shapes
        start, _ = _whole_logprobs(plain, phases["mine"].input_ids, phases["mine"].attention_mask)
        assert float((phases["ref"] - start).abs().max()) < 1e-5
        off, on = phases["adapter"]
        assert off < 1e-6 and on > 1e-4, (off, on)
    plain.load_state_dict(per_rank[0]["state"])
    for phases in per_rank:  # the updated policy's log-probs against one process's whole logits
        want = _whole_logprobs(plain, phases["mine"].input_ids, phases["mine"].attention_mask)
        for got, expected in zip(phases["small"], want):
            assert float((got - expected).abs().max()) < 1e-5
