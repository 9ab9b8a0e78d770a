"""Write one benchmark's table into its own section of BENCHMARKS.md.

Each benchmark owns the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, so several
benchmarks can update the file independently; a missing section is appended.
"""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def timed_run(step, warmup: int, steps: int) -> dict:
    """Run `step(i)` for `warmup` untimed then `steps` timed steps, every rank starting and ending
    together; the seconds between the barriers and this process's peak resident set."""
    import resource

    import torch.distributed as dist

    for i in range(warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    dist.barrier()
    return {"seconds": time.perf_counter() - start,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def release_free_heap() -> None:
    """Collect garbage and hand memory freed earlier back to the OS (glibc's `malloc_trim`), so the
    next operation starts as in a fresh process: it pays its own page faults, and a method timed
    right after another does not reuse the pages the other left in the heap."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def machine_line() -> str:
    import os

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    return f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {device}, {platform.python_version()}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def speed_and_memory_cells(result: dict, base: dict) -> list[str]:
    """tokens/s and peak RSS of a training run, each with its ratio to `base`'s: the columns every
    training benchmark's table starts with."""
    return [f"{result['tokens_per_s']:,.0f}", f"{result['tokens_per_s'] / base['tokens_per_s']:.2f}",
            f"{result['peak_rss_mib']:,.0f}", f"{result['peak_rss_mib'] / base['peak_rss_mib']:.2f}"]


def write_section(name: str, body: str) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n\n_measured {machine_line()}_\n{end}"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.write_text(text)
