"""Throughput and per-rank memory of the three ways to spend 4 ranks on CPU: dp 4 (FSDP only),
dp 2 x tp 2 (tensor parallel inside each FSDP pair) and dp 2 x cp 2 (each sequence split in two,
FSDP over dp x cp). The same model and global batch in every layout, each layout in its own process
group (so each one's peak resident memory is its own).

    .venv/bin/python bench/bench_parallel.py      # a few minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harnesses (harness/)

from bench.bench_train import MICRO, SEQ, _batch, _model  # noqa: E402  (bench_train's model and batch)
from bench.report import markdown_table, speed_and_memory_cells, timed_run, write_section  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

GLOBAL_BATCH, WARMUP, STEPS, ROUNDS = MICRO, 2, 6, 2  # bench_train's micro batch, taken as the global one
LAYOUTS = {"dp 4": {}, "dp 2 x tp 2": {"tp_size": 2}, "dp 2 x cp 2": {"cp_size": 2}}


def _state_bytes(model, optimizer) -> int:
    """This rank's parameters, gradients and AdamW state: what sharding is meant to shrink."""
    from fullshard.tensors import local_tensor

    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def _run(config: dict) -> dict:
    import torch.distributed as dist
    from harness.compare import data_slice

    from fullshard import FSDP2Engine
    from fullshard.optim import clip_grad_norm
    from fullshard.parallel.cp import context_parallel_batch

    engine = FSDP2Engine(dict({"mixed_precision": "fp32"}, **config))
    coords, dims = engine.dims.coordinates(dist.get_rank()), engine.dims
    model = engine.prepare_model(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        batch = data_slice(_batch(i), coords["dp"], dims.dp_size)
        if dims.cp > 1:
            batch = context_parallel_batch(batch, coords["cp"], dims.cp)
        model(**batch).loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    timed = timed_run(step, WARMUP, STEPS)
    return {"tokens_per_s": STEPS * GLOBAL_BATCH * SEQ / timed["seconds"], "peak_rss_mib": timed["peak_rss_mib"],
            "state_mib": _state_bytes(model, optimizer) / 2**20}


def main() -> None:
    results: dict[str, dict] = {}
    for _ in range(ROUNDS):  # layouts interleaved, best round kept: load from other work hits all alike
        for name, config in LAYOUTS.items():
            per_rank = run_distributed(_run, 4, config)
            run = {"tokens_per_s": per_rank[0]["tokens_per_s"], "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
                   "state_mib": max(r["state_mib"] for r in per_rank)}
            print(name, run, flush=True)
            if name not in results or run["tokens_per_s"] > results[name]["tokens_per_s"]:
                results[name] = run
    base = results["dp 4"]
    rows = [[name, *speed_and_memory_cells(r, base), f"{r['state_mib']:.2f}", f"{r['state_mib'] / base['state_mib']:.2f}"]
            for name, r in results.items()]
    params = sum(p.numel() for p in _model().parameters())
    body = (f"Training step (forward, backward, global clip to 1.0, AdamW) of a {params / 1e6:.1f}M-parameter Llama, "
            f"global batch {GLOBAL_BATCH} x {SEQ} tokens, fp32, world size 4 (gloo, 1 thread per rank), {STEPS} timed "
            f"steps after {WARMUP} warm-up, the best of {ROUNDS} interleaved rounds. tokens/s counts the global batch once (tp ranks share their dp rank's "
            "tokens, cp ranks split them). Peak RSS is the process's peak resident set, max over ranks (runtime "
            "included); state is this rank's parameters + gradients + AdamW state, max over ranks. Ratios are "
            "against dp 4 in the same run. TP and CP exist for layers or sequences that do not fit one device; "
            "on this CPU they also ran faster than dp 4, whose FSDP all-gathers every layer over 4 gloo ranks "
            "(TP and CP gather over 2 and exchange activations, small at this size): a CPU/gloo result, not a "
            "prediction for GPUs. State per rank is slightly larger under TP because the embeddings and LM head "
            "stay whole over tp.\n\n")
    load = os.getloadavg()[0]
    body += (f"Load average when written: {load:.1f} on {os.cpu_count()} cores (4 ranks share them with other work), "
             "so the time ratios carry that noise; the state column is exact.\n\n")
    body += markdown_table(["layout", "tokens/s", "x dp 4", "peak RSS MiB", "x dp 4", "state MiB", "x dp 4"], rows)
    write_section("parallel", body)


if __name__ == "__main__":
    main()
