"""Per-rank memory and wall time to load a checkpoint into FSDP2 shards, three ways, in one run.

- fullshard: meta model, `fully_shard`, each rank reads its own slices (`fullshard.from_pretrained`);
- transformers: `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))`;
- naive: full `from_pretrained` on every rank, then `fully_shard` (the path most scripts take).

Memory is the peak of the rank's anonymous memory (`Anonymous:` in /proc/self/smaps_rollup,
sampled every 25 ms) above what it held before loading: tensors the process allocated, not the
page cache that a memory-mapped checkpoint shows in RSS. It is measured in a run separate from
the timed one, because reading smaps_rollup takes the mmap lock and slows the page faults of
whichever method faults most. The aim is at most checkpoint/N plus the
largest tensor. Run: `.venv/bin/python bench/bench_loading.py` (about 8 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402

MB = 1024 * 1024
# a llama of about 218M parameters: 870 MB in fp32, 435 MB in bf16
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=10,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
              tie_word_embeddings=False)


def anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """The highest anonymous memory seen while the block runs."""

    def __init__(self, interval: float = 0.025) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.baseline = anonymous_bytes()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_bytes())

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


def _load(method: str, path: str, dtype: torch.dtype):
    import transformers

    import fullshard
    from fullshard import FSDP2Engine

    if method == "fullshard":
        return fullshard.from_pretrained(path, engine=FSDP2Engine(), dtype=dtype)
    if method == "transformers":
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=torch.distributed.get_world_size())
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return FSDP2Engine().prepare_model(model)


def _measure(method: str, path: str, dtype_name: str, warmup_path: str, sample: bool) -> dict:
    """One rank, one load: wall time (slowest rank decides), or with `sample` the peak anonymous
    memory above baseline. Sampling smaps_rollup takes the mmap lock and slows page faults, so
    time and memory come from separate runs.

    A tiny checkpoint of the same architecture is loaded first the same way, so one-off costs
    (lazy imports, the process group's first collectives) count for no method.
    """
    import torch.distributed as dist

    import transformers  # noqa: F401 - imported before the baseline so its own memory is not counted

    import fullshard  # noqa: F401

    dtype = getattr(torch, dtype_name)
    del_model = _load(method, warmup_path, dtype)
    del del_model
    gc.collect()
    dist.barrier()
    sampler = PeakSampler() if sample else contextlib.nullcontext()
    with sampler:
        start = time.perf_counter()
        model = _load(method, path, dtype)
        dist.barrier()
        seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in model.parameters())
    report = getattr(model, "fullshard_load_report", None)
    return {"seconds": seconds, "peak": sampler.delta if sample else None, "local_param_bytes": local,
            "bytes_read": report.bytes_read if report is not None else None}


def write_checkpoints(root: Path) -> dict[str, str]:
    import transformers

    tiny = dict(CONFIG, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny)).save_pretrained(root / "warmup")
    paths = {"warmup": str(root / "warmup")}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(dtype)
        model.save_pretrained(root / name)
        paths[name] = str(root / name)
        del model
        gc.collect()
    return paths


def warm_page_cache(path: str) -> None:
    """Every method starts with the files in the page cache, as the first one would otherwise pay for all."""
    for file in Path(path).glob("*.safetensors"):
        with open(file, "rb") as f:
            while f.read(64 * MB):
                pass


def checkpoint_stats(path: str) -> tuple[int, int]:
    """(total tensor bytes, largest tensor bytes) of a safetensors checkpoint."""
    from safetensors import safe_open

    total = largest = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                size = torch.Size(view.get_shape()).numel() * (2 if view.get_dtype() in ("BF16", "F16") else 4)
                total, largest = total + size, max(largest, size)
    return total, largest


def main() -> None:
    from fullshard.testing import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--no-write", action="store_true", help="print the table without touching BENCHMARKS.md")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = Path(tempfile.mkdtemp(prefix="bench_loading_"))
    try:
        paths = write_checkpoints(root)
        rows = []
        for world in [int(w) for w in args.world_sizes.split(",")]:
            for ckpt, target in (("fp32", "float32"), ("bf16", "float32")):
                total, largest = checkpoint_stats(paths[ckpt])
                aim = total // world + largest
                results = {}
                warm_page_cache(paths[ckpt])
                for method in ("fullshard", "transformers", "naive"):
                    try:
                        args_ = (method, paths[ckpt], target, paths["warmup"])
                        timed = run_distributed(_measure, world, *args_, False, timeout=300)
                        per_rank = run_distributed(_measure, world, *args_, True, timeout=300)
                        results[method] = (max(r["seconds"] for r in timed), max(r["peak"] for r in per_rank),
                                           per_rank)
                    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
                        results[method] = None
                        print(f"{method} failed at world {world} ({ckpt}): {str(exc)[-400:]}", flush=True)
                        traceback.print_exc()
                ours = results["fullshard"]
                for method, value in results.items():
                    if value is None:
                        rows.append([world, f"{ckpt}->fp32", method, "failed", "", "", "", "", ""])
                        continue
                    seconds, peak, per_rank = value
                    rows.append([
                        world, f"{ckpt}->fp32", method, f"{seconds:.2f}",
                        f"{seconds / ours[0]:.2f}x" if ours else "",
                        f"{peak / MB:.0f}", f"{peak / aim:.2f}",
                        f"{max(r['local_param_bytes'] for r in per_rank) / MB:.0f}",
                        f"{max(r['bytes_read'] for r in per_rank) / MB:.0f}" if per_rank[0]["bytes_read"] else "",
                    ])
                    print(rows[-1], flush=True)
        header = ["world", "checkpoint->params", "method", "wall s (slowest rank)", "time vs fullshard",
                  "peak private MB/rank", "peak / (ckpt/N + largest)", "params held MB/rank",
                  "bytes read MB/rank (fullshard's count)"]
        total32, largest32 = checkpoint_stats(paths["fp32"])
        total16, _ = checkpoint_stats(paths["bf16"])
        body = (
            f"Loading a {total32 / MB:.0f} MB fp32 / {total16 / MB:.0f} MB bf16 llama checkpoint "
            f"(largest tensor {largest32 / MB:.0f} MB in fp32) into fp32 FSDP2 shards on CPU/gloo. "
            "Peak private = highest anonymous memory (smaps_rollup `Anonymous`) above the rank's "
            "pre-load baseline, so page cache from memory-mapped files is not counted. The aim for "
            "fullshard is a ratio of at most 1.0 in the 'peak / (ckpt/N + largest)' column and a time "
            "ratio of at most 1.0 against transformers. Where transformers loads fp32 into fp32 its shards "
            "stay views of the memory-mapped file: no private memory and no read until first use, so its "
            "time there excludes reading the bytes that the other methods copy into their shards.\n\n"
            + markdown_table(header, rows)
        )
        print(body)
        if not args.no_write:
            write_section("loading", body)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
