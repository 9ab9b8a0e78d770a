"""Checkpoint save / load and HF export, next to their limits and their usual peers.

Save and load: fullshard's `CheckpointManager` (DCP shards + atomic commit) versus every rank
writing (write + fsync) and reading back the very bytes of its own shard file with plain file
I/O, concurrently, on the same disk: the floor any format can reach. Export: `export_hf`
(round-robin files, one tensor gathered at a time) versus the common recipe, a full state dict
gathered to rank 0 with `get_model_state_dict(full_state_dict=True, cpu_offload=True)` and then
`save_pretrained` there. Peak memory is the largest rise of a rank's resident set during the
operation, sampled every 2 ms.

Run: .venv/bin/python bench/bench_checkpoint.py [--hidden 1024 --layers 6 --vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.report import markdown_table, release_free_heap, write_section  # noqa: E402

MiB = 2**20


class PeakRss:
    """The largest rise of this process's resident set while the block runs."""

    def __enter__(self):
        self.process = psutil.Process()
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.rise = self.peak - self.base


def _timed(fn):
    release_free_heap()
    dist.barrier()
    start = time.perf_counter()
    with PeakRss() as rss:
        fn()
        dist.barrier()
    return time.perf_counter() - start, rss.rise


def _build(hidden: int, layers: int, vocab: int):
    """A Llama sharded on meta, materialised shard by shard: no rank ever holds the full model."""
    import transformers

    from fullshard import FSDP2Engine

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(model)
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _optimizer_step(model, optimizer)  # AdamW state exists and is not zero
    return model, optimizer


def _optimizer_step(model, optimizer) -> None:
    """A step with small random grads: what precedes every save in training. It also leaves the
    state recently touched, as training does (on this VM, state left untouched for seconds is
    read up to 2x slower, which would charge the save for the benchmark's idleness)."""
    for param in model.parameters():
        param.grad = torch.distributed.tensor.DTensor.from_local(
            torch.randn_like(param.to_local()) * 1e-3, param.device_mesh, param.placements,
            shape=param.shape, stride=param.stride())
    optimizer.step()
    optimizer.zero_grad()


class PlainFiles:
    """The floor: the same bytes written (then fsynced) and read back with plain file I/O, with a
    checkpoint's file lifecycle. Each write goes to a new file and the previous one is deleted in
    the background once the new one is durable, as a replaced or rotated checkpoint is. (On this
    VM's ext4, mounted with online discard, overwriting a file in place frees its blocks at the
    truncation and slows whatever writes next by up to 3x, so an in-place plain write charged the
    operation after it, not itself.)"""

    def __init__(self, root: Path, name: str, nbytes: int) -> None:
        self.root, self.name, self.nbytes, self.count = root, name, nbytes, 0
        self.payload = os.urandom(min(nbytes, 64 * MiB))

    def path(self, count: int) -> Path:
        return self.root / f"{self.name}_{count}.bin"

    def write(self) -> None:
        self.count += 1
        with open(self.path(self.count), "wb") as handle:
            left = self.nbytes
            while left > 0:
                chunk = self.payload[:min(left, len(self.payload))]
                handle.write(chunk)
                left -= len(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        threading.Thread(target=self.path(self.count - 1).unlink, kwargs={"missing_ok": True}).start()

    def read(self) -> None:
        with open(self.path(self.count), "rb") as handle:
            while handle.read(64 * MiB):
                pass


def _side_by_side(runs: dict, repeat: int, operations: dict) -> None:
    """Time `operations` one after the other, the order reversing every repeat, so none always
    follows another (the disk still works off what the one before wrote)."""
    names = list(operations) if repeat % 2 == 0 else list(operations)[::-1]
    for name in names:
        seconds, rise = _timed(operations[name])
        runs.setdefault(f"{name}_s", []).append(seconds)
        runs.setdefault(f"{name}_rss", []).append(rise)


def measure(root: str, hidden: int, layers: int, vocab: int, repeats: int, shard_size: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fullshard.checkpoint import CheckpointManager, export_checkpoint, export_hf

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root) / f"world{world}"
    model, optimizer = _build(hidden, layers, vocab)
    params = sum(p.numel() for p in model.parameters())
    manager = CheckpointManager(root / "ckpt", max_num=1)
    background = CheckpointManager(root / "async", max_num=1, async_save=True)
    manager.save(1, model, optimizer)  # a checkpoint to replace, as the plain files have a file to replace
    own_bytes = sum(f.stat().st_size for f in (manager.latest() / "state").glob(f"__{rank}_*.distcp"))
    plain = PlainFiles(root, f"plain_{rank}", own_bytes)
    plain.write()
    out = {"params": params}
    runs: dict[str, list[float]] = {}
    for repeat in range(repeats):
        _optimizer_step(model, optimizer)  # each save follows a step, as in training
        _side_by_side(runs, repeat, {"save": lambda: manager.save(1, model, optimizer), "plain_write": plain.write})
        _optimizer_step(model, optimizer)
        _side_by_side(runs, repeat, {"load": lambda: manager.load(model, optimizer), "plain_read": plain.read})
        # an async save holds training until `save` returns; the copy to host memory then runs in
        # the background, and an optimizer step that came at once would wait for the rest of it
        _optimizer_step(model, optimizer)
        runs.setdefault("async_block_s", []).append(_timed(lambda: background.save(1, model, optimizer))[0])
        runs.setdefault("async_copy_left_s", []).append(_timed(background.wait_for_staging)[0])
        background.wait()
    checkpoint = manager.latest()
    out["ckpt_bytes"] = sum(f.stat().st_size for f in (checkpoint / "state").glob("*.distcp"))

    export_hf(model, root / "export", max_shard_size=shard_size)  # the files a timed export replaces
    exported = sorted((root / "export").glob("*.safetensors"))
    # the floor for the export: each rank writes as many bytes as it writes into the files (its own
    # rows of every tensor), all at once
    plain_export = PlainFiles(root, f"plain_export_{rank}", sum(p.to_local().nbytes for p in model.parameters()))
    plain_export.write()

    def gather_and_save_pretrained():
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(root / "save_pretrained", state_dict=full, max_shard_size=shard_size)
        del full

    for repeat in range(repeats):
        _side_by_side(runs, repeat, {"export": lambda: export_hf(model, root / "export", max_shard_size=shard_size),
                                     "plain_export": plain_export.write, "peer_export": gather_and_save_pretrained})
    out.update({key: statistics.median(values) for key, values in runs.items()})
    out["offline_s"], out["offline_rss"] = _timed(
        lambda: rank == 0 and export_checkpoint(checkpoint, root / "offline", max_shard_size=shard_size))
    out["export_bytes"] = sum(f.stat().st_size for f in (root / "export").glob("*.safetensors"))
    out["export_files"] = len(exported)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    from fullshard.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=4, help="runs of each side, the order swapping every run; the median is reported")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shard-size", default="100MB", help="export file size")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="fullshard-bench-ckpt-", dir=args.dir)
    rows_io, rows_export = [], []
    load_before = os.getloadavg()
    try:
        for world in args.worlds:
            results = run_distributed(measure, world, root, args.hidden, args.layers, args.vocab, args.repeats,
                                      args.shard_size, timeout=1800)
            r0 = results[0]
            slowest = {k: max(r[k] for r in results) for k in r0}
            gib = r0["ckpt_bytes"] / 2**30
            print(f"world {world}: {r0['params'] / 1e6:.0f}M params, checkpoint {gib:.2f} GiB, {slowest}", flush=True)
            rows_io.append([world, f"{gib:.2f}", f"{slowest['save_s']:.2f}", f"{slowest['plain_write_s']:.2f}",
                            f"{slowest['save_s'] / slowest['plain_write_s']:.2f}", f"{slowest['async_block_s']:.2f}",
                            f"{slowest['async_block_s'] / slowest['save_s']:.2f}",
                            f"{slowest['async_block_s'] + slowest['async_copy_left_s']:.2f}",
                            f"{(slowest['async_block_s'] + slowest['async_copy_left_s']) / slowest['save_s']:.2f}",
                            f"{slowest['load_s']:.2f}",
                            f"{slowest['plain_read_s']:.2f}", f"{slowest['load_s'] / slowest['plain_read_s']:.2f}"])
            rows_export.append([world, f"{r0['export_bytes'] / 2**30:.2f}", f"{slowest['export_s']:.2f}",
                                f"{slowest['plain_export_s']:.2f}", f"{slowest['export_s'] / slowest['plain_export_s']:.2f}",
                                f"{slowest['peer_export_s']:.2f}", f"{slowest['export_s'] / slowest['peer_export_s']:.2f}",
                                f"{slowest['export_rss'] / MiB:,.0f}", f"{slowest['peer_export_rss'] / MiB:,.0f}",
                                f"{slowest['export_rss'] / max(slowest['peer_export_rss'], 1):.2f}",
                                f"{r0['offline_s']:.2f}", f"{r0['offline_rss'] / MiB:,.0f}"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    body = (
        f"Llama, {r0['params'] / 1e6:.0f}M parameters, fp32 weights + AdamW state (checkpoint = the DCP shard bytes), "
        f"gloo on CPU, one thread per rank. Times are the slowest rank's, from a barrier to a barrier, median of {args.repeats} "
        "runs in which fullshard and its peer take turns going first. "
        "Plain I/O: every rank writes (then fsyncs) and reads back exactly the bytes of its own shard file, all at "
        "once, on the same disk, with a checkpoint's file lifecycle (each write to a new file, the previous one "
        "deleted in the background once the new one is durable): the floor. Reads hit a warm page cache for both. "
        "Ratios are fullshard / peer, measured in the same run. The machine's 2 cores are shared with other jobs: load average "
        f"{load_before[0]:.1f} (1 min) / {load_before[1]:.1f} (5 min) before the run, {load_after[0]:.1f} / "
        f"{load_after[1]:.1f} after, so absolute times are noisy and only the side-by-side ratios mean much. "
        "A save's time is the DCP shard write (tensor serialisation and the bytes), one fsync per file, and rank 0's "
        "commit (side files fsynced, marker, rename; the replaced or rotated checkpoint is renamed away and deleted "
        "in the background). A load reads each whole stored chunk straight into its tensor (one copy), every rank "
        "planning its own reads. Each save and load follows an optimizer step, as in training. This VM's disk (ext4 "
        "mounted with online discard) gives the same write 1.1 to 5 s from one run to the next, and a write is slowed "
        "by up to 3x by the blocks the operation before it freed (an earlier version of this table overwrote the "
        "plain file in place, which charged that to the save that came next: save / plain write 1.6 to 2.9 there); "
        "save plans are cached across saves and the zip CRC32 that torch.load never checks is not computed. "
        "'async save blocks': how long `save` with `async_save=True` holds the training loop; the copy of the "
        "state to host memory (into buffers kept from the previous async save) then runs in a background thread "
        "while the next forward and backward run, and the optimizer's next `step()` waits for it. '+ host copy': "
        "save plus the rest of that copy, which is what a training loop whose next optimizer step came at once "
        "would wait in all. The write to disk runs in the background after the copy.\n\n"
        + markdown_table(["world", "GiB", "save s", "plain write s", "x plain", "async save blocks s", "x sync save",
                          "+ host copy s", "x sync save", "load s", "plain read s", "x plain"], rows_io)
        + f"\n\nExport to an HF directory (fp32 safetensors, {args.shard_size} files, {r0['export_files']} of them; "
        "every file is created at its final size, then every rank writes its own rows of each tensor into place, "
        "all at once, with no gather). Peer: full state dict gathered to rank 0 "
        "(`get_model_state_dict(full_state_dict=True, cpu_offload=True)`) then `save_pretrained` on rank 0. Plain "
        "write: each rank writes (and fsyncs) as many bytes as it wrote into the files (its shard), all at once, "
        "with the lifecycle above. Median of the same number of runs, the three taking turns going first. Peak "
        "memory: the largest rise of a rank's resident set during the export, max over ranks (export_hf's is "
        "about 0 here: the written dtype is the parameters' own, so each rank writes its rows straight from "
        "their memory; a cast, e.g. to bf16, holds at most two cast shards). Offline: "
        "`export_checkpoint` of the same checkpoint in one process with no process group (`fullshard export`), one run.\n\n"
        + markdown_table(["world", "GiB written", "export_hf s", "plain write s", "x plain", "gather + save_pretrained s",
                          "x peer",
                          "export_hf peak MiB", "peer peak MiB", "x peer", "offline export s", "offline peak MiB"],
                         rows_export)
    )
    write_section("checkpoint", body)
    print(body)


if __name__ == "__main__":
    main()
