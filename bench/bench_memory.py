"""The memory estimate (`fullshard plan`, `fullshard.train.memory.estimate_run`) against the measured
peak, layout by layout.

Each cell of `harness.memory_matrix.CELLS` trains a tiny Llama (or Qwen3-MoE for expert
parallelism) one step on CPU (gloo) after a warm-up step, and measures every rank's peak of live
tensor bytes with torch's FSDPMemTracker; under pp each stage's ranks apart. The estimate must never
be below the peak (the script exits non-zero if it is) and aims at no more than 10% above.

    .venv/bin/python bench/bench_memory.py          # minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harnesses (harness/)

from harness import rl_memory  # noqa: E402
from harness.memory_matrix import CELLS, LLAMA, QWEN3_MOE, SEQ, run_cells  # noqa: E402

from bench.report import markdown_table, write_section  # noqa: E402


def rl_rows() -> list[tuple[str, int, int]]:
    """(row, measured peak, estimate) of a GRPO step's phases and a reward model's step."""
    results = rl_memory.run()
    rows = [(f"GRPO ({case}) {phase}", peak,
             grpo["estimate"][phase.replace("logprobs", "log-probs")])
            for case, grpo in results["grpo"].items() for phase, peak in grpo["peak"].items()]
    rows += [(f"GRPO sampling ({name}) generation", row["peak"], row["estimate"])
             for name, row in results["sampling"].items()]
    reward = results["reward"]
    return rows + [("reward model", reward["peak"], reward["estimate"])]


def rl_description() -> str:
    m = rl_memory
    return ("The GRPO rows are one colocated step's phases, each measured apart "
            f"(`harness.rl_memory`: {m.PROMPTS * m.GROUP} completions a rank of {m.PROMPT_LEN} + "
            f"{m.NEW_TOKENS} tokens, a reference model, update micro-batches of {m.MAX_TOKENS} "
            "tokens; `fullshard.plan.rl.estimate_grpo`; fp32, and bf16 compute sampling with "
            "top-p 0.9; the sampling rows: generation of 32 rows over a 32K vocabulary, where the "
            "sampled scores are most of the peak); the reward row a one-output "
            f"sequence-classification Llama's step ({m.REWARD_ROWS} x {m.REWARD_SEQ} tokens). ")


def main() -> int:
    load = os.getloadavg()[0]
    results = run_cells()
    rows, off = [], []
    for name, stages in results.items():
        cell = CELLS[name]
        for row in stages:
            ratio = row["estimate"] / row["peak"]
            if not 1.0 <= ratio <= 1.10:
                off.append((name, row["stage"], ratio))
            where = row["label"].split(",")[0] if len(stages) > 1 else "every rank"
            rows.append([name, cell.world, where, f"{row['peak'] / 2**20:,.2f}", f"{row['estimate'] / 2**20:,.2f}",
                         f"{ratio:.3f}"])
            print(rows[-1], flush=True)
    for name, peak, estimate in rl_rows():
        ratio = estimate / peak
        if not 1.0 <= ratio <= 1.10:
            off.append((name, 0, ratio))
        mib = [f"{value / 2**20:,.2f}" for value in (peak, estimate)]
        rows.append([name, 2, "every rank", *mib, f"{ratio:.3f}"])
        print(rows[-1], flush=True)
    body = ("`fullshard plan`'s per-rank memory estimate (`fullshard.train.memory.estimate_run`) against the "
            "measured peak of live tensor bytes (torch's FSDPMemTracker over one training step after a warm-up "
            "step: forward, token-normalised loss, backward, clip, AdamW), every layout of "
            "`harness.memory_matrix` on CPU (gloo), fp32 master weights, fp32 compute unless the row "
            f"says otherwise, micro batch 2 x {SEQ} tokens (pipelines: 4 rows in 4 pipeline micro-batches), "
            f"chunked loss at its default. Llama: hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} "
            f"layers, vocabulary {LLAMA['vocab_size']}; MoE rows: Qwen3-MoE with {QWEN3_MOE['num_experts']} experts. "
            "Under pp each stage's ranks are measured apart. The two config rows build the estimate's model from "
            "a config.json as `fullshard plan` does (one stating `torch_dtype: bfloat16`, one stating none) while "
            "training keeps fp32 masters. " + rl_description()
            + "The estimate must be at least the peak (ratio >= 1) and at most 10% "
            "above; `tests/test_memory.py` asserts it. On CPU no allocator rounding applies. No GPU was lent to "
            "the session that wrote this table: the GPU column (`estimate_rank_bytes(..., device_type=\"cuda\")` "
            f"against `torch.cuda.max_memory_allocated`) is still to be measured. Load average {load:.1f} at the "
            f"start on {os.cpu_count()} cores (peaks of live tensors do not depend on it).\n\n")
    body += markdown_table(["layout", "ranks", "stage", "peak MiB", "estimate MiB", "estimate / peak"], rows)
    write_section("memory", body)
    for name, stage, ratio in off:
        print(f"estimate / peak = {ratio:.3f} outside [1.00, 1.10] for {name}, stage {stage}", file=sys.stderr)
    return 1 if any(ratio < 1.0 for _, _, ratio in off) else 0


if __name__ == "__main__":
    sys.exit(main())
