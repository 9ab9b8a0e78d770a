"""The plan's estimate of a GRPO step's phases and of a reward model's step against their measured
peaks: on every rank of one spawned group, for each of `CASES`, a tiny Llama's colocated GRPO step
is warmed up on random completions (the log-probs and an update: the optimizer state exists from
then on, the gradients are None between steps), then run phase by phase (generation, the old
policy's and the reference's log-probs, the update), each phase's peak of live tensor bytes
measured with torch's FSDPMemTracker (`plan.memory.measured_phase_peaks`); then a one-output
sequence-classification model's reward step, measured the same way. `tests/test_memory.py`
asserts on it, `bench/bench_memory.py` tables it.
"""

from __future__ import annotations

import torch

from harness.memory_matrix import LLAMA

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS, MAX_TOKENS = 4, 4, 32, 32, 512  # per rank: 16 completions
REWARD_ROWS, REWARD_SEQ = 2, 128
# the compute dtype and the sampling of each GRPO case (fp32 masters in each)
CASES = {"fp32": {"mixed_precision": "fp32", "top_p": 1.0, "temperature": 1.0},
         "bf16, top-p": {"mixed_precision": "bf16", "top_p": 0.9, "temperature": 0.7}}


def _strategy(rows: int, world: int, precision: str = "fp32"):
    from fullshard.faces.lightrft import FSDPStrategy

    strategy = FSDPStrategy(
        seed=0,
        max_norm=1.0,
        micro_train_batch_size=rows,
        train_batch_size=rows * world,
        config={"mixed_precision": precision},
    )
    strategy.setup_distributed()
    return strategy


def _models(strategy):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA)
    torch.manual_seed(0)
    model = strategy.prepare_model(
        LlamaForCausalLM._from_config(config, dtype=torch.float32), is_training=True
    )
    torch.manual_seed(0)
    reference = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    # sharded as the trainer's `build_reference` shards it: like the policy, then frozen
    reference = strategy.prepare_model(reference, is_training=True).eval().requires_grad_(False)
    return config, model, reference


def _phases(model, reference, optimizer, prompts, seed: int, case: dict) -> dict:
    """The calls `objectives.grpo.GRPO.run_step` makes, each on what the one before made."""
    from fullshard.rl.phases import reference_logprobs, sequence_logprobs
    from fullshard.rl.rollout import as_rollouts, sample
    from fullshard.rl.sampling import completion_seeds
    from fullshard.rl.update import UpdateConfig, policy_update

    temperature = case["temperature"]
    update = UpdateConfig(kl_coef=0.1, max_tokens=MAX_TOKENS, entropy_coef=0.01,
                          temperature=temperature)
    options = dict(max_tokens=MAX_TOKENS, chunk_tokens=update.chunk_tokens, temperature=temperature)
    state: dict = {}

    def generation():
        state["completions"] = sample(
            model,
            prompts,
            GROUP,
            max_new_tokens=NEW_TOKENS,
            temperature=temperature,
            top_p=case["top_p"],
            pad_token_id=0,
            eos_token_id=None,
            seeds=completion_seeds(0, seed, 0, PROMPTS * GROUP),
        )

    def logprobs():
        rollouts = as_rollouts(state["completions"], torch.randn(PROMPTS * GROUP), 0)
        rollouts.old_logprobs = sequence_logprobs(
            model, rollouts.input_ids, rollouts.attention_mask, **options
        )
        rollouts.ref_logprobs = reference_logprobs(
            reference, rollouts.input_ids, rollouts.attention_mask, offloaded=False, **options
        )
        state["rollouts"] = rollouts

    def step():
        policy_update(
            model, optimizer, state["rollouts"], update, dp_size=torch.distributed.get_world_size()
        )

    return {"generation": generation, "logprobs": logprobs, "update": step, "state": state}


def _random_completions(prompts: list, vocab_size: int, seed: int):
    """Completions of full length drawn at random: a warm-up step's, without generating."""
    from fullshard.rl.rollout import Completions

    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randint(1, vocab_size, (len(prompts) * GROUP, NEW_TOKENS), generator=generator)
    return Completions([p for p in prompts for _ in range(GROUP)], drawn.tolist(),
                       [True] * len(drawn))


def measure_grpo(name: str) -> dict:
    """This rank's measured peak of each phase of case `name`, and the plan's estimate of it."""
    import torch.distributed as dist

    from fullshard.plan.memory import measured_phase_peaks
    from fullshard.plan.rl import RLSetup, estimate_grpo
    from fullshard.tensors import local_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    case = CASES[name]
    strategy = _strategy(GROUP, world, case["mixed_precision"])
    config, model, reference = _models(strategy)
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    prompts = torch.randint(
        1, config.vocab_size, (PROMPTS, PROMPT_LEN), generator=generator
    ).tolist()
    warm = _phases(model, reference, optimizer, prompts, seed=rank, case=case)
    warm["state"]["completions"] = _random_completions(prompts, config.vocab_size, rank)
    for name in ("logprobs", "update"):  # the optimizer state exists from here on
        warm[name]()
    phases = _phases(model, reference, optimizer, prompts, seed=100 + rank, case=case)
    held = [
        local_tensor(p) for p in reference.parameters()
    ]  # the reference's shards, live all step
    peaks = measured_phase_peaks(
        model,
        optimizer,
        {name: phases[name] for name in ("generation", "logprobs", "update")},
        held,
    )
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        planned = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    setup = RLSetup(
        completions=PROMPTS * GROUP,
        prompt_len=PROMPT_LEN,
        max_new_tokens=NEW_TOKENS,
        max_tokens=MAX_TOKENS,
        reference="model",
        top_p=case["top_p"],
    )
    engine = {"mixed_precision": case["mixed_precision"]}
    estimate = estimate_grpo(planned, engine, world, setup, device_type="cpu")
    return {
        "peak": peaks,
        "estimate": {name: phase.total for name, phase in estimate.phases.items()},
        "total": estimate.total,
    }


def measure_reward() -> dict:
    """A reward model's step (each row a pair's chosen and rejected halves): peak and estimate."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from fullshard.data.preference import CHOSEN, REJECTED, ROLE
    from fullshard.objectives.reward import Reward
    from fullshard.plan.memory import estimate_run, measured_peak_bytes
    from fullshard.train.step import train_step

    world = dist.get_world_size()
    strategy = _strategy(REWARD_ROWS, world)
    config = LlamaConfig(**LLAMA, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = strategy.prepare_model(
        LlamaForSequenceClassification._from_config(config, dtype=torch.float32), is_training=True
    )
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    half = REWARD_SEQ // 2

    def batch(step: int) -> list[dict]:
        generator = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        ids = torch.randint(1, config.vocab_size, (REWARD_ROWS, REWARD_SEQ), generator=generator)
        role = torch.tensor([CHOSEN] * half + [REJECTED] * half).repeat(REWARD_ROWS, 1)
        positions = torch.arange(half).repeat(REWARD_ROWS, 2)
        return [{"input_ids": ids, "labels": ids, "position_ids": positions, ROLE: role}]

    train_step(strategy, model, optimizer, None, batch(0), objective=Reward())
    step = batch(1)
    peak = measured_peak_bytes(
        model,
        optimizer,
        lambda: train_step(strategy, model, optimizer, None, step, objective=Reward()),
        step,
    )
    with torch.device("meta"):
        planned = LlamaForSequenceClassification._from_config(config, dtype=torch.float32)
    estimate = estimate_run(
        planned,
        {"mixed_precision": "fp32"},
        world,
        REWARD_ROWS,
        REWARD_SEQ,
        accumulation_steps=1,
        device_type="cpu",
    )
    return {"peak": peak, "estimate": estimate.per_rank}


# sampling's share of generation: many rows over a large vocabulary, a short prompt and completion
SAMPLING = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=32768, max_position_embeddings=64,
                tie_word_embeddings=False)
SAMPLING_ROWS, SAMPLING_TOKENS = 32, 4


def measure_sampling(top_p: float) -> dict:
    """Generation where each decode step's scores are most of the peak: measured and estimated."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.plan.memory import measured_phase_peaks
    from fullshard.plan.rl import RLSetup, estimate_grpo
    from fullshard.rl.rollout import sample
    from fullshard.rl.sampling import completion_seeds

    world, config = dist.get_world_size(), LlamaConfig(**SAMPLING)
    strategy = _strategy(SAMPLING_ROWS, world)
    torch.manual_seed(0)
    model = strategy.prepare_model(LlamaForCausalLM._from_config(config, dtype=torch.float32),
                                   is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    prompts = torch.randint(1, config.vocab_size, (SAMPLING_ROWS, SAMPLING_TOKENS)).tolist()

    def generation():
        sample(model, prompts, 1, max_new_tokens=SAMPLING_TOKENS, temperature=0.7, top_p=top_p,
               pad_token_id=0, eos_token_id=None, seeds=completion_seeds(0, 0, 0, SAMPLING_ROWS))

    peak = measured_phase_peaks(model, optimizer, {"generation": generation})["generation"]
    with torch.device("meta"):
        planned = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    setup = RLSetup(SAMPLING_ROWS, SAMPLING_TOKENS, SAMPLING_TOKENS, top_p=top_p)
    estimate = estimate_grpo(planned, {"mixed_precision": "fp32"}, world, setup, device_type="cpu")
    return {"peak": peak, "estimate": estimate.phases["generation"].total}


def measure_all(cases: list[str]) -> dict:
    from fullshard.distributed import barrier

    out = {"grpo": {}, "sampling": {}}
    for name in cases:
        out["grpo"][name] = measure_grpo(name)
        barrier()
    for top_p in (1.0, 0.9):
        out["sampling"][f"top-p {top_p}"] = measure_sampling(top_p)
        barrier()
    out["reward"] = measure_reward()
    return out


def run(cases: list[str] | None = None, world: int = 2, timeout: float = 600) -> dict:
    """{"grpo": case -> its phases' peaks and estimates, "reward": peak and estimate, "sampling":
    top-p -> generation's peak and estimate}, each measured peak the largest over the ranks."""
    from fullshard.testing.spawn import run_distributed

    ranks = run_distributed(measure_all, world, list(CASES) if cases is None else cases,
                            timeout=timeout)
    grpo = ranks[0]["grpo"]
    for name, case in grpo.items():
        case["peak"] = {phase: max(r["grpo"][name]["peak"][phase] for r in ranks)
                        for phase in case["peak"]}
    reward = dict(ranks[0]["reward"], peak=max(r["reward"]["peak"] for r in ranks))
    sampling = {name: dict(row, peak=max(r["sampling"][name]["peak"] for r in ranks))
                for name, row in ranks[0]["sampling"].items()}
    return {"grpo": grpo, "reward": reward, "sampling": sampling}
