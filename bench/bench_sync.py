"""Weights from 2 FSDP trainer ranks to one engine process: `WeightSync.push` against the usual recipes.

Side by side in one run (CPU / gloo; the same trainer ranks, engine and sync process group for all):

- fullshard: `WeightSync.push` (buckets: the other trainer ranks' rows sent to rank 0, laid out in one of two
  kept buffers and broadcast as they lie while the next bucket is put together)
- (a) one parameter at a time: `full_tensor()`, then a broadcast to the engine (LightRFT's and TRL's way)
- (b) the whole state dict gathered first (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`),
  then sent tensor by tensor
- raw: one broadcast of a buffer of the same bytes, allocated beforehand: the transport's floor
  (no gather between the trainer ranks, no checksum, no copy into the engine's model)

The engine copies what it receives into a plain transformers model in every method but raw. Seconds run
from when the trainer ranks and the engine are all ready until the engine has acknowledged; peak memory is the largest
rise of the process's resident set (the kernel's high-water mark, reset before each method).
Each method runs 3 rounds, each round in another order; the table has the fastest round and the
largest rise, and for a push its rise against the bound 2 x bucket + the largest tensor.

Run alone: .venv/bin/python bench/bench_sync.py [--hidden 768 --layers 6 --vocab 32000 --bucket-mib 16 128]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, release_free_heap, write_section  # noqa: E402

HOST = "127.0.0.1"
MiB = 2**20
PUSH = "fullshard WeightSync.push"
METHODS = ["(a) per parameter full_tensor + broadcast", "(b) full state dict, then sent", "raw broadcast of the same bytes"]


def methods(args) -> list[str]:
    """WeightSync.push once per bucket size asked for, then the recipes it is measured against."""
    return [f"{PUSH}, {mib} MiB buckets" for mib in args.bucket_mib] + METHODS


def bucket_bytes(method: str) -> int:
    return int(method.rsplit(", ", 1)[1].split()[0]) * MiB


ROUNDS = 3


def in_turn(args, round_: int) -> list[str]:
    """The methods in the order of one round: each round starts one later, so every method takes
    its turn going first (the same order on every process)."""
    every = methods(args)
    return every[round_ % len(every):] + every[:round_ % len(every)]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRise:
    """The largest rise of this process's resident set during the block: the kernel's high-water
    mark (VmHWM), reset to the current size at the start (`/proc/self/clear_refs` = 5)."""

    def __enter__(self):
        release_free_heap()
        Path("/proc/self/clear_refs").write_text("5")
        self.base = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.rise_mib = (_status_kib("VmHWM") - self.base) / 1024


def build(args, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


def _ack(group) -> None:
    """Trainer rank 0 and the engine meet: before a method (both ready) and after it (the engine has everything)."""
    flag = torch.zeros(1)
    group.allreduce([flag]).wait()


# ------------------------------------------------------------------------------ the trainer's side


def trainer_method(method: str, model, sync, args, raw: torch.Tensor | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank0 = dist.get_rank() == 0
    if method.startswith(PUSH):
        sync.push(model, bucket_bytes=bucket_bytes(method))
        return
    if method == METHODS[0]:
        for _, tensor in model.state_dict().items():
            full = tensor.full_tensor()
            if rank0:
                _broadcast(sync.group, full)
            del full
    elif method == METHODS[1]:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank0:
            for tensor in state.values():
                _broadcast(sync.group, tensor)
        del state
    elif rank0:
        _broadcast(sync.group, raw)
    if rank0:
        _ack(sync.group)


def trainer_main(rank: int, args, ports: dict, results) -> None:
    from fullshard import FSDP2Engine, WeightSync
    from fullshard.distributed import init_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR=HOST, MASTER_PORT=str(ports["torch"]))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=600)
    model = FSDP2Engine().shard_model(build(args, seed=0))
    sync = WeightSync.trainer(HOST, ports["sync"], num_engines=1, timeout_s=600)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    raw = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else None
    measured = {m: {"seconds": float("inf"), "trainer_rise_mib": 0.0} for m in methods(args)}
    for round_ in range(ROUNDS):
        for method in in_turn(args, round_):
            with PeakRise() as peak:
                dist.barrier()
                if rank == 0:
                    _ack(sync.group)  # the engine is ready too: its own preparation is not timed
                started = time.perf_counter()
                trainer_method(method, model, sync, args, raw)
                dist.barrier()
            row = measured[method]
            row["seconds"] = min(row["seconds"], time.perf_counter() - started)
            row["trainer_rise_mib"] = max(row["trainer_rise_mib"], peak.rise_mib)
    if rank == 0:
        results.put(("trainer", measured, nbytes))


# ------------------------------------------------------------------------------ the engine's side


def engine_method(method: str, model, sync, loader, raw: torch.Tensor) -> None:
    if method.startswith(PUSH):
        sync.pull(loader)
        return
    if method == METHODS[2]:
        _broadcast(sync.group, raw)
    else:
        with torch.no_grad():
            for target in model.state_dict().values():
                received = torch.empty_like(target)
                _broadcast(sync.group, received)
                target.copy_(received)
                del received
    _ack(sync.group)


def engine_main(args, ports: dict, results) -> None:
    from fullshard import WeightSync, weight_loader

    torch.set_num_threads(1)
    model = build(args, seed=1)
    loader = weight_loader(model)
    sync = WeightSync.engine(HOST, ports["sync"], engine_rank=0, num_engines=1, timeout_s=600)
    raw = torch.empty(sum(t.numel() * t.element_size() for t in model.state_dict().values()), dtype=torch.uint8)
    measured = {m: 0.0 for m in methods(args)}
    for round_ in range(ROUNDS):
        for method in in_turn(args, round_):
            with PeakRise() as peak:
                _ack(sync.group)
                engine_method(method, model, sync, loader, raw)
            measured[method] = max(measured[method], peak.rise_mib)
    results.put(("engine", measured, None))


# ------------------------------------------------------------------------------ the run


def run(args) -> dict:
    from fullshard.distributed import find_free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    ports = {"torch": find_free_port(), "sync": find_free_port()}
    os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    processes = [context.Process(target=trainer_main, args=(r, args, ports, results)) for r in range(2)]
    processes.append(context.Process(target=engine_main, args=(args, ports, results)))
    for process in processes:
        process.start()
    found = {}
    try:
        while not {"trainer", "engine"} <= found.keys():
            if any(p.exitcode not in (None, 0) for p in processes):
                raise RuntimeError(f"a benchmark process failed: exit codes {[p.exitcode for p in processes]}")
            try:
                side, measured, nbytes = results.get(timeout=1)
                found[side] = measured
                found["bytes"] = nbytes or found.get("bytes")
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    return found


def report(found: dict, args, load: tuple[str, str]) -> str:
    trainer, engine = found["trainer"], found["engine"]
    per_param, raw = trainer[METHODS[0]], trainer[METHODS[2]]
    pushes = [m for m in methods(args) if m.startswith(PUSH)]
    fastest = min(pushes, key=lambda m: trainer[m]["seconds"])
    largest_mib = args.vocab * args.hidden * 4 / MiB
    bound = lambda m: f"{trainer[m]['trainer_rise_mib'] / (2 * bucket_bytes(m) / MiB + largest_mib):.2f}"  # noqa: E731
    rows = [[m, f"{trainer[m]['seconds']:.2f}", f"{per_param['seconds'] / trainer[m]['seconds']:.2f}",
             f"{trainer[m]['seconds'] / raw['seconds']:.2f}", f"{trainer[m]['trainer_rise_mib']:,.0f}",
             bound(m) if m in pushes else "", f"{engine[m]:,.0f}"] for m in methods(args)]
    table = markdown_table(["method", "seconds", "speed x (a)", "time x raw", "trainer rank 0 peak rise MiB",
                            "rise / (2 buckets + largest)", "engine peak rise MiB"], rows)
    ratios = "; ".join(f"{m.split(', ')[1]}: {per_param['seconds'] / trainer[m]['seconds']:.2f}x as fast as (a), "
                       f"{trainer[m]['trainer_rise_mib'] / max(per_param['trainer_rise_mib'], 1):.2f}x its trainer "
                       f"peak rise, {trainer[m]['seconds'] / raw['seconds']:.1f}x the raw broadcast's time"
                       for m in pushes)
    return (f"### Weight sync to an inference engine (CPU / gloo)\n\n"
            f"`bench/bench_sync.py`: a Llama of {found['bytes'] / 1e6:,.0f} MB (fp32; hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}, largest tensor {args.vocab * args.hidden * 4 / 1e6:.0f} MB) "
            f"sharded over 2 trainer ranks, one engine process; best of {ROUNDS} rounds (the methods taking turns "
            f"going first), largest memory rise. A push: trainer rank 1 sends its rows of each bucket to rank 0 "
            f"(straight into place), rank 0 copies its own rows beside them, in one of two bucket buffers kept "
            f"between pushes (a third for a tensor larger than a bucket), and broadcasts that buffer as it is while "
            f"the next bucket is put together; the engine checks each tensor's checksum and copies it into its "
            f"model. A push's memory rise is its first one's (buffers made, modules imported); later pushes reuse "
            f"the kept buffers. The raw broadcast moves the same bytes from buffers allocated beforehand, with no gather "
            f"between trainer ranks, no checksum and no copy into the engine's model: a floor, not a peer.\n\n"
            f"{table}\n\nWeightSync.push with {ratios}. Fastest: {fastest.split(', ')[1]}. "
            f"Load (`uptime`) before: {load[0]}; after: {load[1]}.")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    before = uptime()
    found = run(args)
    body = report(found, args, (before, uptime()))
    print(body)
    if not args.no_write:
        write_section("sync", body)


if __name__ == "__main__":
    main()
