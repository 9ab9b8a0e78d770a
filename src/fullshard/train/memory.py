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

Under tensor parallelism a split parameter's rank holds 1/tp of it (torch's styles: colwise splits a
Linear's rows and bias, an Embedding's columns; rowwise a Linear's columns, not its bias, an
Embedding's rows), and FSDP shards that over dp_shard x cp; the rest is sharded over dp_shard x cp.
Under context parallelism a rank's activations are those of its 1/cp of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.tp import TP_STYLES
from ..plan import ShardingPlan, shard_bytes
from .chunked_loss import DEFAULT_LOSS_CHUNK_TOKENS, chunkable_head

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
LOSS_TRANSIENT_BYTES_PER_LOGIT = 8  # the logits' fp32 copy and the log-softmax gradient, beyond the saved output
CHUNK_BYTES_PER_LOGIT = 4  # a chunk's fp32 logits, softmax and gradient in one buffer (measured with MemTracker)
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

    @property
    def forward_peak(self) -> int:
        grads = self.gradients if self.gradients_in_forward else 0
        return self.largest_unit + self.activations + self.loss + grads

    @property
    def backward_peak(self) -> int:
        """Gradients arrive as activations are freed, layer by layer, so the two trade off: the sum
        is largest at the start (every activation, two units gathered: the tail computing, the
        last layer prefetched) or at the end (every gradient, only the root unit gathered unless a
        layer is recomputed). One unit's gradient buffers and a recomputed layer's are the same at
        every layer: they add to both ends."""
        grads_at_start = self.gradients if self.gradients_in_forward else self.first_unit_gradients
        start = self.gathered + self.activations - self.saved_loss + grads_at_start
        # recomputing the first layer gathers its unit again while the root unit is gathered
        end = (self.gathered if self.recompute else self.largest_unit) + self.gradients
        return self.unit_gradients + self.recompute + max(start, end)

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.allocator + max(self.forward_peak, self.backward_peak)

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters (shard)", self.parameters), ("gradients (shard)", self.gradients),
                ("optimizer state (shard)", self.optimizer), ("all-gathered units (2 largest)", self.gathered),
                ("activations (one micro-batch)", self.activations),
                ("loss: logits (all, or a chunk's) and gradients", self.loss),
                ("one unit's unsharded gradients", self.unit_gradients),
                ("recomputed layer and its gradients", self.recompute), ("allocator rounding", self.allocator),
                ("at the end of the forward", self.forward_peak), ("in the backward", self.backward_peak),
                ("total (parameters, optimizer, rounding, larger moment)", self.total)]

    def describe(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name.ljust(width)}  {value / 2**20:>10.2f} MiB" for name, value in self.rows())


def layer_activation_values(config) -> int:
    """Values one decoder layer saves for backward, per token."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 8 * hidden + 2 * kv_heads * head_dim + 4 * inter


def activation_bytes(config, micro_batch_size: int, seq_len: int, compute_bytes: int,
                     activation_checkpointing: bool = False, chunked_loss: bool = False) -> int:
    """What autograd saves for one micro-batch: the layers, the embedding and final norm (3H), the
    rotary cos/sin shared by the layers, the int64 ids, labels and positions, and the loss's fp32
    log-softmax (4V bytes), or, chunked, the hidden states' gradient it holds (H values)."""
    per_layer = config.hidden_size if activation_checkpointing else layer_activation_values(config)
    body = config.num_hidden_layers * per_layer
    rotary = 2 * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    tokens = micro_batch_size * seq_len
    norms = 1 if activation_checkpointing else 2 * config.num_hidden_layers + 1
    loss = compute_bytes * config.hidden_size if chunked_loss else 4 * config.vocab_size
    return tokens * (compute_bytes * (body + 3 * config.hidden_size + rotary) + 3 * 8 + loss
                     + norms * norm_upcast_bytes(config, compute_bytes))


def norm_upcast_bytes(config, compute_bytes: int) -> int:
    """RMSNorm computes in fp32: below fp32 each norm also saves its input's fp32 copy (4H bytes per token)."""
    return 4 * config.hidden_size if compute_bytes < 4 else 0


def estimate_memory(model: nn.Module, plan: ShardingPlan, shard_size: int, micro_batch_size: int, seq_len: int,
                    compute_dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
                    optimizer: str = "adamw", accumulation_steps: int | None = None,
                    device_type: str = "cuda", reduce_dtype: torch.dtype = torch.float32,
                    tp_assignments: dict[str, str] | None = None, tp_size: int = 1, cp_size: int = 1,
                    ep_size: int = 1, loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> MemoryEstimate:
    """The estimate for `model` (real or on meta) sharded by `plan` over `shard_size` (dp_shard) x
    `cp_size` ranks, after the modules of `tp_assignments` (name -> TP style) are split `tp_size` ways.
    With `ep_size` > 1 each MoE experts module is a unit of its own that gathers only this rank's
    `num_experts / ep_size` experts (its shard is the same 1 / (dp_shard x cp) as any parameter's);
    where no other rank holds them (ep = dp_shard x cp) they are not gathered at all, only cast to the
    compute dtype if it differs.

    `accumulation_steps` None (unknown) counts the gradients through the forward, as when
    micro-batches accumulate; `device_type` "cpu" has no allocator rounding; `loss_chunk_tokens`
    is `train.loss_chunk_tokens`.
    """
    split = TensorParallelSplit(model, tp_assignments or {}, tp_size)
    units = _unit_bytes(model, plan, shard_size * cp_size, compute_dtype, optimizer,
                        ALLOCATOR_BLOCK if device_type != "cpu" else 1, split,
                        expert_units(model, ep_size, shard_size * cp_size))
    seq_len = -(-seq_len // cp_size)  # this rank's part of each sequence
    # a VLM's activations are its language model's (the vision tower's, per image, are not counted)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    compute_bytes, tokens = compute_dtype.itemsize, micro_batch_size * seq_len
    head = chunked_head(model, loss_chunk_tokens, tp_assignments or {})
    activations = activation_bytes(config, micro_batch_size, seq_len, compute_bytes, activation_checkpointing,
                                   chunked_loss=head is not None)
    if head is None:
        loss, saved_loss = tokens * config.vocab_size * LOSS_TRANSIENT_BYTES_PER_LOGIT, tokens * config.vocab_size * 4
    else:
        # a chunk's logits; the head's gradient, made in the forward; the head unit's all-gather
        # buffer, which FSDP frees only when the root's forward ends; and a second copy of the hidden
        # states' gradient (the one it saves), live while the final norm's backward takes it on
        # (bench_loss measures these)
        chunk_bytes = CHUNK_BYTES_PER_LOGIT + (compute_bytes if compute_bytes < 4 else 0)
        head_bytes = sum(p.numel() for p in head.parameters()) * compute_bytes
        loss = (min(loss_chunk_tokens, tokens) * config.vocab_size * chunk_bytes + 2 * head_bytes
                + tokens * config.hidden_size * compute_bytes)
        saved_loss = tokens * config.hidden_size * compute_bytes
    # a checkpointed layer's backward recomputes its activations and then holds their gradients
    # beside them: about two layers' worth in all, measured (bench_memory)
    layer = compute_bytes * layer_activation_values(config) + 2 * norm_upcast_bytes(config, compute_bytes)
    recompute = 2 * tokens * layer if activation_checkpointing else 0
    full = sorted(units["full"].values(), reverse=True)
    largest = max(units["full"], key=units["full"].get)
    reduce_copy = reduce_dtype.itemsize if reduce_dtype != compute_dtype else 0
    trainable = sum(units["grad"].values())
    return MemoryEstimate(
        parameters=units["shard"], gradients=trainable, optimizer=OPTIMIZER_STATES[optimizer] * trainable,
        gathered=sum(full[:2]), activations=activations,
        loss=loss,
        unit_gradients=units["numel"][largest] * reduce_copy + full[0] + units["grad"].get(largest, 0),
        allocator=units["rounding"], gradients_in_forward=accumulation_steps is None or accumulation_steps > 1,
        largest_unit=full[0], saved_loss=saved_loss,
        first_unit_gradients=max(units["grad"].values(), default=0), recompute=recompute,
    )


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
    DIMS = {("colwise", nn.Linear, "weight"): 0, ("colwise", nn.Linear, "bias"): 0, ("colwise", nn.Embedding, "weight"): 1,
            ("rowwise", nn.Linear, "weight"): 1, ("rowwise", nn.Embedding, "weight"): 0}

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
        units.update({f"{name}.{p}": (name, ep_size, kept_whole) for p, _ in model.get_submodule(name).named_parameters()})
    return units


def _unit_bytes(model: nn.Module, plan: ShardingPlan, shard_size: int, compute_dtype: torch.dtype, optimizer: str,
                block: int, split: TensorParallelSplit, experts: dict[str, tuple[str, int, bool]] | None = None) -> dict:
    """Per FSDP unit: its all-gathered bytes in the compute dtype (a tp rank gathers its 1/tp), its
    element count and this rank's gradient shard; over the model: this rank's parameter shard and
    the allocator's rounding."""
    out = {"full": {}, "numel": {}, "grad": {}, "shard": 0, "rounding": 0}
    for name, full_param in model.named_parameters():
        param = split.local(name, full_param)
        per_rank = shard_bytes(param, shard_size)[1]
        unit, gathered = plan.unit_index_of_parameter(name), param.numel()
        if name in (experts or {}):  # its own unit, gathering this rank's experts only
            unit, ep, kept_whole = experts[name]
            gathered = 0 if kept_whole and param.dtype == compute_dtype else gathered // ep
        out["shard"] += per_rank
        out["full"][unit] = out["full"].get(unit, 0) + gathered * compute_dtype.itemsize
        out["numel"][unit] = out["numel"].get(unit, 0) + gathered
        if full_param.requires_grad:
            out["grad"][unit] = out["grad"].get(unit, 0) + per_rank
        copies = 1 + (1 + OPTIMIZER_STATES[optimizer]) * full_param.requires_grad  # the weight, its gradient and moments
        out["rounding"] += copies * (-(-per_rank // block) * block - per_rank)
    return out


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
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs(tuple(inputs))
    with tracker:
        run()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
