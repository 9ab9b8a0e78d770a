"""A tiny causal LM whose MoE keeps one module per expert and loops over them itself, as transformers
4.x Mixtral / Qwen2-MoE / OLMoE and many remote-code models do (transformers 5 fuses every MoE it
ships, so none of its classes has this form).

It is transformers' `MixtralForCausalLM` with each decoder layer's MoE swapped for the 4.x block
(`block_sparse_moe`: router `gate`, softmax, top-k, optional renormalising, `experts` a
`ModuleList` of `w1` / `w2` / `w3` MLPs): its state-dict keys are the ones transformers 5 still
writes for Mixtral (`model.layers.0.block_sparse_moe.experts.3.w1.weight`), so a checkpoint moves
between the two classes. The module lives outside transformers, so transformers treats it as custom
code and applies no key conversion to it. Config switches beyond Mixtral's:
`skip_idle_experts` (loop only over experts that got tokens, the `expert_hit` form) and
`shared_expert_intermediate_size` (a sigmoid-gated shared expert, Qwen2-MoE's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mixtral import modeling_mixtral
from transformers.utils.output_capturing import OutputRecorder


class ExpertMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class SparseMoeBlock(nn.Module):
    """transformers 4.x's Mixtral block (a loop over experts, `index_add_` of their weighted rows)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.jitter_noise = config.router_jitter_noise
        self.skip_idle = getattr(config, "skip_idle_experts", False)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(config) for _ in range(self.num_experts))
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        if shared:
            self.shared_expert = ExpertMLP(config, shared)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        if self.skip_idle:
            experts = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()  # one-element tensors
        else:
            experts = range(self.num_experts)
        for expert in experts:
            idx, top_x = torch.where(expert_mask[expert].reshape(self.top_k, -1))
            current = hidden_states[None, top_x].reshape(-1, hidden)
            current = self.experts[expert](current) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        if hasattr(self, "shared_expert"):
            final = final + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return final.reshape(batch, length, hidden), router_logits


class ListMoeDecoderLayer(modeling_mixtral.MixtralDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.mlp
        self.block_sparse_moe = SparseMoeBlock(config)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_values=past_key_values, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states, _ = self.block_sparse_moe(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class ListMoeModel(modeling_mixtral.MixtralModel):
    # the router logits come from the 4.x block's second output (Mixtral records its router module's)
    _can_record_outputs = {**modeling_mixtral.MixtralModel._can_record_outputs,
                           "router_logits": OutputRecorder(SparseMoeBlock, index=1)}

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(ListMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()


class ListMoeForCausalLM(modeling_mixtral.MixtralForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = ListMoeModel(config)
        self.post_init()

