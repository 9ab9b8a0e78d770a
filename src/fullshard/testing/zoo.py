"""Tiny random models built from configs, one per architecture family fullshard must handle.

Sizes are chosen to exercise sharding edge cases: a vocabulary of 101 (prime, so every world
size gets uneven shards), grouped-query attention, tied and untied heads, Conv1D (GPT-2), MoE
experts inside decoder layers, and an encoder with a `position_ids` buffer. Dropout is zero so a
sharded run and a single-process run do the same math.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

# name -> (config class, model class, config kwargs)
ZOO: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=8, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(COMMON, tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(COMMON, head_dim=8, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                   tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                             tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(COMMON, head_dim=8, num_experts=4,
                                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 decoder_sparse_step=1, mlp_only_layers=[],
                                                                 tie_word_embeddings=False)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=64,
                                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0, tie_word_embeddings=True)),
}

TIED = {name for name, (_, _, kw) in ZOO.items() if kw.get("tie_word_embeddings")}
MOE = {"mixtral", "qwen3_moe"}

# Every MoE causal-LM family expert parallelism is checked on: 8 experts (so ep 2 and ep 4 both split
# them), top-2, every layer sparse. Kept out of ZOO, whose every entry the dense parity tests run.
_MOE_COMMON = dict(COMMON, tie_word_embeddings=False, num_experts_per_tok=2)
MOE_ZOO: dict[str, tuple[str, str, dict]] = {
    "ep_mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_MOE_COMMON, num_local_experts=8)),
    "ep_qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                     dict(_MOE_COMMON, num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                          mlp_only_layers=[])),
    "ep_qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_MOE_COMMON, head_dim=8, num_experts=8,
                                                                   moe_intermediate_size=16, mlp_only_layers=[])),
    "ep_olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_MOE_COMMON, num_experts=8, pad_token_id=0, eos_token_id=2)),
    "ep_deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _MOE_COMMON, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=0,
        n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, num_key_value_heads=4)),
    "ep_gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(_MOE_COMMON, num_local_experts=8, head_dim=8,
                                                             sliding_window=8)),
    "ep_phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(_MOE_COMMON, num_local_experts=8, router_jitter_noise=0.0,
                                                            input_jitter_noise=0.0)),
}


# MoEs that keep one module per expert, which no transformers 5 class does: `moe_lists.ListMoeForCausalLM`
# (transformers 4.x's Mixtral block) with every expert called, only those with tokens (`skip_idle_experts`),
# a shared expert, or router jitter. Kept out of MOE_ZOO, whose every entry test_ep runs.
_LIST_MOE = dict(_MOE_COMMON, num_local_experts=8)
LIST_MOE_ZOO: dict[str, tuple[str, str, dict]] = {
    "list_mixtral": ("MixtralConfig", "ListMoeForCausalLM", _LIST_MOE),
    "list_skip_idle": ("MixtralConfig", "ListMoeForCausalLM", dict(_LIST_MOE, skip_idle_experts=True)),
    "list_shared": ("MixtralConfig", "ListMoeForCausalLM", dict(_LIST_MOE, shared_expert_intermediate_size=32)),
    "list_jitter": ("MixtralConfig", "ListMoeForCausalLM", dict(_LIST_MOE, router_jitter_noise=0.5)),
}


def _entry(name: str) -> tuple[str, str, dict]:
    for zoo in (ZOO, MOE_ZOO, LIST_MOE_ZOO):
        if name in zoo:
            return zoo[name]
    raise KeyError(f"no tiny model named {name!r}")


def tiny_config(name: str, **overrides):
    config_cls, _, kwargs = _entry(name)
    return getattr(transformers, config_cls)(**{**kwargs, **overrides})


def model_class(name: str):
    from . import moe_lists

    class_name = _entry(name)[1]
    return getattr(transformers, class_name, None) or getattr(moe_lists, class_name)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """The same random weights for the same seed, in any process."""
    torch.manual_seed(seed)
    model = model_class(name)._from_config(tiny_config(name, **overrides), dtype=dtype)
    model.train()
    return model


def make_batch(name: str, batch_size: int = 4, seq_len: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs and labels with no padding, so every rank's slice holds the same number of targets."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def make_padded_batch(name: str, batch_size: int = 4, seq_len: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """`make_batch` with an attention mask: even rows padded on the left, odd rows on the right, each
    by a different length (the padding's labels ignored), as RL and chat batches arrive."""
    batch = make_batch(name, batch_size, seq_len, seed)
    mask = torch.ones_like(batch["input_ids"])
    for row in range(batch_size):
        pad = 1 + (3 * row) % (seq_len // 2)
        mask[row, :pad] = 0 if row % 2 == 0 else 1
        if row % 2:
            mask[row, seq_len - pad:] = 0
    batch["labels"][mask == 0] = -100
    return {**batch, "attention_mask": mask}
