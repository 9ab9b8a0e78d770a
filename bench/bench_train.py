"""Training throughput and per-rank peak memory at world size 2 on CPU: fullshard vs DDP vs
transformers' native FSDP2 (`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`),
the same model, batch and sequence length, each peer a plain loop in its own process group (so
each one's peak resident memory is its own).

    .venv/bin/python bench/bench_train.py          # ~3 minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, speed_and_memory_cells, write_section  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)
MICRO, SEQ, WARMUP, STEPS = 8, 256, 3, 12


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def _batch(step: int) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _timed_loop(model, optimizer, step_fn) -> dict:
    for step in range(WARMUP):
        step_fn(model, optimizer, _batch(step))
    torch.distributed.barrier()
    start = time.perf_counter()
    for step in range(STEPS):
        step_fn(model, optimizer, _batch(step))
    torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": STEPS * MICRO * SEQ * torch.distributed.get_world_size() / elapsed,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _plain_step(model, optimizer, batch):
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def _run_fullshard():
    from fullshard import FSDPStrategy
    from fullshard.train.step import train_step

    strategy = FSDPStrategy(max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=MICRO * 2, bf16=False)
    model = strategy.prepare_model(_model(), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    return _timed_loop(model, optimizer, lambda m, o, b: train_step(strategy, m, o, None, [b]))


def _run_ddp():
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    return _timed_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4), _plain_step)


def _run_transformers(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
    model.train()

    def step(m, o, b):
        m(**b).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        o.zero_grad()
        return norm

    return _timed_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4), step)


def main() -> None:
    rounds = 3
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        _model().save_pretrained(tmp)
        peers = {"fullshard (FSDPStrategy)": (_run_fullshard, ()), "DDP": (_run_ddp, ()),
                 "transformers native FSDP2": (_run_transformers, (tmp,))}
        for round_ in range(rounds):  # interleaved, so load that comes and goes hits every peer alike
            for name, (fn, args) in peers.items():
                try:
                    per_rank = run_distributed(fn, 2, *args)
                    runs.setdefault(name, []).append({"tokens_per_s": per_rank[0]["tokens_per_s"],
                                                      "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank)})
                except Exception as err:  # a peer that cannot run here is reported, not fatal
                    runs.setdefault(name, []).append({"error": str(err).splitlines()[-1][:120]})
                print(round_, name, runs[name][-1], flush=True)
    results = {name: _median_run(r) for name, r in runs.items()}
    base = results["fullshard (FSDPStrategy)"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "failed", "", "", "", r["error"]])
            continue
        runs_note = f"tokens/s of the {rounds} runs: " + ", ".join(f"{t:,.0f}" for t in r["all"])
        rows.append([name, *speed_and_memory_cells(r, base), runs_note])
    params = sum(p.numel() for p in _model().parameters())
    body = (f"Training step (forward, backward, clip to 1.0, AdamW) of a {params / 1e6:.1f}M-parameter Llama, micro batch "
            f"{MICRO} x {SEQ} tokens per rank, fp32, world size 2 (gloo, 1 thread per rank), {STEPS} timed steps after "
            f"{WARMUP} warm-up, median of {rounds} runs in which the peers take turns. Peak memory is the process's peak resident set (CPU: parameters, gradients, optimizer "
            "state, activations and the Python/torch runtime together), max over ranks. Ratios are against fullshard "
            "in the same run; accelerate does not apply FSDP on CPU, so it is measured only where a GPU is lent "
            "(`bench/gpu.py`).\n\n")
    body += (f"Load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores.\n\n")
    body += markdown_table(["peer", "tokens/s", "x fullshard", "peak RSS MiB", "x fullshard", "note"], rows)
    write_section("train", body)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its own peak memory with it)."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return runs[-1]
    ordered = sorted(done, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "all": [r["tokens_per_s"] for r in done]}


if __name__ == "__main__":
    main()
