"""A per-rank memory estimate for training a decoder model with FSDP2, from its config alone.

Parameters and AdamW's two moments are sharded and live all run; gradients are sharded and live
from the first backward of a step to its end (all step long when micro-batches accumulate). On
top, at any moment: the all-gathered weights of the unit computing and of the one prefetched, in
the compute dtype (at world size 1 too: FSDP2 still gathers into a buffer of its own), and the
activations. Activations were counted on transformers' Llama with `saved_tensors_hooks`
(test_train checks the count): per token, each decoder layer saves about 8H + 2·kv + 4I values
(H hidden, kv the key/value width, I the MLP width), the embedding and final norm about 3H, and
the loss its fp32 log-softmax (4V bytes, V the vocabulary); below fp32, each RMSNorm also
saves its input's fp32 copy (4H bytes). While it runs and is differentiated the loss also holds
the logits' fp32 copy and the log-softmax's gradient (8V bytes per token beyond what it saves:
measured with torch's MemTracker, in fp32 and bf16 alike). With activation checkpointing a layer
keeps only its input (H), and its backward recomputes one layer's activations and holds their
gradients beside them (about two layers' worth in all, measured).

Two moments bound the peak: the end of the forward (every activation saved, the loss's buffers
live) and the backward (gradients arriving while activations are freed, plus one unit's
unsharded gradients before they are reduce-scattered). The estimate is the larger of the two.
On an accelerator the caching allocator rounds every block up to 512 bytes; that is counted
for the tensors that live all run. `bench/bench_memory.py` checks the estimate against peaks
measured with torch's FSDPMemTracker.

The chunked loss (`train.loss_chunk_tokens`, `chunked_loss.py`) saves no log-softmax: it holds,
from its forward to the backward, the gradients it computed there (the hidden states', H values
per token, and the head weight's), and while it runs one chunk's fp32 logits, turned into their
gradient in place (4V bytes per chunk token, plus a compute-dtype copy below fp32).

Preference training (`train.objective=dpo`, `reference` set): a row of `seq_len` tokens holds a
pair's two sequences, so the tokens are the rows' as for SFT; the head runs as chunked log-probs
(`LinearLogProbs`), whose backward recomputes each chunk's fp32 logits and holds their softmax and
gradient beside them (3 x 4V bytes per chunk token, counted from the code). The reference strategy
adds: `model`, a second sharded copy of the base weights (no gradients, no optimizer state) and
its forward's two gathered units at the end of the policy's forward; `offloaded`, the same with
the shards in host memory; `adapter` (LoRA's adapters off), only that second forward's gathered
units; `precompute` and `none`, nothing (a precomputed table is a few floats per pair on the host).

Under tensor parallelism a split parameter's rank holds 1/tp of it (torch's styles: colwise splits a
Linear's rows and bias, an Embedding's columns; rowwise a Linear's columns, not its bias, an
Embedding's rows), and FSDP shards that over dp_shard x cp; the rest is sharded over dp_shard x cp.
Under context parallelism a rank's activations are those of its 1/cp of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS, chunkable_head
from ..parallel.tp import TP_STYLES
from .build import ShardingPlan, shard_bytes

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
LOSS_TRANSIENT_BYTES_PER_LOGIT = 8  # the logits' fp32 copy and the log-softmax gradient, beyond the saved output
CHUNK_BYTES_PER_LOGIT = 4  # a chunk's fp32 logits, softmax and gradient in one buffer (measured with MemTracker)
LOGPROB_CHUNK_BYTES_PER_LOGIT = 12  # log-probs' backward: a chunk's recomputed logits, softmax and gradient
ENTROPY_CHUNK_BYTES_PER_LOGIT = 16  # with entropies (RL): the softmax-weighted logits too
REFERENCES = {  # preference.reference -> what the estimate assumes it holds
    "model": "a frozen sharded copy of the base weights (no gradients or optimizer state), gathered for its forward",
    "offloaded": "a frozen sharded copy of the base weights in host memory (offload_reference), gathered to the "
                 "device for its forward",
    "adapter": "the model itself with its LoRA adapters off: no second copy, a second forward's gathered units",
    "precompute": "log-probs computed once before training: no reference held while training",
    "none": "a reference-free loss: no reference",
}
ALLOCATOR_BLOCK = 512  # bytes: the CUDA caching allocator's rounding


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    gathered: int  # the two largest units all-gathered (computing and prefetched)
    activations: int  # saved for backward, the loss's fp32 log-softmax included
    loss: int = 0  # the loss's buffers beyond what it saves for backward (chunked: a chunk's, and the head's gradient)
    unit_gradients: int = 0  # one unit's unsharded gradients and their reduce-scatter output
    allocator: int = 0  # rounding of the long-lived tensors to the allocator's blocks
    gradients_in_forward: bool = True  # accumulating micro-batches keep the gradients through the forward
    largest_unit: int = 0  # all-gathered when nothing is prefetched (end of the forward and of the backward)
    saved_loss: int = 0  # the loss's share of `activations`, freed when the backward starts
    first_unit_gradients: int = 0  # the sharded gradients of the unit the backward starts with
    recompute: int = 0  # activation checkpointing: the layer being recomputed and its activations' gradients
    input_unit_gradients: int = 0  # the sharded gradients of the unit the forward starts with (the embedding's)
    backward_gathered: int = 0  # the two largest units gathered in backward (a plain embedding is not)
    in_flight: int = 0  # a pipeline stage: the micro-batches whose activations it holds at once (0: no pipeline)
    pipeline_gradients: int = 0  # a pipeline stage: its whole gradients, unsharded until the last micro-batch
    gradients_between_forwards: bool = False  # 1F1B: a later micro-batch's forward runs beside them
    offloaded: bool = False  # offload_params: the shards, their gradients and optimizer state live in host memory
    host_activations: int = 0  # activation offload: the layers' saved tensors waiting in host memory
    reference: int = 0  # preference.reference=model: the frozen copy's shards on the device
    reference_gathered: int = 0  # the reference forward's gathered units, after the policy's forward
    host_reference: int = 0  # offload_reference: the frozen copy's shards in host memory
    whole_model: int = 0  # every unit all-gathered at once (generation: `generation.gathered`)
    base_shard: int = 0  # this rank's shard of what a frozen reference copy holds (no adapters)

    @property
    def device_gradients(self) -> int:
        return 0 if self.offloaded else self.gradients

    @property
    def forward_peak(self) -> int:
        grads = self.device_gradients if self.gradients_in_forward else 0
        if self.in_flight:
            grads = self.pipeline_gradients if self.gradients_between_forwards else 0
        return self.largest_unit + self.activations + self.loss + grads + self.reference_gathered

    @property
    def backward_peak(self) -> int:
        """Gradients arrive as activations are freed, layer by layer, so the two trade off: the sum
        is largest at the start (every activation, two units gathered: the tail computing, the
        last layer prefetched) or at the end (every gradient, only the root unit gathered unless a
        layer is recomputed). One unit's gradient buffers and a recomputed layer's are the same at
        every layer: they add to both ends."""
        if self.in_flight:
            # the first micro-batch's backward: one unit's gradients beside every activation; after it,
            # the stage's whole gradients (FSDP reduces them at the last one) beside the others'
            start = self.backward_gathered + self.activations - self.saved_loss + self.largest_unit
            after_first = self.gathered + self.activations * (self.in_flight - 1) // self.in_flight
            return self.recompute + max(start, after_first + self.pipeline_gradients)
        grads_at_start = self.device_gradients if self.gradients_in_forward else self.first_unit_gradients
        start = self.gathered + self.activations - self.saved_loss + grads_at_start
        # recomputing the first layer gathers its unit again while the root unit is gathered, before
        # the embedding's gradients exist
        end = (self.gathered + self.device_gradients - self.input_unit_gradients * (not self.offloaded)
               if self.recompute else self.largest_unit + self.device_gradients)
        return self.unit_gradients + self.recompute + max(start, end)

    @property
    def total(self) -> int:
        held = 0 if self.offloaded else self.parameters + self.optimizer
        return held + self.reference + self.allocator + max(self.forward_peak, self.backward_peak)

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters (shard)", self.parameters), ("gradients (shard)", self.gradients),
                ("optimizer state (shard)", self.optimizer), ("all-gathered units (2 largest)", self.gathered),
                ("activations (one micro-batch)", self.activations),
                ("loss: logits (all, or a chunk's) and gradients", self.loss),
                ("one unit's unsharded gradients", self.unit_gradients),
                ("recomputed layer and its gradients", self.recompute), ("allocator rounding", self.allocator),
                *([("activations offloaded (host memory)", self.host_activations)] if self.host_activations else []),
                *([("reference model (shard)", self.reference)] if self.reference else []),
                *([("reference model offloaded (host memory)", self.host_reference)] if self.host_reference else []),
                *([("reference forward: all-gathered units", self.reference_gathered)]
                  if self.reference_gathered else []),
                ("at the end of the forward", self.forward_peak), ("in the backward", self.backward_peak),
                ("total (parameters, optimizer, rounding, larger moment)" if not self.offloaded else
                 "total on the device (offloaded: gathered units, activations, rounding)", self.total)]

    def describe(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name.ljust(width)}  {value / 2**20:>10.2f} MiB" for name, value in self.rows())


def text_config(config):
    """The language model's config of a composite one (a VLM's `text_config`), else the config itself."""
    return getattr(config, "get_text_config", lambda: config)()


def layer_activation_values(config, tp: int = 1, cp: int = 1) -> int:
    """Values one decoder layer saves for backward, per token: 6H around its two norms (inputs,
    normalised values, the projections' shared input), which every tp rank holds whole, and the
    attention's queries and output, keys and values, and the MLP's four intermediates, which a tp
    rank holds 1/tp of (its heads, its slice of the MLP width). Under cp the attention repeats the
    key/value heads to the query heads before its all-to-all (keys and values H wide), and its
    all-to-alls keep about 3H more (2-3H measured at cp 2: bench_memory)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = hidden if cp > 1 and kv_heads < heads else kv_heads * head_dim
    return 6 * hidden + (2 * hidden + 2 * kv + 4 * inter) // tp + (3 * hidden // tp if cp > 1 else 0)


def selective_layer_values(config, tp: int = 1, cp: int = 1) -> int:
    """Values per token a layer keeps under selective checkpointing: its input (H, whole on every
    tp rank), the outputs of every other matmul (queries, values, the MLP's gate, the down
    projection's H-wide partial sums) and attention's output with its fp32 log-sum-exp."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * hidden + (heads * head_dim * 2 + kv_heads * head_dim + inter + 2 * heads) // tp


def checkpointed_layers(layers: int, mode, every: int = 2) -> int:
    """How many of `layers` blocks a checkpointing mode recomputes (`fsdp.checkpointed_blocks`)."""
    from ..fsdp import ac_mode

    mode = ac_mode(mode)
    return {"none": 0, "every_n": layers // every}.get(mode, layers)


def activation_bytes(config, micro_batch_size: int, seq_len: int, compute_bytes: int,
                     activation_checkpointing=False, chunked_loss: bool = False,
                     layers: int | None = None, first: bool = True, last: bool = True, tp: int = 1,
                     cp: int = 1, ac_every: int = 2, outputs: int | None = None) -> int:
    """What autograd saves for one micro-batch: the layers, the embedding and final norm (3H), the
    rotary cos/sin shared by the layers, the int64 ids, labels and positions, and the loss's fp32
    log-softmax (4V bytes, V the head's `outputs`: the vocabulary unless given), or, chunked, the
    hidden states' gradient it holds (H values). A pipeline
    stage holds `layers` of them, the embedding only if `first`, the final norm and loss only if
    `last`. A checkpointed layer keeps its input (H), under `selective` also the outputs its policy
    keeps."""
    from ..fsdp import ac_mode

    layers = config.num_hidden_layers if layers is None else layers
    mode = ac_mode(activation_checkpointing)
    recomputed = checkpointed_layers(layers, mode, ac_every)
    kept = selective_layer_values(config, tp, cp) if mode == "selective" else config.hidden_size
    plain = (layers - recomputed) * layer_activation_values(config, tp, cp)
    layer_values = plain + recomputed * kept
    rotary = 2 * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    tokens = micro_batch_size * seq_len
    ends = (2 if first else 0) + (1 if last else 0)  # the embedding's output and its copy; the final norm's
    norms = 2 * (layers - recomputed) + (1 if last else 0)
    outputs = config.vocab_size if outputs is None else outputs
    loss = (compute_bytes * config.hidden_size if chunked_loss else 4 * outputs) if last else 0
    return tokens * (compute_bytes * (layer_values + ends * config.hidden_size + rotary) + 3 * 8
                     + loss
                     + norms * norm_upcast_bytes(config, compute_bytes))


def frozen_inputs(model: nn.Module) -> int:
    """Values per token a decoder layer does not save because its Linear layers are frozen (LoRA's
    base): a frozen Linear keeps no input for a weight gradient. Counted once per parent module and
    input width (a shared input, as gate and up projections have, is one tensor), and not where an
    adapter wraps the layer (its own input is saved)."""
    from .blocks import find_blocks

    layer = next((model.get_submodule(name) for name in find_blocks(model)
                  if any(True for _ in model.get_submodule(name).parameters())), None)
    if layer is None or all(p.requires_grad for p in layer.parameters()):
        return 0
    adapted = {id(m.base_layer) for m in layer.modules() if hasattr(m, "base_layer")}
    widths = set()
    for name, module in layer.named_modules():
        if (type(module) is nn.Linear and id(module) not in adapted and not module.weight.requires_grad
                and "lora_" not in name):
            widths.add((name.rpartition(".")[0], module.in_features))
    return sum(width for _, width in widths)


def norm_upcast_bytes(config, compute_bytes: int) -> int:
    """RMSNorm computes in fp32: below fp32 each norm also saves its input's fp32 copy (4H bytes per token)."""
    return 4 * config.hidden_size if compute_bytes < 4 else 0


@dataclass
class EstimateSetup:
    """What one estimate assumes besides the model and its plan, as the configs give it
    (`EstimateSetup.of`): the shard size (dp_shard), the micro-batch, the dtypes, checkpointing,
    the optimizer, the tp / cp / ep split, offload and float8 and, for a pipeline stage
    (`estimate_run`), its rows of `seq_len` tokens and micro-batches in flight. The fields keep
    `estimate_memory`'s old positional order. `float8` tensorwise gathers the converted layers'
    weights in float8 (1 byte each, and a scale); `activation_offload` keeps on the device two
    layers' saved tensors of all (the one computing and the one prefetched), the rest on the host
    (`host_activations`; on a CPU nothing moves)."""

    shard_size: int
    micro_batch_size: int
    seq_len: int
    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool | str = False
    optimizer: str = "adamw"
    accumulation_steps: int | None = None  # None (unknown): gradients counted through the forward
    device_type: str = "cuda"  # "cpu": no allocator rounding
    reduce_dtype: torch.dtype = torch.float32
    tp_assignments: dict[str, str] | None = None
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS
    stage_rows: int | None = None
    in_flight: int = 1
    all_forwards_first: bool = False
    ac_every: int = 2
    activation_offload: bool = False
    float8: str = "none"
    float8_skip: tuple | list = ()
    reference: str | None = None  # train.objective=dpo: its reference strategy (`REFERENCES`); None: SFT
    entropy: bool = False  # the head runs as log-probs with entropies (an RL update), no reference

    @classmethod
    def of(cls, model: nn.Module, engine, dims, micro_batch_size: int, seq_len: int, **run) -> EstimateSetup:
        """From an `EngineConfig` (dtypes, checkpointing, the tp plan, offload, float8) and its mesh
        (`ParallelDims`); `run`: the train config's optimizer, accumulation_steps, device_type,
        loss_chunk_tokens, and a pipeline stage's stage_rows / in_flight / all_forwards_first (and
        the whole model's dtypes for a stage of it: `training_dtypes` of `model` otherwise)."""
        _, compute, reduce = training_dtypes(model, engine)
        values = dict(compute_dtype=compute, reduce_dtype=reduce, ac_every=engine.ac_every,
                      activation_checkpointing=engine.activation_checkpointing,
                      tp_assignments=tp_assignments(model, engine.tp_plan, dims.tp), tp_size=dims.tp,
                      cp_size=dims.cp, ep_size=dims.ep, activation_offload=engine.activation_offload,
                      float8=engine.float8, float8_skip=engine.float8_skip)
        return cls(dims.dp_shard, micro_batch_size, seq_len, **{**values, **run})


def estimate_memory(model: nn.Module, plan: ShardingPlan, setup: EstimateSetup | int | None = None, *args, **kwargs):
    """The estimate for `model` (real or on meta) sharded by `plan` under `setup` (an `EstimateSetup`;
    its fields given instead, the old form `estimate_memory(model, plan, 2, 2, 16, cp_size=2)`, are
    read as one). Under ep > 1 each MoE experts module is a unit of its own gathering only this rank's
    experts (1 / (dp_shard x cp) of them); where no other rank holds them they are not gathered."""
    s = setup if isinstance(setup, EstimateSetup) else EstimateSetup(*(setup, *args)[setup is None:], **kwargs)
    (shard_size, micro_batch_size, seq_len, compute_dtype, activation_checkpointing, optimizer, accumulation_steps,
     device_type, reduce_dtype, tp_assignments, tp_size, cp_size, ep_size, loss_chunk_tokens, stage_rows, in_flight,
     all_forwards_first, ac_every, activation_offload, float8, float8_skip, reference, entropy) = (
        getattr(s, f.name) for f in fields(s))
    from ..fsdp import ac_mode

    activation_checkpointing = ac_mode(activation_checkpointing)
    split = TensorParallelSplit(model, tp_assignments or {}, tp_size)
    units = _unit_bytes(model, plan, shard_size * cp_size, compute_dtype, optimizer,
                        ALLOCATOR_BLOCK if device_type != "cpu" else 1, split,
                        expert_units(model, ep_size, shard_size * cp_size),
                        float8_gathered(model, float8, float8_skip))
    seq_len = -(-seq_len // cp_size)  # this rank's part of each sequence
    config, compute_bytes = text_config(model.config), compute_dtype.itemsize
    stage = getattr(model, "fullshard_stage", None)  # a pipeline stage: its layers, ends and micro-batches
    layers, first, last = (len(stage.layers), stage.first, stage.last) if stage else (None, True, True)
    micro_batch_size = (stage_rows or micro_batch_size) if stage else micro_batch_size
    tokens = micro_batch_size * seq_len
    # the layers' projections split over tp (the auto plan's are): their activations are split too
    layer_tp = tp_size if any(".layers." in f".{name}." for name in (tp_assignments or {})) else 1
    head = chunked_head(model, loss_chunk_tokens, tp_assignments or {}) if last else None
    outputs = head_width(model, config)  # the vocabulary, or a reward model's one score
    activations = in_flight * activation_bytes(
        config, micro_batch_size, seq_len, compute_bytes, activation_checkpointing, chunked_loss=head is not None,
        layers=layers, first=first, last=last, tp=layer_tp, cp=cp_size, ac_every=ac_every,
        outputs=outputs)
    activations += in_flight * tokens * compute_bytes * layout_values(
        model, config, expert_units(model, ep_size, shard_size * cp_size), activation_checkpointing, layers,
        first, last, stage is not None, head is None)
    host, kept = offloaded_bytes(config, in_flight * tokens, compute_bytes, activation_checkpointing, ac_every,
                                 layers or config.num_hidden_layers, layer_tp, cp_size) if (
        activation_offload and device_type != "cpu") else (0, 0)
    activations -= host - kept
    loss, saved_loss = loss_bytes(config, head, tokens, compute_bytes, loss_chunk_tokens, in_flight,
                                  reference is not None, entropy, outputs) if last else (0, 0)
    recompute = recompute_bytes(config, tokens, compute_bytes, layer_tp, cp_size, layers, activation_checkpointing,
                                ac_every)
    full = sorted(units["full"].values(), reverse=True)
    largest = max(units["full"], key=units["full"].get)
    reduce_copy = reduce_dtype.itemsize if reduce_dtype != compute_dtype else 0
    trainable = sum(units["grad"].values())
    return MemoryEstimate(
        parameters=units["shard"], gradients=trainable, optimizer=OPTIMIZER_STATES[optimizer] * trainable,
        gathered=sum(full[:2]), activations=activations, loss=loss,
        unit_gradients=units["numel"][largest] * reduce_copy + full[0] + units["grad"].get(largest, 0),
        allocator=units["rounding"], gradients_in_forward=accumulation_steps is None or accumulation_steps > 1,
        largest_unit=full[0], saved_loss=saved_loss, in_flight=in_flight if stage else 0,
        first_unit_gradients=max(units["grad"].values(), default=0), recompute=recompute,
        input_unit_gradients=next(iter(units["grad"].values()), 0), whole_model=sum(full),
        backward_gathered=sum(sorted(units["backward_full"].values(), reverse=True)[:2]),
        pipeline_gradients=units["trainable_numel"] * compute_bytes if stage is not None else 0,
        gradients_between_forwards=stage is not None and not all_forwards_first,
        host_activations=host, **reference_bytes(reference, units["base_shard"], sum(full[:2])),
        base_shard=units["base_shard"])


def reference_bytes(reference: str | None, shard: int, gathered: int) -> dict[str, int]:
    """What a preference objective's reference adds: its shards on the device (`model`) or the host
    (`offloaded`), and the two largest units gathered for its forward (`adapter` runs the same
    weights again); `precompute` and reference-free losses add nothing."""
    return dict(reference=shard if reference == "model" else 0,
                host_reference=shard if reference == "offloaded" else 0,
                reference_gathered=gathered if reference in ("model", "offloaded", "adapter") else 0)


def recompute_bytes(config, tokens: int, compute_bytes: int, tp: int, cp: int, layers: int | None,
                    activation_checkpointing, ac_every: int) -> int:
    """A checkpointed layer's backward recomputes its activations, freeing them as their gradients
    arrive: about one layer's worth at its highest, measured (bench_memory); 0 when none is."""
    if checkpointed_layers(layers or config.num_hidden_layers, activation_checkpointing, ac_every) == 0:
        return 0
    layer = compute_bytes * layer_activation_values(config, tp, cp) + 2 * norm_upcast_bytes(config, compute_bytes)
    return tokens * layer


def layout_values(model: nn.Module, config, experts: dict, activation_checkpointing, layers: int | None,
                  first: bool, last: bool, pipelined: bool, whole_logits: bool) -> int:
    """Values per token that the layout adds to (or, frozen, takes from) what the layers save."""
    values = 0
    activation_checkpointing = activation_checkpointing != "none"
    if experts and not activation_checkpointing:
        # the dispatch keeps the rows the all-to-all brought (top-k per token) as its experts' input
        top_k = getattr(config, "num_experts_per_tok", 1) or 1
        values += len({unit for unit, _, _ in experts.values()}) * top_k * config.hidden_size
    if not activation_checkpointing:
        values -= (config.num_hidden_layers if layers is None else layers) * frozen_inputs(model)
    if pipelined:
        # the schedule keeps, until each micro-batch's backward, the output a stage sends and its
        # gradient's buffer (2H per token), the input it receives with its gradient and copies, and
        # on the last stage the loss's few extra buffers (about 6H in all, measured at pp 2:
        # bench_memory), and its whole logits where the loss is not chunked
        values += ((0 if last else 2) + (0 if first else 6)) * config.hidden_size
        values += head_width(model, config) if last and whole_logits else 0
    return values


def loss_bytes(config, head: nn.Module | None, tokens: int, compute_bytes: int, loss_chunk_tokens: int,
               in_flight: int = 1, logprobs: bool = False, entropy: bool = False,
               outputs: int | None = None) -> tuple[int, int]:
    """(the loss's buffers beyond what it saves, what it saves) for `tokens` tokens: whole logits
    (`outputs` per token: the vocabulary unless given), or chunked (`logprobs`: per-token log-probs,
    whose backward holds three buffers per chunk logit, four with `entropy`)."""
    outputs = config.vocab_size if outputs is None else outputs
    if head is None:
        return tokens * outputs * LOSS_TRANSIENT_BYTES_PER_LOGIT, tokens * outputs * 4
    # a chunk's logits; the head's gradient, made in the forward (each micro-batch in flight on a
    # pipeline stage holds its own); the head unit's all-gather buffer, which FSDP frees only when
    # the root's forward ends; and a second copy of the hidden states' gradient (the one it saves),
    # live while the final norm's backward takes it on (bench_loss measures these)
    per_logit = (ENTROPY_CHUNK_BYTES_PER_LOGIT if entropy else  # entropies are log-probs' too
                 LOGPROB_CHUNK_BYTES_PER_LOGIT if logprobs else CHUNK_BYTES_PER_LOGIT)
    chunk_bytes = per_logit + (compute_bytes if compute_bytes < 4 else 0)
    head_bytes = sum(p.numel() for p in head.parameters()) * compute_bytes
    trains_head = any(p.requires_grad for p in head.parameters())  # a frozen head (LoRA) gets no gradient
    loss = (min(loss_chunk_tokens, tokens) * config.vocab_size * chunk_bytes
            + (1 + trains_head * in_flight) * head_bytes + tokens * config.hidden_size * compute_bytes)
    return loss, tokens * config.hidden_size * compute_bytes


def head_width(model: nn.Module, config) -> int:
    """Outputs per token of the model's head: the vocabulary of a causal LM; a sequence
    classifier's labels (a reward model's one score, `objectives.reward`), which has no logits
    over the vocabulary."""
    score = getattr(model, "score", None)
    if chunkable_head(model) is None and isinstance(score, nn.Linear):
        return score.out_features
    return config.vocab_size


def chunked_head(model: nn.Module, loss_chunk_tokens: int, tp_assignments: dict[str, str]) -> nn.Linear | None:
    """The head the chunked loss will stand in for, None where the step will use whole logits: chunking
    off, a head that is no plain Linear or that TP splits, a model that soft-caps its logits (the
    run finds that out at its first step; here the config says so)."""
    head = chunkable_head(model) if loss_chunk_tokens > 0 else None
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    if head is None or getattr(config, "final_logit_softcapping", None) is not None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return None if names.get(id(head)) in tp_assignments else head


class TensorParallelSplit:
    """What a tp rank holds of each parameter: its shape after torch's TP style, as a meta tensor."""

    # (style kind, module type, parameter) -> the dim torch's style splits; absent: kept whole
    DIMS = {("colwise", nn.Linear, "weight"): 0, ("colwise", nn.Linear, "bias"): 0,
            ("colwise", nn.Embedding, "weight"): 1, ("rowwise", nn.Linear, "weight"): 1,
            ("rowwise", nn.Embedding, "weight"): 0}

    def __init__(self, model: nn.Module, assignments: dict[str, str], tp_size: int):
        self.modules, self.assignments, self.tp_size = dict(model.named_modules()), assignments, tp_size

    def split_dim(self, name: str) -> int | None:
        module_name, _, leaf = name.rpartition(".")
        style = self.assignments.get(module_name)
        if style is None or TP_STYLES[style][1] is None:
            return None  # not split (replicated styles hold the whole weight)
        kind = "colwise" if style.startswith("colwise") else "rowwise"
        module = self.modules[module_name]
        for (k, module_type, param), dim in self.DIMS.items():
            if k == kind and isinstance(module, module_type) and param == leaf:
                return dim
        return None

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor:
        dim = self.split_dim(name)
        if dim is None or self.tp_size == 1:
            return param
        shape = list(param.shape)
        shape[dim] = -(-shape[dim] // self.tp_size)
        return torch.empty(shape, dtype=param.dtype, device="meta")


def expert_units(model: nn.Module, ep_size: int, shard_size: int) -> dict[str, tuple[str, int, bool]]:
    """Under expert parallelism: each experts tensor's name -> (its experts module, ep_size, whether
    FSDP leaves it out: the engine keeps experts that no other rank holds whole, `_shard_experts`)."""
    if ep_size == 1:
        return {}
    from ..parallel.ep import find_experts, per_expert_module_lists

    kept_whole = ep_size == shard_size
    units = {f"{e.name}.{p}": (e.name, ep_size, kept_whole) for e in find_experts(model) for p in e.params}
    for name in per_expert_module_lists(model):  # each rank gathers (or keeps) its experts of the list
        units.update(
            {f"{name}.{p}": (name, ep_size, kept_whole) for p, _ in model.get_submodule(name).named_parameters()}
        )
    return units


def _unit_bytes(model: nn.Module, plan: ShardingPlan, shard_size: int, compute_dtype: torch.dtype, optimizer: str,
                block: int, split: TensorParallelSplit,
                experts: dict[str, tuple[str, int, bool]] | None = None,
                float8_weights: set[str] = frozenset()) -> dict:
    """Per FSDP unit: its all-gathered bytes in the compute dtype (a tp rank gathers its 1/tp), its
    element count and this rank's gradient shard; over the model: this rank's parameter shard and
    the allocator's rounding."""
    out = {"full": {}, "numel": {}, "grad": {}, "shard": 0, "rounding": 0, "trainable_numel": 0, "backward_full": {},
           "base_shard": 0}
    modules = dict(model.named_modules())
    for name, full_param in model.named_parameters():
        param = split.local(name, full_param)
        per_rank = shard_bytes(param, shard_size)[1]
        unit, gathered = plan.unit_index_of_parameter(name), param.numel()
        if name in (experts or {}):  # its own unit, gathering this rank's experts only
            unit, ep, kept_whole = experts[name]
            gathered = 0 if kept_whole and param.dtype == compute_dtype else gathered // ep
        out["shard"] += per_rank
        out["base_shard"] += per_rank if "lora_" not in name else 0  # what a frozen reference copy holds
        # a float8-gathered weight: a byte per value and its fp32 scale
        gathered_bytes = gathered + 4 if name in float8_weights else gathered * compute_dtype.itemsize
        out["full"][unit] = out["full"].get(unit, 0) + gathered_bytes
        out["numel"][unit] = out["numel"].get(unit, 0) + gathered
        if type(modules.get(name.rpartition(".")[0])) is not nn.Embedding:  # FSDP does not gather those for backward
            out["backward_full"][unit] = out["backward_full"].get(unit, 0) + gathered_bytes
        if full_param.requires_grad:
            out["trainable_numel"] += param.numel()
            out["grad"][unit] = out["grad"].get(unit, 0) + per_rank
        # the weight, its gradient and moments
        copies = 1 + (1 + OPTIMIZER_STATES[optimizer]) * full_param.requires_grad
        out["rounding"] += copies * (-(-per_rank // block) * block - per_rank)
    return out


def float8_gathered(model: nn.Module, float8: str, skip=()) -> set[str]:
    """The weights FSDP all-gathers in float8: the converted layers' under `tensorwise`."""
    if float8 != "tensorwise":
        return set()
    from ..float8 import float8_choices

    return {f"{name}.weight" for name in float8_choices(model, skip)[0]}


def offloaded_bytes(config, tokens: int, compute_bytes: int, mode: str, every: int, layers: int, tp: int,
                    cp: int) -> tuple[int, int]:
    """(bytes the offload moves to the host, of them the two layers' kept on the device)."""
    moved = tokens * offloaded_layer_bytes(config, compute_bytes, mode, every, layers, tp, cp)
    return moved, moved * min(2, layers) // max(layers, 1)


def offloaded_layer_bytes(config, compute_bytes: int, mode: str, every: int, layers: int, tp: int,
                          cp: int) -> int:
    """Bytes per token one layer's offload moves to the host, averaged over the layers: a plain
    layer's saved tensors, a checkpointed layer's input only (selective's kept outputs stay)."""
    recomputed = checkpointed_layers(layers, mode, every)
    plain = (compute_bytes * layer_activation_values(config, tp, cp)
             + 2 * norm_upcast_bytes(config, compute_bytes))
    return ((layers - recomputed) * plain + recomputed * compute_bytes * config.hidden_size) // max(layers, 1)


def measured_activation_bytes(model: nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` executes,
    parameters excluded: what the estimate's activation line predicts."""
    from torch.autograd.graph import saved_tensors_hooks

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def measured_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, run, inputs=()) -> int:
    """This rank's peak of live tensor bytes while `run()` executes (a training step, say), with
    torch's FSDPMemTracker: every storage counted once, FSDP2's freed all-gather buffers
    (storages resized to 0) included. What the estimate's total predicts, without the runtime
    and allocator caching that a process's resident set or reserved memory adds."""
    return measured_phase_peaks(model, optimizer, {"run": run}, inputs)["run"]


def measured_phase_peaks(model: nn.Module, optimizer: torch.optim.Optimizer, phases: dict,
                         inputs=()) -> dict[str, int]:
    """`measured_peak_bytes` of each of `phases` (name -> a function, run in order, each may call
    the model's forward many times: generation, micro-batches) in one tracker: a second tracker
    on the same model fails on its first repeated forward, so one tracks them all, its peak
    starting again at each phase."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs(tuple(inputs))
    # the tracker refuses a second forward of a unit in one run: each unit's statistics start
    # again at each forward of it (the peak is the tracker's, over everything)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def again(module, *_):
        if not tracker._mod_tracker.is_bw:
            tracker.memory_tracking.pop(module, None)

    peaks = {}
    with tracker:  # registered after the tracker's own hooks, to run before them
        handles = [m.register_forward_pre_hook(again, prepend=True) for m in units]
        try:
            for name, run in phases.items():
                tracker._peak_mem_snap = tracker.get_tracker_snapshot()  # what __enter__ sets
                snapshot = tracker._peak_mem_snap
                tracker._peak_mem = {dev: snap["Total"] for dev, snap in snapshot.items()}
                run()
                peak = tracker.get_tracker_snapshot("peak")
                peaks[name] = max(snap["Total"] for snap in peak.values())
        finally:
            for handle in handles:
                handle.remove()
    return peaks


# ---------------------------------------------------------------------------------------------- a run's plan


@dataclass
class StageEstimate:
    """The estimate for one rank's share of a run: the whole model, or one pipeline stage."""

    label: str
    estimate: MemoryEstimate


@dataclass
class RunEstimate:
    """Per-rank estimates of a training run: one for the whole model, or one per pipeline stage."""

    stages: list[StageEstimate]
    assumptions: str  # the dtypes and layout the estimate assumed, for the plan's header

    @property
    def per_rank(self) -> int:
        """The largest rank's total: what every rank must fit."""
        return max(s.estimate.total for s in self.stages)


def training_dtypes(model: nn.Module, engine) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(master weights, compute, gradient reduce) dtypes of `model` trained under `engine`: the
    masters, their gradients and the optimizer state keep the parameters' own dtype (the model is
    built in `model.dtype`); FSDP computes in `mixed_precision` and, off (fp32), in the masters'
    dtype, reducing in `reduce_dtype` only where mixed precision is on."""
    from ..dtypes import DTYPES

    trainable = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    master = trainable[0].dtype if trainable else torch.float32
    if engine.mixed_precision == "fp32":
        return master, master, master
    return master, DTYPES[engine.mixed_precision], DTYPES[engine.reduce_dtype]


def estimate_run(model: nn.Module, engine, world_size: int, micro_batch_size: int, seq_len: int, *,
                 optimizer: str = "adamw", accumulation_steps: int | None = None, device_type: str = "cuda",
                 loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, reference: str | None = None) -> RunEstimate:
    """The per-rank memory of training `model` (real or on meta, in the dtype it trains in, LoRA
    applied if it trains with it) under `engine` (an `EngineConfig` or its dict) on `world_size`
    ranks, `micro_batch_size` x `seq_len` tokens per rank and micro-batch: one estimate, or one
    per pipeline stage. `reference`: preference training with that reference strategy (`REFERENCES`)."""
    from ..distributed import ParallelDims
    from ..engine import EngineConfig
    from .build import build_plan

    engine = EngineConfig.from_any(engine)
    dims = ParallelDims(engine.dp_replicate, engine.dp_shard, world_size, cp=engine.cp_size, tp=engine.tp_size,
                        pp=engine.pp_size, ep=engine.ep_size)
    master, compute, reduce = training_dtypes(model, engine)
    run = dict(optimizer=optimizer, accumulation_steps=accumulation_steps, device_type=device_type,
               loss_chunk_tokens=loss_chunk_tokens, compute_dtype=compute, reduce_dtype=reduce, reference=reference)

    def one(module: nn.Module, **stage) -> MemoryEstimate:
        setup = EstimateSetup.of(module, engine, dims, micro_batch_size, seq_len, **run, **stage)
        estimate = estimate_memory(module, build_plan(module, engine.plan), setup)
        estimate.offloaded = engine.offload_params and device_type != "cpu"
        return estimate

    assumptions = dtype_assumptions(model, engine, optimizer)
    if reference is not None:
        assumptions += (f"; preference pairs, each row holding a pair's chosen and rejected sequences, per-token "
                        f"log-probs through the head a chunk at a time; reference strategy assumed: {reference} "
                        f"({REFERENCES[reference]})")
    if dims.pp == 1:
        return RunEstimate([StageEstimate("every rank", one(model))], assumptions)
    from ..parallel.pp import microbatches_of

    pipeline_micro = microbatches_of(dims.pp, engine.pp_microbatches)
    rows = max(micro_batch_size // pipeline_micro, 1)
    stages = []
    for label, stage, index, count in pipeline_stages(model, engine):
        # GPipe runs every micro-batch's forward before the first backward; 1F1B keeps at most as
        # many in flight as there are stages after this one, itself included
        flight = pipeline_micro if engine.pp_schedule == "GPipe" else min(pipeline_micro, count - index)
        stages.append(StageEstimate(label, one(stage, stage_rows=rows, in_flight=flight,
                                               all_forwards_first=engine.pp_schedule == "GPipe")))
    return RunEstimate(stages, assumptions + f", {engine.pp_schedule} over {pipeline_micro} pipeline micro-batches")


def dtype_assumptions(model: nn.Module, engine, optimizer: str) -> str:
    """The dtypes an estimate assumes (`training_dtypes`), for the plan's header."""
    from ..engine import EngineConfig

    master, compute, reduce = training_dtypes(model, EngineConfig.from_any(engine))
    reduced = f", gradients reduced in {_name(reduce)}" if reduce != compute else ""
    return (f"master weights, gradients and {optimizer} state in {_name(master)}, compute in "
            f"{_name(compute)}{reduced}")


def estimate_rank_bytes(model: nn.Module, engine, world_size: int, micro_batch_size: int, seq_len: int,
                        **kwargs) -> int:
    """The largest rank's estimated peak bytes (`estimate_run(...).per_rank`): what a GPU run compares
    with `torch.cuda.max_memory_allocated()` (pass `device_type="cuda"`)."""
    return estimate_run(model, engine, world_size, micro_batch_size, seq_len, **kwargs).per_rank


def pipeline_stages(model: nn.Module, engine):
    """(label, stage module, stage index, stage count) for each pipeline stage of `model`."""
    from ..parallel.pp import build_stage, decoder_parts, held_ends, stage_layers

    parts = decoder_parts(model)
    ranges = stage_layers(model, parts, engine.pp_size * engine.pp_virtual_stages, engine.pp_layers_per_stage)
    for index, layers in enumerate(ranges):
        ends = [name for name, held in held_ends(parts, index, len(ranges)).items() if held]
        stage = build_stage(model, parts, ranges, index)
        params = sum(p.numel() for p in stage.parameters())
        yield (f"stage {index} (pp rank {index % engine.pp_size}): layers {layers.start}-{layers.stop - 1}"
               + (f" + {', '.join(ends)}" if ends else "") + f", {params:,} parameters"), stage, index, len(ranges)


def tp_assignments(model: nn.Module, tp_plan, tp_size: int) -> dict[str, str]:
    """Module name -> TP style, validated as the engine does (a `PlanError` naming the entry); none at tp 1."""
    if tp_size == 1:
        return {}
    from ..parallel.tp import plan_assignments, resolve_tp_plan

    return plan_assignments(model, resolve_tp_plan(model, tp_plan), tp_size)


def _name(dtype: torch.dtype) -> str:
    from ..dtypes import DTYPES

    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


# what torch.cuda.get_device_properties(...).total_memory reports for each card (the job's own CUDA
# context, a few hundred MiB, comes out of it too); cpu: the host's memory, shared by its ranks
DEVICES = {"h100": ("cuda", 79.19 * 2**30), "h200": ("cuda", 139.8 * 2**30), "a100-80g": ("cuda", 79.15 * 2**30),
           "a100-40g": ("cuda", 39.39 * 2**30), "cpu": ("cpu", None), "cuda": ("cuda", None)}


def device_capacity(device: str | None) -> tuple[str, int | None]:
    """(device name, bytes one rank may use) for `--device`: a named card, `cuda` (this machine's
    first GPU), `cpu` (the host's memory), or None (this machine's device)."""
    from ..errors import ConfigError

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device=cuda plans for this machine's GPU, and it has none: name the card "
                              f"(one of {', '.join(n for n in DEVICES if n not in ('cpu', 'cuda'))})")
        return f"cuda ({torch.cuda.get_device_name(0)})", torch.cuda.get_device_properties(0).total_memory
    if device == "cpu":
        import os

        return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return device, int(DEVICES[device][1])


def largest_micro_batch(model: nn.Module, engine, world_size: int, seq_len: int, capacity: int,
                        limit: int = 1 << 14, **kwargs) -> int:
    """The largest micro batch (rows of `seq_len` tokens; under pp a multiple of its pipeline
    micro-batches) whose per-rank estimate fits `capacity` bytes; 0 if none does."""
    from ..engine import EngineConfig
    from ..parallel.pp import microbatches_of

    engine = EngineConfig.from_any(engine)
    step = microbatches_of(engine.pp_size, engine.pp_microbatches) if engine.pp_size > 1 else 1

    def fits(multiple: int) -> bool:
        return estimate_run(model, engine, world_size, multiple * step, seq_len, **kwargs).per_rank <= capacity

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
        if high * step > limit:
            return low * step  # at least this: more rows than anyone runs
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step
