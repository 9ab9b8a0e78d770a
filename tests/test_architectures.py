"""Every causal-LM type in the installed transformers gets a working auto plan.

Each type is built from a tiny config made generically from its default one (sizes, layers,
vocabulary shrunk; dropout and caches off), sharded with the auto plan at world 2 and trained
two steps against the same model in one process, all in one process group. A type is skipped
only when no tiny config of it builds and trains in one process at all (a missing optional
package, a default config transformers itself cannot build); the skips are printed with their
reasons and counted.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import transformers
from harness.compare import train_against_reference
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fullshard import FSDP2Engine
from fullshard.fsdp import fsdp_units
from fullshard.testing import ZOO, make_batch, run_distributed
from fullshard.testing.zoo import VOCAB

TOL = 1e-5
MIN_TESTED = 150
MAX_PARAMS = 5_000_000  # a tiny config bigger than this kept a size no rule here knows how to shrink
LAYERS = 2
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
              "num_decoder_layers")
SIZES = (
    (32, ("hidden_size", "n_embd", "d_model", "embed_dim", "n_embed", "word_embed_proj_dim", "hidden_dim", "dim",
          "d_embed", "embedding_size", "emb_dim", "hidden_size_global", "attention_hidden_size",
          "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
          "moe_ffn_hidden_size")),
    (64, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim", "d_inner",
          "filter_size", "ffn_hidden_size", "dim_ff", "max_position_embeddings", "n_positions", "n_ctx")),
    (LAYERS, LAYER_KEYS),
    (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
         "encoder_attention_heads", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
         "mamba_n_heads")),
    (2, ("num_key_value_heads", "n_kv_heads", "multi_query_group_num", "num_kv_heads", "num_experts_per_tok",
         "moe_topk", "moe_k")),
    (8, ("head_dim", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_head_size",
         "rotary_dim", "attention_head_dim", "time_step_rank", "mamba_dt_rank")),
    (16, ("q_lora_rank", "kv_lora_rank", "mamba_d_head", "mamba_d_state", "state_size", "mamba_chunk_size",
          "chunk_size")),
    (1, ("n_groups", "mamba_n_groups")),
)
SIZE = {key: value for value, keys in SIZES for key in keys}
# keys whose valid values are a shape, not a size (Reformer's axial positions and chunks, for 16 tokens)
FIXED = {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 4], "lsh_attn_chunk_length": 8,
         "local_attn_chunk_length": 8}
# tried in order: multi-head latent attention (DeepSeek and kin) wants as many kv heads as heads,
# Mamba-2 heads of 16 (heads x head_dim = 2 x hidden), a hybrid an attention layer among its first
VARIANTS = ({}, {"num_key_value_heads": 4}, {"head_dim": 16}, {"keep_kinds": True})


def shrink(defaults: dict, keep_kinds: bool = False) -> dict:
    """Overrides that make a config (as a dict) tiny: sizes, layers, token ids, no cache, and no
    randomness in training (dropout, router jitter), so one process and two do the same math."""
    out = {}
    layers = next((defaults[k] for k in LAYER_KEYS if type(defaults.get(k)) is int), None)
    for key, value in defaults.items():
        if isinstance(value, dict) and key.endswith("config"):
            out[key] = shrink(value, keep_kinds)
        elif key in SIZE and (value is None or (type(value) is int and value > SIZE[key])):
            out[key] = SIZE[key]
        elif "vocab" in key and type(value) is int and value > VOCAB:
            out[key] = VOCAB
        elif key.endswith("token_id") and type(value) is int and value >= VOCAB:
            out[key] = 0
        elif key.endswith("token_id") and isinstance(value, list):
            out[key] = [t for t in value if t < VOCAB] or 0
        elif isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "layerdrop", "jitter", "noise")):
            out[key] = 0.0
        elif isinstance(value, list) and layers and len(value) == layers > LAYERS:  # per-layer lists
            out[key] = _first_layers(value) if keep_kinds else value[:LAYERS]
    out.update({k: v for k, v in FIXED.items() if k in defaults})
    out.update({k: v for k, v in (("use_cache", False), ("is_decoder", True)) if k in defaults})
    return out


def _first_layers(per_layer: list) -> list:
    """`LAYERS` entries of a per-layer list, keeping its kinds (a hybrid keeps an attention layer)."""
    firsts = sorted({str(v): i for i, v in reversed(list(enumerate(per_layer)))}.values())[:LAYERS]
    rest = [i for i in range(len(per_layer)) if i not in firsts]
    return [per_layer[i] for i in sorted(firsts + rest[:LAYERS - len(firsts)])]


def tiny_kwargs(config_cls: type, variant: dict) -> dict:
    defaults = config_cls().to_dict()
    variant = dict(variant)
    kwargs = shrink(defaults, variant.pop("keep_kinds", False))
    nested = [(kwargs[k], defaults[k]) for k in kwargs if isinstance(kwargs[k], dict)]
    for target, source in [(kwargs, defaults), *nested]:
        target.update({k: v for k, v in variant.items() if k in source})
    return kwargs


def tied(model: nn.Module) -> bool:
    try:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return False
    return getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)


def zoo_entry(model_type: str) -> tuple[tuple | None, str, bool]:
    """A zoo entry (config class, model class, kwargs) that builds and trains in one process, or
    None and the reason the plain shrink failed; and whether the model ties its head to its
    input embedding."""
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config_cls = model_cls.config_class
    reason = ""
    for variant in VARIANTS:
        try:
            config = config_cls(**tiny_kwargs(config_cls, variant))
            with torch.device("meta"):
                size = sum(p.numel() for p in model_cls._from_config(config).parameters())
            if size > MAX_PARAMS:
                raise ValueError(f"{size:,} parameters after shrinking")
            model = model_cls._from_config(config).train()
            model(**make_batch(model_type, batch_size=2)).loss.backward()
            return (config_cls.__name__, model_cls.__name__, tiny_kwargs(config_cls, variant)), "", tied(model)
        except Exception as error:  # noqa: BLE001 - the reason is reported
            first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
            reason = reason or f"{type(error).__name__}: {first_line[:120]}"
    return None, reason, False


def has_repeated_blocks(model: nn.Module) -> bool:
    """A ModuleList of two or more modules of one class holding parameters: what a plan should shard apart."""
    return any(
        isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
        and any(True for _ in m.parameters())
        for m in model.modules()
    )


@contextlib.contextmanager
def registered(entries: dict):
    """Put the tiny configs in the zoo, so `train_against_reference` builds them like any zoo model."""
    ZOO.update(entries)
    try:
        yield
    finally:
        for name in entries:
            ZOO.pop(name, None)


def _train_every_type(model_types: list[str]) -> dict:
    torch.set_num_threads(1)
    # which types build and train in one process: each rank finds out for its share, then all share
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    found = [None] * world
    torch.distributed.all_gather_object(found, {t: zoo_entry(t) for t in model_types[rank::world]})
    entries, skipped, ties = {}, {}, {}
    for model_type in model_types:
        entry, reason, ties[model_type] = next(share[model_type] for share in found if model_type in share)
        if entry is None:
            skipped[model_type] = reason
        else:
            entries[model_type] = entry
    engine = FSDP2Engine({"mixed_precision": "fp32"})
    results = {}
    with registered(entries):
        for name in entries:
            try:
                r = train_against_reference(
                    name, engine.prepare_model, steps=2, check_tie=ties[name],
                    inspect=lambda m: (has_repeated_blocks(m), len(fsdp_units(m)), engine.plan.unit_names()),
                )
                results[name] = {k: r[k] for k in ("loss", "ref_loss", "max_weight_diff", "tied", "inspect")}
            except Exception as error:  # noqa: BLE001 - every failure is reported at the end
                results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return {"skipped": skipped, "results": results}


def problems_of(name: str, r: dict) -> list[str]:
    if "error" in r:
        return [f"{name}: {r['error']}"]
    out = []
    loss_diff = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"]))
    if not loss_diff <= TOL:
        out.append(f"{name}: losses {r['loss']} vs one process {r['ref_loss']} (diff {loss_diff:.2e})")
    if not all(r["tied"]):
        out.append(f"{name}: the tied head and embedding were split apart by sharding")
    repeated, units, plan_units = r["inspect"]
    if repeated and units <= 2:
        out.append(f"{name}: has repeated blocks but is sharded as {units} unit(s): {plan_units}")
    return out


def test_every_causal_lm_type_trains_sharded_like_one_process():
    model_types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    outcome = run_distributed(_train_every_type, 2, model_types, timeout=900)[0]
    skipped, results = outcome["skipped"], outcome["results"]
    summary = "\n".join([f"{len(results)} of {len(model_types)} causal-LM types tested; {len(skipped)} skipped:",
                         *(f"  skipped {name}: {reason}" for name, reason in sorted(skipped.items()))])
    warnings.warn(summary, stacklevel=1)  # shown in pytest's summary whether the test passes or not
    print(summary)
    worst = sorted(results, key=lambda n: -results[n].get("max_weight_diff", 0))[:5]
    print("largest weight differences:", {n: results[n].get("max_weight_diff") for n in worst})
    problems = [p for name, r in sorted(results.items()) for p in problems_of(name, r)]
    assert not problems, "\n".join(problems)
    assert len(results) >= MIN_TESTED, f"only {len(results)} types could be built offline"
    assert len(results) + len(skipped) == len(model_types)
