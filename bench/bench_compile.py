"""Compiled blocks and explicit prefetch against eager fullshard, on CPU at world size 2.

Every variant is bench_train's Llama, batch and step (forward, backward, clip to 1.0, AdamW),
sharded by `FSDP2Engine` (fp32, auto plan), all in one process group. Each variant gets a
warm-up (which includes compiling), then timed windows interleaved across variants, so load from
other work on the machine falls on all of them alike; the table reports the median window and the best one (the least disturbed by that load).

    .venv/bin/python bench/bench_compile.py        # ~5 minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_train import MICRO, SEQ, _batch, _model, _plain_step  # noqa: E402  (bench_train's model and step)
from bench.report import markdown_table, write_section  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

WARMUP, STEPS, WINDOWS = 3, 3, 9
VARIANTS = {
    "eager": dict(compile=False),
    "eager + prefetch 1": dict(compile=False, prefetch=1),
    "eager + prefetch 2": dict(compile=False, prefetch=2),
    "compiled": dict(compile=True),
    "compiled + prefetch 1": dict(compile=True, prefetch=1),
    "compiled + activation checkpointing": dict(compile=True, activation_checkpointing=True),
    "eager + activation checkpointing": dict(compile=False, activation_checkpointing=True),
}
NOTE = ("On CPU with gloo the all-gathers run in the compute thread's turn (no side stream), so prefetch can only "
        "reorder them, not overlap them; the windows spread by up to 2x with the machine's load, so ratios within "
        "about 0.15 of 1.0 are noise here; the best window is the steadier figure.")


def _step(model, optimizer, step: int) -> None:
    _plain_step(model, optimizer, _batch(step))


def _build(settings: dict):
    from fullshard import FSDP2Engine
    from fullshard.compile import set_block_prefetch

    settings = dict(settings)
    prefetch = settings.pop("prefetch", 0)
    model = FSDP2Engine({"mixed_precision": "fp32", **settings}).prepare_model(_model())
    if prefetch:
        set_block_prefetch(model, depth=prefetch)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _run_all() -> dict:
    torch.set_num_threads(1)
    runs, seconds, warmup = {}, {name: [] for name in VARIANTS}, {}
    for name, settings in VARIANTS.items():
        runs[name] = _build(settings)
        start = time.perf_counter()
        for step in range(WARMUP):
            _step(*runs[name], step)
        warmup[name] = time.perf_counter() - start
    names = list(runs)
    for window in range(WINDOWS):
        for name in names[window % len(names):] + names[:window % len(names)]:  # rotated: no variant always first
            model, optimizer = runs[name]
            torch.distributed.barrier()
            start = time.perf_counter()
            for step in range(STEPS):
                _step(model, optimizer, step)
            torch.distributed.barrier()
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": seconds, "warmup": warmup}


def main() -> None:
    load_before = os.getloadavg()[0]
    result = run_distributed(_run_all, 2, timeout=1800)[0]
    tokens = STEPS * MICRO * SEQ * 2
    base = statistics.median(result["seconds"]["eager"])
    best_base = min(result["seconds"]["eager"])
    rows = []
    for name in VARIANTS:
        windows = result["seconds"][name]
        median = statistics.median(windows)
        rows.append([name, f"{tokens / median:,.0f}", f"{base / median:.2f}", f"{tokens / min(windows):,.0f}",
                     f"{best_base / min(windows):.2f}", f"{result['warmup'][name]:.1f}"])
        print(rows[-1], flush=True)
    params = sum(p.numel() for p in _model().parameters())
    body = (f"Compiled blocks (`EngineConfig(compile=True)`: each block `torch.compile`d in place before sharding) and "
            f"explicit prefetch (`fullshard.compile.set_block_prefetch`) against eager fullshard: a "
            f"{params / 1e6:.1f}M-parameter Llama, micro batch {MICRO} x {SEQ} tokens per rank, fp32, world size 2 "
            f"(gloo, 1 thread per rank, inductor C++ backend), forward + backward + clip + AdamW. Median of "
            f"{WINDOWS} windows of {STEPS} steps, windows interleaved across variants in one process group; warm-up is "
            f"the first {WARMUP} steps (compiling included).\n\n")
    body += (f"Load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores "
             "shared with other work. " + NOTE + "\n\n")
    header = ["variant", "tokens/s (median)", "x eager", "tokens/s (best window)", "x eager", "warm-up s"]
    body += markdown_table(header, rows)
    write_section("compile", body)


if __name__ == "__main__":
    main()
