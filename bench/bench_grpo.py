"""A whole GRPO step of `fullshard train --train.objective=grpo`, split into its phases
(generation, log-probs, update, weight sync), with rollouts on the trainer ranks (`colocated`)
and in one engine process (`engines`, the place vLLM or SGLang takes in a deployment), side by
side in one run.

Both run the built-in toy (the digits task on the built-in tiny model, 2 CPU ranks, the default
`rl` section) for the same steps; the phases' seconds are the command's own metrics
(`generation_s`, `logprobs_s`, `update_s`, `sync_s`, `step_s` in `metrics.jsonl`), the median
over the steps after the first two (start-up). The last column is the mean reward of the last 5
steps, so a faster variant that learns less would show.

    .venv/bin/python bench/bench_grpo.py       # about 3 minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402

STEPS = 30
PHASES = ("generation_s", "logprobs_s", "update_s", "sync_s")
VARIANTS = {"colocated": [], "engines (1 process)": ["--rl.rollout=engines", "--rl.num_engines=1"]}


def run(name: str, extra: list[str], root: Path) -> dict:
    """One launch of the command; each phase's median seconds over the steps after the first two."""
    out = root / name.split()[0]
    command = [sys.executable, "-m", "fullshard.cli", "train", "--train.objective=grpo", "--nproc", "2",
               f"--train.steps={STEPS}", "--train.log_every=1",
               f"--train.output_dir={out}", *extra]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("kind") == "train"]
    timed = steps[2:]
    result = {key: statistics.median(row.get(key, 0.0) for row in timed) for key in (*PHASES, "step_s")}
    result["reward"] = statistics.mean(row["reward"] for row in steps[-5:])
    return result


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, extra, Path(tmp)) for name, extra in VARIANTS.items()}
    load_after = os.getloadavg()[0]
    base = results["colocated"]["step_s"]
    rows = []
    for name, r in results.items():
        shares = [f"{r[p]:.3f} ({r[p] / r['step_s']:.0%})" for p in PHASES]
        rows.append([name, f"{r['step_s']:.3f}", f"{r['step_s'] / base:.2f}", *shares, f"{r['reward']:.2f}"])
        print(rows[-1], flush=True)
    body = (f"A whole GRPO step of `fullshard train --train.objective=grpo` on the built-in toy (the tiny model, "
            f"2 CPU ranks, the default `rl` section: 8 completions per prompt, 16 new tokens), {STEPS} steps per "
            "variant; seconds are the median over the steps after the first two, each phase with its share of "
            "the step (the rest is scoring, advantages and bookkeeping; log-probs take 0 s with the default "
            "`rl.epochs=1` and `kl_coef=0`: no old or reference log-probs are needed). Colocated rollouts generate on the "
            "trainer ranks; `engines` samples in a separate process holding a plain transformers model, fed the "
            "weights through `WeightSync` after every update (`sync`). The reward column is the mean of the "
            "last 5 steps; both variants sample the same completions (each from its own stream, "
            "`rl.sampling`), so it is the same in both. "
            f"Load average {load_before:.2f} before, {load_after:.2f} after.\n\n")
    header = ["rollouts", "step s", "x colocated", "generation s", "log-probs s", "update s", "sync s",
              "reward (last 5)"]
    write_section("grpo-step", body + markdown_table(header, rows))


if __name__ == "__main__":
    main()
