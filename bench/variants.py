"""Timing several variants of one step side by side in one process group, for the benchmarks that
compare a setting's values (bench_loss: loss chunk sizes; bench_rl: log-prob chunk sizes;
bench_preference: reference strategies against TRL).

Each variant is a dict with `step(seed) -> out` and `measure() -> peak bytes`. The rounds are
interleaved (each round times one step of every variant), so a change in the machine's load falls
on all of them alike; the peak is measured last, since the memory tracker leaves its hooks on the
model.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(runs: dict, rounds: int, keep: Callable[[dict, object], None]) -> dict:
    """Time `rounds` steps of every run in `runs` (seeds 2, 3, ...), `keep(run, out)` recording what
    a step returned; then each run's peak. Returns the runs without their callables."""
    for round_ in range(rounds):
        for run in runs.values():
            torch.distributed.barrier()
            start = time.perf_counter()
            out = run["step"](2 + round_)
            torch.distributed.barrier()
            run["times"].append(time.perf_counter() - start)
            keep(run, out)
    for run in runs.values():
        run["peak"] = run["measure"]()
    return {name: {k: v for k, v in run.items() if k not in ("step", "measure")} for name, run in runs.items()}


def run_variants(body: Callable[[], dict], world: int) -> tuple[dict, tuple, tuple]:
    """`body` (which returns `time_interleaved`'s runs) on `world` ranks: rank 0's runs, each with the
    largest peak any rank measured and its tokens/s (`speed(tokens)`), and the load before and after."""
    from fullshard.testing import run_distributed

    load_before = os.getloadavg()
    per_rank = run_distributed(body, world)
    load_after = os.getloadavg()
    runs = per_rank[0]
    for name, run in runs.items():
        run["peak"] = max(r[name]["peak"] for r in per_rank)
        run["speed"] = lambda tokens, times=run["times"]: tokens / statistics.median(times)
    return runs, load_before, load_after


def peak_and_speed_cells(run: dict, base: dict, tokens: int, base_tokens: int | None = None) -> tuple[list, list]:
    """A variant's peak (MiB) and tokens/s, each with its ratio to `base`'s: the two pairs of cells
    every variant table holds (`base_tokens`: the base's token count, when its world differs)."""
    speed, base_speed = run["speed"](tokens), base["speed"](tokens if base_tokens is None else base_tokens)
    return ([f"{run['peak'] / 2**20:,.0f}", f"{run['peak'] / base['peak']:.2f}"],
            [f"{speed:,.0f}", f"{speed / base_speed:.2f}"])
