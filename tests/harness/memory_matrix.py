"""The memory estimate against a real step, layout by layout: each cell trains a tiny model one step
after a warm-up step and measures the peak of live tensor bytes on every rank with torch's
FSDPMemTracker (`fullshard.plan.memory.measured_peak_bytes`), beside `estimate_run`'s figure for
the same model, layout, batch and precision (per pipeline stage under pp). `tests/test_memory.py`
asserts on it, `bench/bench_memory.py` tables it.

The cells of one world size run in one spawned group (`run_cells`).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import torch

MICRO, SEQ = 2, 128
LLAMA = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=SEQ, tie_word_embeddings=False)
QWEN3_MOE = dict(hidden_size=128, intermediate_size=352, moe_intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[], vocab_size=2048, max_position_embeddings=SEQ,
                 tie_word_embeddings=False)


@dataclass(frozen=True)
class Cell:
    world: int
    engine: dict = field(default_factory=dict)
    model: str = "llama"  # or "qwen3_moe"
    lora: bool = False
    stored_dtype: str | None = None  # the config's torch_dtype (the plan builds the model from the config)
    micro: int = MICRO  # rows per micro-batch (pipelines cut it into pp_microbatches)


CELLS = {
    "dp 2": Cell(2),
    "HSDP 2 x 2": Cell(4, {"dp_replicate": 2}),
    "tp 2": Cell(2, {"tp_size": 2}),
    "cp 2": Cell(2, {"cp_size": 2}),
    "ep 2": Cell(2, {"ep_size": 2}, model="qwen3_moe"),
    "ep 4": Cell(4, {"ep_size": 4}, model="qwen3_moe"),
    "MoE ep 1": Cell(2, {}, model="qwen3_moe"),
    "pp 2 GPipe": Cell(2, {"pp_size": 2, "pp_schedule": "GPipe", "pp_microbatches": 4}, micro=4),
    "pp 2 1F1B": Cell(2, {"pp_size": 2, "pp_schedule": "1F1B", "pp_microbatches": 4}, micro=4),
    "LoRA r 8": Cell(2, lora=True),
    "activation checkpointing": Cell(2, {"activation_checkpointing": True}),
    "selective checkpointing": Cell(2, {"activation_checkpointing": "selective"}),
    "every 2nd block checkpointed": Cell(2, {"activation_checkpointing": "every_n", "ac_every": 2}),
    "activation offload": Cell(2, {"activation_offload": True}),
    "float8 tensorwise": Cell(2, {"float8": "tensorwise"}),
    "float8 rowwise": Cell(2, {"float8": "rowwise"}),
    "bf16 compute": Cell(2, {"mixed_precision": "bf16"}),
    "config torch_dtype bfloat16": Cell(2, stored_dtype="bfloat16"),
    "config without torch_dtype": Cell(2, stored_dtype="none"),
}


def _hf_config(cell: Cell):
    from transformers import LlamaConfig, Qwen3MoeConfig

    config = (Qwen3MoeConfig if cell.model == "qwen3_moe" else LlamaConfig)(
        **(QWEN3_MOE if cell.model == "qwen3_moe" else LLAMA))
    if cell.stored_dtype == "bfloat16":
        config.dtype = torch.bfloat16
    elif cell.stored_dtype == "none":
        config.dtype = None
    return config


def _plan_model(cell: Cell, config):
    """The model as `fullshard plan` builds it: from the config on disk for the stored-dtype cells."""
    from fullshard.lora import apply_lora
    from fullshard.train.config import load_config
    from fullshard.train.preflight import build_meta_model

    if cell.stored_dtype is None:
        with torch.device("meta"):
            model = _model_class(cell)._from_config(config, dtype=torch.float32)
    else:
        with tempfile.TemporaryDirectory() as directory:
            config.save_pretrained(directory)
            model = build_meta_model(load_config(None, [f"--model.name_or_path={directory}"]))
    return apply_lora(model, LORA) if cell.lora else model


LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def _model_class(cell: Cell):
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if cell.model == "qwen3_moe" else LlamaForCausalLM


def measure_cell(name: str) -> dict:
    """On every rank of the group: this rank's measured peak, and the estimate of the stage it holds."""
    import torch.distributed as dist

    from fullshard.faces.lightrft import FSDPStrategy
    from fullshard.lora import apply_lora
    from fullshard.parallel.cp import context_parallel_batch
    from fullshard.parallel.pp import pipeline_of
    from fullshard.plan.memory import estimate_run, measured_peak_bytes
    from fullshard.train.pp_step import pipeline_train_step
    from fullshard.train.step import train_step

    cell = CELLS[name]
    config, engine = _hf_config(cell), {"mixed_precision": "fp32", **cell.engine}  # the strategy's default is bf16
    strategy = FSDPStrategy(seed=0, max_norm=1.0, micro_train_batch_size=cell.micro, config=engine,
                            train_batch_size=cell.micro * cell.world // (cell.engine.get("tp_size", 1)
                                                                     * cell.engine.get("cp_size", 1)
                                                                     * cell.engine.get("pp_size", 1)))
    strategy.setup_distributed()
    torch.manual_seed(0)
    model = _model_class(cell)._from_config(config, dtype=torch.float32)
    if cell.lora:
        model = apply_lora(model, LORA)
    model = strategy.prepare_model(model, is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    dims = strategy.parallel_dims
    pipeline = pipeline_of(model)
    step_fn = pipeline_train_step if pipeline is not None else train_step

    def batches(step: int) -> list[dict]:
        generator = torch.Generator().manual_seed(100 * step + dims.coordinates(dist.get_rank())["dp"])
        ids = torch.randint(0, config.vocab_size, (cell.micro, SEQ), generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        if dims.cp > 1:
            batch = context_parallel_batch(batch, dims.coordinates(dist.get_rank())["cp"], dims.cp)
            # one document per row, no mask: CPU's SDPA with a document mask takes the math path, which
            # saves every head's [seq, seq] probabilities; a GPU's kernels save none (what the plan counts)
            batch.pop("position_ids")
        return [batch]

    step_fn(strategy, model, optimizer, None, batches(0))  # the optimizer state exists from here on
    step = batches(1)
    peak = measured_peak_bytes(model, optimizer, lambda: step_fn(strategy, model, optimizer, None, step), step)
    estimate = estimate_run(_plan_model(cell, config), engine, cell.world, cell.micro, SEQ, accumulation_steps=1,
                            device_type="cpu")
    stage = 0 if pipeline is None else pipeline.stages[0].fullshard_stage.index
    return {"peak": peak, "estimate": estimate.stages[stage].estimate.total, "stage": stage,
            "label": estimate.stages[stage].label}


def _cells(names: list[str]) -> dict:
    from fullshard.distributed import barrier

    out = {}
    for name in names:
        out[name] = measure_cell(name)
        barrier()
    return out


def run_cells(names: list[str] | None = None, timeout: float = 900) -> dict[str, list[dict]]:
    """Cell name -> per-stage rows (stage, label, peak: the max over the ranks holding it, estimate),
    each world size's cells in one spawned group."""
    from fullshard.testing.spawn import run_distributed

    names = list(CELLS) if names is None else names
    results: dict[str, list[dict]] = {}
    for world in sorted({CELLS[n].world for n in names}):
        group = [n for n in names if CELLS[n].world == world]
        per_rank = run_distributed(_cells, world, group, timeout=timeout)
        for name in group:
            stages: dict[int, dict] = {}
            for rank in per_rank:
                row = rank[name]
                best = stages.setdefault(row["stage"], dict(row))
                best["peak"] = max(best["peak"], row["peak"])
            results[name] = [stages[s] for s in sorted(stages)]
    return results
