"""The memory estimate (`fullshard plan`, `fullshard.train.memory`) against the measured peak.

Three Llama sizes train one step each at world size 2 on CPU (gloo) through `FSDPStrategy` and
`train_step`, after a warm-up step so the optimizer state exists; the peak of live tensor bytes
per rank is measured with torch's FSDPMemTracker (`measured_peak_bytes`) and compared with the
estimate for the same model, plan, batch and precision. The estimate must never be below the
peak (the script exits non-zero if it is) and aims at no more than 10% above (reported).

    .venv/bin/python bench/bench_memory.py          # ~3 minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

WORLD, MICRO, SEQ = 2, 2, 128
SIZES = {  # name -> LlamaConfig kwargs
    "S (4 x 128, vocab 2k)": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, vocab_size=2048),
    "M (6 x 256, vocab 8k)": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, vocab_size=8192),
    "L (8 x 512, vocab 16k)": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, vocab_size=16384),
}
# (size, compute dtype, activation checkpointing, micro-batches per step, train.loss_chunk_tokens)
CASES = [(name, "fp32", False, 1, 0) for name in SIZES] + [
    ("M (6 x 256, vocab 8k)", "bf16", True, 1, 0), ("M (6 x 256, vocab 8k)", "fp32", False, 2, 0)] + [
    (name, "fp32", False, 1, 64) for name in SIZES] + [
    ("M (6 x 256, vocab 8k)", "bf16", True, 1, 64), ("L (8 x 512, vocab 16k)", "fp32", False, 1, 1024)]


def _case(size: str, precision: str, checkpointing: bool, accumulation: int, chunk: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard import FSDPStrategy
    from fullshard.dtypes import DTYPES
    from fullshard.plan import auto_plan
    from fullshard.train.memory import estimate_memory, measured_peak_bytes
    from fullshard.train.step import train_step

    config = LlamaConfig(**SIZES[size], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    strategy = FSDPStrategy(max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=MICRO * WORLD * accumulation,
                            config={"mixed_precision": precision, "activation_checkpointing": checkpointing})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    estimate = estimate_memory(model, auto_plan(model), WORLD, MICRO, SEQ, DTYPES[precision], checkpointing,
                               accumulation_steps=accumulation, device_type="cpu", loss_chunk_tokens=chunk)
    model = strategy.prepare_model(model, is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-4)

    def batches(step: int) -> list[dict]:
        generator = torch.Generator().manual_seed(step)
        ids = [torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=generator) for _ in range(accumulation)]
        return [{"input_ids": i, "labels": i} for i in ids]

    train_step(strategy, model, optimizer, None, batches(0), chunk)  # warm-up: the optimizer state now exists
    step = batches(1)
    peak = measured_peak_bytes(model, optimizer, lambda: train_step(strategy, model, optimizer, None, step, chunk),
                               step)
    return {"estimate": estimate.total, "peak": peak, "params": sum(p.numel() for p in model.parameters())}


def _all_cases() -> list[dict]:
    return [_case(*case) for case in CASES]


def main() -> int:
    per_rank = run_distributed(_all_cases, WORLD)
    rows, below, loose = [], [], []
    for index, case in enumerate(CASES):
        size, precision, checkpointing, accumulation, chunk = case
        peak = max(r[index]["peak"] for r in per_rank)
        estimate = per_rank[0][index]["estimate"]
        ratio = estimate / peak
        (below if ratio < 1.0 else loose if ratio > 1.10 else []).append((case, ratio))
        rows.append([size, f"{per_rank[0][index]['params'] / 1e6:.1f}M", precision, "yes" if checkpointing else "no",
                     accumulation, chunk or "off", f"{peak / 2**20:,.2f}", f"{estimate / 2**20:,.2f}", f"{ratio:.4f}"])
        print(rows[-1], flush=True)
    body = (f"`fullshard plan`'s per-rank memory estimate against the measured per-rank peak of live tensor bytes "
            f"(torch's FSDPMemTracker over one training step after a warm-up step: forward, token-normalised loss, "
            f"backward, clip, AdamW), world size {WORLD} on CPU (gloo), micro batch {MICRO} x {SEQ} tokens, auto plan, "
            "untied Llama; 'loss chunk' is `train.loss_chunk_tokens` (off: the loss from whole logits; 1024, the "
            "default, is one chunk of these 256 tokens). The estimate must be at least the peak (ratio >= 1) and aims at no more than 10% above it. "
            "On CPU no allocator rounding applies; on a GPU the estimate adds the caching allocator's 512-byte "
            "blocks. No GPU was lent to the session that wrote this table, so the GPU row the issue asks for is "
            "still to be measured (`fullshard plan` against `torch.cuda.max_memory_allocated`).\n\n")
    body += markdown_table(["model", "parameters", "compute", "act. ckpt", "micro-batches", "loss chunk", "peak MiB",
                            "estimate MiB", "estimate / peak"], rows)
    write_section("memory", body)
    for case, ratio in loose:
        print(f"estimate / peak = {ratio:.3f}: more than 10% above the peak for {case}", file=sys.stderr)
    for case, ratio in below:
        print(f"estimate / peak = {ratio:.3f}: BELOW the peak for {case}", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
