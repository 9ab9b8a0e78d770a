"""The per-rank memory of a GRPO step (`train.objective=grpo`), phase by phase.

A colocated step has three phases with different peaks, and the step's peak is the largest:

- generation (`fullshard.generate`): `generation.gathered` unshards every FSDP unit for the whole
  call, so the rank holds the whole model in the compute dtype beside its shards (and, while one
  unit is gathered, that unit's all-gather buffer too); the optimizer state is on the host
  meanwhile on an accelerator (`rl.phases.offload`; on a CPU nothing moves). On top: the KV cache
  of this rank's completions (prompt + new tokens, every layer's keys and values at the kv heads'
  width; transformers' dynamic cache grows by concatenation, so one layer's keys are held twice
  while they grow), and the larger of the prefill's transient activations (one layer's, no
  gradients, and the causal mask) and a decoding step's scores (the last position's logits in
  the compute dtype, their fp32 copy, the sampling stream's noise or top-p's sort).
- log-probs: the old policy's (`rl.epochs` > 1) and the reference's (`rl.reference`: `model`, a
  frozen sharded copy, moved to the device for its forward on an accelerator; `adapter`, the same
  weights with LoRA's adapters off; `none`), without gradients, micro-batches of at most
  `rl.max_tokens_per_micro_batch` tokens: two units gathered (the tail unit stays gathered after a
  no-grad forward), one layer's transient activations and a chunk's fp32 logits.
- the update: `plan.memory`'s training estimate for one micro-batch of whole sequences within the
  token budget, the head run as chunked log-probs with entropies (`token_logprobs`), gradients
  kept across micro-batches.

Every phase holds the rollouts (token ids, masks, log-probs). With `rl.rollout=engines` the trainer
ranks do not generate: the engine processes hold their own model and cache, not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .memory import EstimateSetup, MemoryEstimate, estimate_memory, text_config

# ids, attention mask, response mask, old and reference log-probs
ROLLOUT_BYTES_PER_TOKEN = 8 + 8 + 4 + 4 + 4
# a decoding step's scores beyond the logits (`rl.sampling.StreamSampler`: the tempered scores,
# the stream's Gumbel noise in int64 and float64), and what top-p's sort adds: measured at 16 and
# 22 bytes per logit in all with fp32 logits (harness/rl_memory.py's sampling check), one more kept
SAMPLING_BYTES_PER_LOGIT = 13
TOP_P_BYTES_PER_LOGIT = 6
# a log-prob chunk's fp32 logits without gradients (logsumexp adds no copy: measured)
NO_GRAD_CHUNK_BYTES_PER_LOGIT = 4


@dataclass
class RLSetup:
    """What a GRPO step holds per rank: its `completions` (train.global_batch_size / dp), prompts
    of `prompt_len` tokens, `max_new_tokens` each, update micro-batches of `max_tokens`."""

    completions: int
    prompt_len: int
    max_new_tokens: int
    max_tokens: int = 4096
    reference: str = "none"  # rl.reference resolved: model, adapter, none
    rollout: str = "colocated"  # or engines
    epochs: int = 1
    top_p: float = 1.0
    loss_chunk_tokens: int = 1024
    tp: int = 1  # tensor parallelism splits the attention heads: a rank's cache is 1/tp of them

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def rows(self) -> int:
        """Sequences per micro-batch: as many whole ones as the token budget takes, at least one."""
        return max(1, min(self.completions, self.max_tokens // self.seq_len))

    @property
    def micro_batches(self) -> int:
        return -(-self.completions // self.rows)


@dataclass
class Phase:
    """One phase's figure: (what, bytes) rows, the total their sum."""

    name: str
    parts: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(value for _, value in self.parts)


@dataclass
class PhasedEstimate:
    """A GRPO step's estimate: the update's training estimate and each phase's total; the step's
    peak is the largest phase."""

    update: MemoryEstimate
    phases: dict[str, Phase]

    @property
    def total(self) -> int:
        return max(phase.total for phase in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total)

    def rows(self) -> list[tuple[str, int]]:
        out = [(f"update: {name}", value) for name, value in self.update.rows()]
        for phase in self.phases.values():
            out += [
                (f"{phase.name}: {what}", value)
                for what, value in phase.parts
                if phase.name != "update"
            ]
            out.append((f"{phase.name} phase total", phase.total))
        return out + [(f"total (the largest phase: {self.peak_phase})", self.total)]

    def describe(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(
            f"{name.ljust(width)}  {value / 2**20:>10.2f} MiB" for name, value in self.rows()
        )


def inference_layer_values(config, seq_len: int, on_device: bool) -> int:
    """Values per token a decoder layer holds at once in a forward without gradients: the
    residual stream, the normalised input and the attention's rotary and grouped-query copies
    (about 5H: 4.5H measured in a prefill) beside the MLP's activated gate, up projection and their
    product (3I); on a CPU, whose attention kernel for a masked batch materialises
    them, each head's scores over the sequence (an accelerator's fused attention keeps none)."""
    scores = 0 if on_device else config.num_attention_heads * seq_len
    return 5 * config.hidden_size + 3 * config.intermediate_size + scores


def kv_cache_bytes(config, rows: int, positions: int, compute_bytes: int) -> int:
    """Every layer's keys and values for `rows` sequences of `positions` tokens."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * rows * kv_heads * head_dim * positions * compute_bytes


def held_parts(update: MemoryEstimate, setup: RLSetup, on_device: bool, optimizer: bool) -> list:
    """What the generation, log-prob and push phases hold: the shards, (where it is on the device)
    the optimizer state, and `beside_training`. Under `fsdp.offload_params` the shards and the
    optimizer state live in host memory."""
    parts = [("allocator rounding", update.allocator)]
    if not update.offloaded:
        parts.insert(0, ("parameters (shard)", update.parameters))
    if optimizer and not update.offloaded:
        parts.append(("optimizer state (shard)", update.optimizer))
    return parts + beside_training(update, setup, on_device)


def beside_training(update: MemoryEstimate, setup: RLSetup, on_device: bool) -> list:
    """What every phase holds that the training estimate does not count: the reference copy (on
    a CPU, where it never moves) and the rollouts."""
    parts = []
    if setup.reference == "model" and not on_device:  # on a CPU the frozen copy never moves
        parts.append(("reference model (shard)", update.base_shard))
    tokens = setup.completions * setup.seq_len
    return parts + [("rollouts (ids, masks, log-probs)", tokens * ROLLOUT_BYTES_PER_TOKEN)]


def generation_phase(
    config, update: MemoryEstimate, setup: RLSetup, compute_bytes: int, on_device: bool
) -> Phase:
    """Colocated generation: the whole model gathered, the KV cache, the larger transient."""
    rows, prompt, positions = setup.completions, setup.prompt_len, setup.seq_len
    cache = kv_cache_bytes(config, rows, positions, compute_bytes) // setup.tp
    layer_keys = cache // (2 * config.num_hidden_layers)
    # the prefill runs beside the prompt's part of the cache, with a byte a position pair of mask
    values = inference_layer_values(config, prompt, on_device)
    prompt_cache = kv_cache_bytes(config, rows, prompt, compute_bytes) // setup.tp
    prefill = rows * prompt * (compute_bytes * values + prompt) + prompt_cache - cache
    top_p = TOP_P_BYTES_PER_LOGIT if setup.top_p < 1 else 0
    per_logit = compute_bytes + SAMPLING_BYTES_PER_LOGIT + top_p
    decode = layer_keys + rows * config.vocab_size * per_logit
    parts = held_parts(update, setup, on_device, optimizer=not on_device)
    return Phase(
        "generation",
        parts
        + [
            ("the whole model all-gathered (generation.gathered)", update.whole_model),
            (f"KV cache ({rows} sequences x {positions} positions)", cache),
            (
                "transient: a unit's all-gather buffer, the prefill's layer or a step's logits",
                max(update.largest_unit, prefill, decode),
            ),
        ],
    )


def logprob_phase(
    config, update: MemoryEstimate, setup: RLSetup, compute_bytes: int, on_device: bool
) -> Phase:
    """The old policy's and the reference's log-probs without gradients."""
    tokens = setup.rows * setup.seq_len
    chunk = (
        min(setup.loss_chunk_tokens, tokens)
        * config.vocab_size
        * (NO_GRAD_CHUNK_BYTES_PER_LOGIT + (compute_bytes if compute_bytes < 4 else 0))
    )
    layer = tokens * compute_bytes * inference_layer_values(config, setup.seq_len, on_device)
    parts = held_parts(update, setup, on_device, optimizer=True)
    if setup.reference == "model" and on_device:
        parts.append(("reference model (shard, on the device for its forward)", update.base_shard))
    return Phase(
        "log-probs",
        parts
        + [
            (
                "all-gathered units (2 largest; FSDP keeps them gathered after a forward without "
                "gradients)",
                update.gathered,
            ),
            *(
                [("reference forward: all-gathered units", update.gathered)]
                if setup.reference == "model"
                else []
            ),
            ("a micro-batch's forward: a layer's values, or a chunk's logits", max(layer, chunk)),
        ],
    )


def update_phase(update: MemoryEstimate, setup: RLSetup, on_device: bool) -> Phase:
    """The update: the training estimate of one micro-batch, the rollouts beside it."""
    return Phase(
        "update",
        [
            (
                f"training estimate ({setup.rows} x {setup.seq_len} tokens a micro-batch, "
                f"{setup.micro_batches} micro-batches)",
                update.total,
            ),
            *beside_training(update, setup, on_device),
        ],
    )


def push_phase(model: nn.Module, update: MemoryEstimate, setup: RLSetup, on_device: bool) -> Phase:
    """`rl.rollout=engines`: after each update the trainer ranks stream the weights to the engines
    (`WeightSync.push`); the first rank lays each bucket out whole, two buckets in turn and a third
    for a tensor larger than one (`weight_sync.py`'s buffers: counted from the code, in the master
    weights' dtype, at most what the stream sends in)."""
    from ..hf.stream import DEFAULT_BUCKET_BYTES

    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    largest = max(sizes, default=0)
    buffers = min(2 * DEFAULT_BUCKET_BYTES, sum(sizes))
    buffers += largest if largest > DEFAULT_BUCKET_BYTES else 0
    parts = held_parts(update, setup, on_device, optimizer=True)
    return Phase("weight push", parts + [("the first rank's bucket buffers", buffers)])


def estimate_grpo(
    model: nn.Module,
    engine,
    world_size: int,
    setup: RLSetup,
    *,
    optimizer: str = "adamw",
    device_type: str = "cuda",
) -> PhasedEstimate:
    """The per-rank estimate of a GRPO step of `model` (real or on meta, LoRA applied where the run
    has it) under `engine` on `world_size` ranks: each phase's figure, the largest the peak."""
    from ..distributed import ParallelDims
    from ..engine import EngineConfig
    from .build import build_plan

    engine = EngineConfig.from_any(engine)
    if engine.pp_size > 1:
        raise ValueError(
            "the GRPO estimate has no pipeline stages (colocated generate needs the whole model; "
            "with engines a pipelined step trains but is not estimated)"
        )
    dims = ParallelDims(
        engine.dp_replicate,
        engine.dp_shard,
        world_size,
        cp=engine.cp_size,
        tp=engine.tp_size,
        pp=engine.pp_size,
        ep=engine.ep_size,
    )
    run = dict(
        optimizer=optimizer,
        accumulation_steps=setup.micro_batches,
        device_type=device_type,
        loss_chunk_tokens=setup.loss_chunk_tokens,
        entropy=True,
    )
    estimate_setup = EstimateSetup.of(model, engine, dims, setup.rows, setup.seq_len, **run)
    update = estimate_memory(model, build_plan(model, engine.plan), estimate_setup)
    update.offloaded = engine.offload_params and device_type != "cpu"
    config, compute_bytes = text_config(model.config), estimate_setup.compute_dtype.itemsize
    on_device = device_type != "cpu"
    phases = {"update": update_phase(update, setup, on_device)}
    if setup.epochs > 1 or setup.reference != "none":  # else on-policy: none before the update
        phases["log-probs"] = logprob_phase(config, update, setup, compute_bytes, on_device)
    if setup.rollout == "colocated":
        phases["generation"] = generation_phase(config, update, setup, compute_bytes, on_device)
    else:
        phases["weight push"] = push_phase(model, update, setup, on_device)
    return PhasedEstimate(update, phases)


def rl_setup(config, dp_size: int, prompt_len: int, tp: int = 1) -> RLSetup:
    """A run config's GRPO step per rank: its completions (train.global_batch_size over the
    data-parallel ranks), prompts of `prompt_len` tokens (`data.seq_len`, the longest a prompt
    is kept at, unless the plan is given another)."""
    rl = config.rl
    return RLSetup(
        completions=max(config.train.global_batch_size // dp_size, rl.group_size),
        prompt_len=prompt_len,
        max_new_tokens=rl.max_new_tokens,
        max_tokens=rl.max_tokens_per_micro_batch,
        reference=rl.resolved_reference(config.lora.enabled),
        rollout=rl.rollout,
        epochs=rl.epochs,
        top_p=rl.top_p,
        loss_chunk_tokens=config.train.loss_chunk_tokens or 1 << 30,
        tp=tp,
    )


def describe_setup(setup: RLSetup) -> str:
    """The assumptions of a GRPO estimate, for the plan's header."""
    rollout = (
        "colocated: the trainer ranks generate with the whole model gathered, the optimizer "
        "state on the host meanwhile (on an accelerator)"
        if setup.rollout == "colocated"
        else "engines: the engine processes generate, their model and KV cache are theirs, not "
        "counted here; the trainer ranks' phases are the log-probs, the update and the weight push"
    )
    return (
        f"GRPO step: {setup.completions} completions per rank, prompts of {setup.prompt_len} "
        "tokens (the plan's seq-len: the longest a prompt is kept at) + "
        f"{setup.max_new_tokens} new tokens; "
        f"rollouts {rollout}; reference {setup.reference}; update micro-batches of {setup.rows} "
        f"sequences (rl.max_tokens_per_micro_batch={setup.max_tokens}), log-probs with entropies "
        "through the head a chunk at a time"
    )


def largest_completions(
    model: nn.Module,
    engine,
    world_size: int,
    setup: RLSetup,
    capacity: int,
    group_size: int,
    limit: int = 1 << 14,
    **kwargs,
) -> int:
    """The most completions per rank (whole groups) whose GRPO step fits `capacity`; 0 if none."""
    from dataclasses import replace

    def fits(groups: int) -> bool:
        trial = replace(setup, completions=groups * group_size)
        return estimate_grpo(model, engine, world_size, trial, **kwargs).total <= capacity

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
        if high * group_size > limit:
            return low * group_size
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * group_size
