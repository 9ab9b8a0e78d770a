"""A per-rank memory estimate for training a decoder model with FSDP2, from its config alone.

Parameters, gradients and AdamW's two moments are sharded, so each rank holds its shard of each
(FSDP2 shards dim 0 and pads to equal rows: the largest shard is what a rank must fit). On top,
the all-gathered weights of the unit computing now and of the one prefetched, in the compute
dtype, and the activations saved for backward. Activations were counted on transformers' Llama
with `saved_tensors_hooks` (test_cli checks the estimate against that count and against the
shards of a real run): per token, each decoder layer saves about 8H + 2·kv + 4I values (H hidden,
kv the key/value width, I the MLP width), the embedding and final norm about 3H, and the loss
its fp32 log-softmax (V values, V the vocabulary; the logits themselves are not saved, the head
saves its input). With activation checkpointing a layer keeps only its input (H); its
recompute in backward briefly adds one layer's activations, which the estimate leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..plan import ShardingPlan, shard_bytes

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters (shard)", self.parameters), ("gradients (shard)", self.gradients),
                ("optimizer state (shard)", self.optimizer), ("all-gathered units (2 largest)", self.gathered),
                ("activations (one micro-batch)", self.activations), ("total", self.total)]

    def describe(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name.ljust(width)}  {value / 2**20:>10.2f} MiB" for name, value in self.rows())


def activation_bytes(config, micro_batch_size: int, seq_len: int, compute_bytes: int,
                     activation_checkpointing: bool = False) -> int:
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = 8 * hidden + 2 * kv_heads * head_dim + 4 * inter
    if activation_checkpointing:
        body = layers * hidden
    else:
        body = layers * per_layer
    tokens = micro_batch_size * seq_len
    return tokens * (compute_bytes * (body + 3 * hidden) + 4 * config.vocab_size)


def estimate_memory(model: nn.Module, plan: ShardingPlan, shard_size: int, micro_batch_size: int, seq_len: int,
                    compute_dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
                    optimizer: str = "adamw") -> MemoryEstimate:
    """The estimate for `model` (real or on meta) sharded by `plan` over `shard_size` ranks."""
    shard = trainable = 0
    unit_full: dict[int | None, int] = {}
    for name, param in model.named_parameters():
        per_rank = shard_bytes(param, shard_size)[1]
        shard += per_rank
        if param.requires_grad:
            trainable += per_rank
        unit = plan.unit_index_of_parameter(name)
        unit_full[unit] = unit_full.get(unit, 0) + param.numel() * compute_dtype.itemsize
    largest = sorted(unit_full.values(), reverse=True)[:2]
    compute_bytes = compute_dtype.itemsize
    return MemoryEstimate(
        parameters=shard,
        gradients=trainable,
        optimizer=OPTIMIZER_STATES[optimizer] * trainable,
        gathered=sum(largest) if shard_size > 1 else 0,
        activations=activation_bytes(model.config, micro_batch_size, seq_len, compute_bytes, activation_checkpointing),
    )


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
