"""Training throughput and per-rank peak memory at world size 2 on CPU: fullshard vs DDP vs
transformers' native FSDP2 (`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`),
the same model, batch and sequence length.

Speed: every peer is built in one process group and the peers take turns, a window of steps
each, round after round (the order rotating), so load that comes and goes on a shared machine hits
them alike; each round gives every peer's tokens/s relative to fullshard's in that same round, and
the table shows the median over rounds. Memory: each peer again alone in a process group of its
own, for a few steps, so each peak resident set is its own. fullshard runs with its defaults (the
chunked loss included) and once more with `loss_chunk_tokens=0`, the loss from whole logits as the
peers compute it.

    .venv/bin/python bench/bench_train.py [--rounds 16]   # ~6 minutes on 2 quiet CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)
MICRO, SEQ, WARMUP, WINDOW, MEMORY_STEPS = 8, 256, 3, 3, 4
FULLSHARD, NATIVE = "fullshard (FSDPStrategy)", "transformers native FSDP2"
PEERS = (FULLSHARD, "fullshard, loss_chunk_tokens=0", "DDP", NATIVE)
STEP_NOTE = (  # what the profile showed and what changed (docs, not measured by this script)
    "Where the step's time goes (torch.profiler on both ranks): fullshard and native FSDP2 build the same "
    "FSDP units (embedding, one per block, final norm + head kept whole, root) and run the same kernels; "
    "fullshard's own extra was three blocking all_reduces (the target-token count, the logged loss sum, one "
    "grad-norm reduction per mesh) against native's one. Now the count travels while the first forward runs, "
    "the loss sum rides in the grad norm's single all_reduce, and the input embedding is not all-gathered "
    "again for backward (its backward reads no weight): one blocking all_reduce per step, as in native's "
    "clip, and one all-gather fewer.")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def _batch(step: int) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _plain_step(model, optimizer, batch):
    """DDP's and native FSDP2's step: the model's own loss, torch's clipping, AdamW."""
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def _build(name: str, path: str):
    """One peer's model and its step function (taking the step number)."""
    if name.startswith("fullshard"):
        from fullshard import FSDPStrategy
        from fullshard.train.step import train_step

        strategy = FSDPStrategy(max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=MICRO * 2, bf16=False)
        model = strategy.prepare_model(_model(), is_training=True)
        optimizer = strategy.create_optimizer(model, lr=1e-4)
        chunk = {"loss_chunk_tokens": 0} if "loss_chunk_tokens=0" in name else {}
        return lambda step: train_step(strategy, model, optimizer, None, [_batch(step)], **chunk)
    if name == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(_model())
    else:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda step: _plain_step(model, optimizer, _batch(step))


def _speed(path: str, rounds: int) -> dict:
    """Every peer's window in every round: tokens/s (wall clock; windows start and end at a barrier)
    and this rank's CPU seconds per step (its threads' time, not the time it waits for the cores)."""
    steps = {name: _build(name, path) for name in PEERS}
    for step in range(WARMUP):
        for run in steps.values():
            run(step)
    speeds: dict[str, list[float]] = {name: [] for name in PEERS}
    cpu: dict[str, list[float]] = {name: [] for name in PEERS}
    loads = []
    tokens = WINDOW * MICRO * SEQ * torch.distributed.get_world_size()
    for round_ in range(rounds):
        loads.append(os.getloadavg()[0])
        order = PEERS[round_ % len(PEERS):] + PEERS[:round_ % len(PEERS)]
        for name in order:
            torch.distributed.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for step in range(WINDOW):
                steps[name](WARMUP + round_ * WINDOW + step)
            cpu[name].append((time.process_time() - cpu_start) / WINDOW)
            torch.distributed.barrier()
            speeds[name].append(tokens / (time.perf_counter() - start))
    return {"speeds": speeds, "cpu": cpu, "loads": loads}


def _memory(name: str, path: str) -> float:
    """Peak resident set (MiB) of this rank running the peer alone for a few steps."""
    run = _build(name, path)
    for step in range(MEMORY_STEPS):
        run(step)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16, help="rounds in which every peer runs one window")
    rounds = parser.parse_args().rounds
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        _model().save_pretrained(tmp)
        per_rank = run_distributed(_speed, 2, tmp, rounds)
        timed = per_rank[0]
        memory = {name: max(run_distributed(_memory, 2, name, tmp)) for name in PEERS}
    load_after = os.getloadavg()
    speeds = timed["speeds"]
    cpu = {name: [sum(r["cpu"][name][i] for r in per_rank) for i in range(rounds)] for name in PEERS}  # both ranks
    rows = []
    for name in PEERS:
        ratios = [peer / own for peer, own in zip(speeds[name], speeds[FULLSHARD])]
        cpu_ratios = [peer / own for peer, own in zip(cpu[name], cpu[FULLSHARD])]
        rows.append([name, f"{statistics.median(speeds[name]):,.0f}", f"{statistics.median(ratios):.2f}",
                     f"{min(ratios):.2f} .. {max(ratios):.2f}", f"{statistics.median(cpu[name]):.3f}",
                     f"{statistics.median(cpu_ratios):.3f}", f"{memory[name]:,.0f}",
                     f"{memory[name] / memory[FULLSHARD]:.2f}"])
        print(rows[-1], flush=True)
    native = [own / peer for own, peer in zip(speeds[FULLSHARD], speeds[NATIVE])]
    native_cpu = [peer / own for own, peer in zip(cpu[FULLSHARD], cpu[NATIVE])]
    params = sum(p.numel() for p in _model().parameters())
    loaded = max(timed["loads"] + [load_before[0]]) > 2
    body = (f"Training step (forward, backward, clip to 1.0, AdamW) of a {params / 1e6:.1f}M-parameter Llama, micro "
            f"batch {MICRO} x {SEQ} tokens per rank, fp32, world size 2 (gloo, 1 thread per rank). Speed: all peers "
            f"in one process group, taking turns (the order rotating) in {rounds} rounds of a {WINDOW}-step window "
            f"each, after {WARMUP} warm-up steps each; 'x fullshard' is the median over rounds of the peer's tokens/s "
            "over fullshard's in the same round, the range beside it the lowest and highest round. CPU s / step: the "
            "CPU time both ranks' processes spent per step (all their threads), median over rounds, with the median "
            "same-round ratio to fullshard's: the work a step costs, which a loaded machine slows but does not "
            "change, where tokens/s also counts the time a rank waits for a core. Peak memory: each "
            f"peer alone in its own process group for {MEMORY_STEPS} steps, the process's peak resident set (CPU: "
            "parameters, gradients, optimizer state, activations and the Python/torch runtime together), max over "
            "ranks. fullshard runs its defaults (the loss in chunks of 1,024 tokens: two here) and with the loss from "
            "whole logits. accelerate does not apply FSDP on CPU, so it is measured only where a GPU is lent "
            "(`bench/gpu.py`).\n\n")
    body += STEP_NOTE + "\n\n"
    body += ("**fullshard / native FSDP2 tokens/s, round by round: " + ", ".join(f"{r:.2f}" for r in native)
             + f"; median {statistics.median(native):.2f}. Native FSDP2's CPU time per step / fullshard's: median "
             f"{statistics.median(native_cpu):.3f}.**\n\n")
    body += ("Load average (1 min) at the start of each round: " + ", ".join(f"{x:.1f}" for x in timed["loads"])
             + f"; {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} (1 / 5 / 15 min) before the "
             f"run, {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after, on {os.cpu_count()} cores")
    body += (" shared with other work: above about 2 the ranks queue for the cores and single windows swing by 20% "
             "or more either way, so only the medians of same-round ratios mean much, and a quiet machine is the "
             "place to confirm them (`bench/bench_train.py` rewrites this section).\n\n" if loaded else ".\n\n")
    body += markdown_table(["peer", "tokens/s (median window)", "x fullshard (median round)", "rounds' range",
                            "CPU s / step", "x fullshard", "peak RSS MiB", "x fullshard"], rows)
    write_section("train", body)


if __name__ == "__main__":
    main()
