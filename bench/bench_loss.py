"""The chunked loss (`train.loss_chunk_tokens`) against the loss from whole logits: one training step
of a tiny Llama with a 128K vocabulary (Llama 3's 128,256), where the head is most of the work.

Every variant runs in one process group, FSDPStrategy at world size 2 (gloo), fp32: peak memory
is torch's FSDPMemTracker's peak of live tensor bytes per rank over one step after a warm-up step
(exact, whatever the machine's load), and tokens/s the median of interleaved timed steps, the
variants taking turns so that load that comes and goes hits them alike.

    .venv/bin/python bench/bench_loss.py          # ~2 minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402
from bench.variants import peak_and_speed_cells, run_variants, time_interleaved  # noqa: E402

MODEL = dict(vocab_size=128_256, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
WORLD, MICRO, SEQ, ROUNDS = 2, 4, 256, 5
CHUNKS = (0, 1024, 128)  # 0: whole logits; 1024: the default (one chunk of a rank's 1,024 tokens); 128: 1/8


def _run() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard import FSDPStrategy
    from fullshard.plan import auto_plan
    from fullshard.train.memory import estimate_memory, measured_peak_bytes
    from fullshard.train.step import train_step

    def batch(step: int) -> list[dict]:  # this rank's rows
        seed = step * WORLD + torch.distributed.get_rank()
        ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(seed))
        return [{"input_ids": ids, "labels": ids}]

    runs = {}
    for chunk in CHUNKS:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**MODEL))
        estimate = estimate_memory(model, auto_plan(model), WORLD, MICRO, SEQ, accumulation_steps=1,
                                   device_type="cpu", loss_chunk_tokens=chunk)
        strategy = FSDPStrategy(max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=MICRO * WORLD, bf16=False)
        model = strategy.prepare_model(model, is_training=True)
        optimizer = strategy.create_optimizer(model, lr=1e-4)
        step = lambda s, m=model, o=optimizer, st=strategy, c=chunk: train_step(st, m, o, None, batch(s), c)  # noqa: E731
        step(0)  # warm-up: the optimizer state exists from here on
        runs[chunk] = {"step": step, "measure": lambda m=model, o=optimizer, st=step: measured_peak_bytes(
            m, o, lambda: st(1), batch(1)), "estimate": estimate.total, "times": []}
    return time_interleaved(runs, ROUNDS, lambda run, out: run.update(last_loss=out.loss))


def main() -> None:
    runs, load_before, load_after = run_variants(_run, WORLD)
    whole = runs[0]
    tokens = WORLD * MICRO * SEQ
    rows = []
    for chunk, run in runs.items():
        peak, speed = peak_and_speed_cells(run, whole, tokens)
        name = "whole logits (loss_chunk_tokens=0)" if chunk == 0 else f"chunked, {chunk} tokens"
        rows.append([name, *peak, f"{(run['peak'] - whole['peak']) / 2**20:+,.0f}",
                     f"{run['estimate'] / run['peak']:.3f}", *speed, f"{run['last_loss']:.6f}"])
        print(rows[-1], flush=True)
    logits_mib = MICRO * SEQ * MODEL["vocab_size"] * 4 / 2**20
    body = (f"One training step (forward, token-normalised loss, backward, clip, AdamW) of a Llama with a "
            f"{MODEL['vocab_size']:,}-token vocabulary, hidden size {MODEL['hidden_size']}, "
            f"{MODEL['num_hidden_layers']} layers (the head and embedding are most of its parameters), micro batch "
            f"{MICRO} x {SEQ} = {MICRO * SEQ:,} tokens per rank, fp32, FSDPStrategy at world size {WORLD} on CPU "
            f"(gloo, one thread per rank): a rank's fp32 logits are {logits_mib:,.0f} MiB. Peak = FSDPMemTracker's "
            "peak of live tensor bytes on a rank (the larger of the two) over "
            "a step after a warm-up step (parameters, gradients, AdamW state, activations: exact, not subject to "
            "load); 'estimate / peak' is the memory estimate (`fullshard plan`) for the same step. tokens/s: median "
            f"of {ROUNDS} steps per variant, the variants taking turns. The last column is the last timed step's "
            "loss: the same to the last digits shown, as it must be.\n\n"
            f"Load average (1, 5, 15 min): {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} "
            f"before, {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after, on {os.cpu_count()} "
            "cores shared with other work: the memory columns are exact, the speed ratio is side by side but noisy."
            "\n\n")
    body += markdown_table(["loss", "peak MiB", "x whole", "vs whole MiB", "estimate / peak", "tokens/s",
                            "x whole", "loss value"], rows)
    write_section("loss", body)


if __name__ == "__main__":
    main()
