"""An RL update step with chunked log-probs (`token_logprobs` + entropy through the head a chunk of
tokens at a time) against whole-logits log-softmax (the logits of the whole micro-batch in fp32,
then log-softmax and gather, as TRL's `selective_log_softmax` takes them), on a Llama with a
128K vocabulary, where the head is most of the work.

Both run `fullshard.rl.policy_update` (PPO clip, k3 KL against given reference log-probs, entropy
bonus, token-mean, one AdamW step) in one process group, world 2 (gloo), fp32; only
`chunk_tokens` differs (0: whole logits). Peak memory is FSDPMemTracker's peak of live tensor
bytes per rank over one step after a warm-up step (exact, whatever the machine's load); tokens/s
the median of interleaved timed steps.

    .venv/bin/python bench/bench_rl.py          # a few minutes on 2 CPU cores; writes BENCHMARKS.md
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
WORLD, ROWS, SEQ, PROMPT, ROUNDS = 2, 4, 256, 64, 4
CHUNKS = (0, 1024, 256)  # 0: whole logits; 1024: the default, one chunk of a rank's 1,024 tokens; 256: 1/4


def _rollouts(step: int):
    import torch

    from fullshard import rl

    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(step * WORLD + rank)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=generator)
    response = (torch.arange(SEQ - 1) >= PROMPT - 1).float().expand(ROWS, -1)
    ref = -torch.rand(ROWS, SEQ - 1, generator=generator) * 12 * response
    return rl.Rollouts(ids, torch.ones_like(ids), response, torch.randn(ROWS, generator=generator),
                       old_logprobs=None, ref_logprobs=ref)


def _run() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard import FSDP2Engine, create_optimizer, rl
    from fullshard.plan.memory import measured_peak_bytes

    runs = {}
    for chunk in CHUNKS:
        torch.manual_seed(0)
        model = FSDP2Engine({"mixed_precision": "fp32"}).shard_model(LlamaForCausalLM(LlamaConfig(**MODEL)))
        optimizer = create_optimizer(model, lr=1e-5, eps=1e-5)
        config = rl.UpdateConfig(kl_coef=0.01, entropy_coef=0.001, chunk_tokens=chunk, max_tokens=ROWS * SEQ)
        step = lambda s, m=model, o=optimizer, c=config: rl.policy_update(m, o, _rollouts(s), c,  # noqa: E731
                                                                           dp_size=WORLD)
        step(0)  # warm-up: the optimizer state exists from here on
        runs[chunk] = {"step": step, "times": [],
                       "measure": lambda m=model, o=optimizer, st=step: measured_peak_bytes(m, o, lambda: st(1))}
    return time_interleaved(runs, ROUNDS, lambda run, out: run.update(last=(out["loss"], out["entropy"], out["grad_norm"])))


def main() -> None:
    runs, load_before, load_after = run_variants(_run, WORLD)
    whole = runs[0]
    tokens = WORLD * ROWS * SEQ
    rows = []
    for chunk, run in runs.items():
        peak, speed = peak_and_speed_cells(run, whole, tokens)
        name = "whole logits, log-softmax" if chunk == 0 else f"token_logprobs, {chunk}-token chunks"
        loss, entropy, norm = run["last"]
        rows.append([name, *peak, *speed, f"{loss:.6f}", f"{entropy:.5f}", f"{norm:.5f}"])
        print(rows[-1], flush=True)
    logits_mib = ROWS * SEQ * MODEL["vocab_size"] * 4 / 2**20
    body = (f"One `fullshard.rl.policy_update` (PPO clip, k3 KL against given reference log-probs, entropy "
            f"bonus, token-mean, clip, AdamW) of a Llama with a {MODEL['vocab_size']:,}-token vocabulary, hidden "
            f"size {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, {ROWS} x {SEQ} = {ROWS * SEQ:,} "
            f"tokens per rank ({SEQ - PROMPT} completion tokens a row), fp32, FSDP at world size {WORLD} on CPU "
            f"(gloo, one thread per rank): a rank's fp32 logits are {logits_mib:,.0f} MiB. Peak = FSDPMemTracker's "
            "peak of live tensor bytes on a rank (the larger of the two) over a step after a warm-up step. "
            f"tokens/s: median of {ROUNDS} steps per variant, taking turns. The last columns are the last "
            "timed step's loss, mean entropy and grad norm: equal, as they must be.\n\n"
            f"Load average (1, 5, 15 min): {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} "
            f"before, {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after, on {os.cpu_count()} "
            "cores shared with other work: the memory columns are exact, the speed ratio is noisy.\n\n")
    body += markdown_table(["log-probs", "peak MiB", "x whole", "tokens/s", "x whole", "loss", "entropy",
                            "grad norm"], rows)
    write_section("rl", body)


if __name__ == "__main__":
    main()
