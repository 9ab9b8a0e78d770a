"""Where a rank's memory goes during one expert-parallel training step: torch's FSDPMemTracker
(live tensor bytes by kind: parameters sharded / unsharded, gradients, all-gather and
reduce-scatter buffers, activations, temporaries, optimizer state) over one step after a warm-up
step, on bench_moe.py's Qwen3-MoE at world 4. Prints rank 0's peak and, per experts module, its
snapshots before / after each forward and backward hook. A diagnosis tool: writes nothing.

    .venv/bin/python bench/moe_memory.py 4      # the ep size (1, 2 or 4)
    .venv/bin/python bench/moe_memory.py 1 transformers   # transformers' own FSDP2 (DistributedConfig)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import _model_dir, train_step  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402


def _track(path: str, ep: int, kind: str = "fullshard") -> None:
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from bench.bench_moe import load_model

    model = load_model(kind, ep, path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())

    train_step(model, optimizer, generator)  # the optimizer state exists before the tracked step, as in training
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        train_step(model, optimizer, generator)
    if dist.get_rank() == 0:
        tracker.display_snapshot("peak", units="MiB", tabulate=False)
        tracker.display_modulewise_snapshots(depth=6, units="MiB", tabulate=False)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_track, 4, _model_dir(root), int(sys.argv[1]) if len(sys.argv) > 1 else 4,
                        sys.argv[2] if len(sys.argv) > 2 else "fullshard", timeout=1200)
