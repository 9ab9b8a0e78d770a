"""MFU of fullshard training on one GPU for a ~1B-parameter Llama-shaped model (random weights, no download).

    .venv/bin/python bench/gpu_mfu.py            # needs a CUDA GPU; writes the "train-gpu" section

MFU = tokens/s x (6N + 12 L H S) / peak bf16 FLOP/s (see fullshard.train.metrics), bf16 compute
with fp32 master weights and reduction, activation checkpointing off and on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402

MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
MICRO, SEQ, WARMUP, STEPS = 4, 2048, 3, 10


def measure(activation_checkpointing: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard import FSDPStrategy
    from fullshard.train.metrics import model_flops_per_token, peak_device_flops
    from fullshard.train.step import train_step

    strategy = FSDPStrategy(max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=MICRO, bf16=True,
                            args={"activation_checkpointing": activation_checkpointing})
    strategy.setup_distributed()
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa"))
    model = strategy.prepare_model(model, is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    batches = [{"input_ids": (ids := torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), device="cuda")), "labels": ids}]
    for _ in range(WARMUP):
        train_step(strategy, model, optimizer, None, batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        train_step(strategy, model, optimizer, None, batches)
    torch.cuda.synchronize()
    tokens_per_s = STEPS * MICRO * SEQ / (time.perf_counter() - start)
    flops = model_flops_per_token(model, SEQ)
    peak = peak_device_flops()
    result = {"params": sum(p.numel() for p in model.parameters()), "tokens_per_s": tokens_per_s,
              "mfu": tokens_per_s * flops / peak if peak else None,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_mfu.py needs a CUDA GPU")
    rows = []
    for ac in (False, True):
        r = measure(ac)
        print(ac, r, flush=True)
        rows.append([f"{r['params'] / 1e9:.2f}B", "on" if ac else "off", f"{r['tokens_per_s']:,.0f}",
                     f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a", f"{r['peak_mem_gib']:.1f}"])
    body = (f"One {torch.cuda.get_device_name()}, Llama-shaped model (random weights), micro batch {MICRO} x {SEQ} "
            "tokens, bf16 compute, fp32 master weights, AdamW (fused), clip 1.0.\n\n")
    body += markdown_table(["params", "activation ckpt", "tokens/s", "MFU", "peak GiB"], rows)
    write_section("train-gpu", body)


if __name__ == "__main__":
    main()
