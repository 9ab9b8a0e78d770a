"""A vision-language training step at world size 2 on CPU: fullshard vs transformers' native FSDP2
(`from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`), the same Qwen2-VL, batch and images.

Speed: both peers in one process group, taking turns a window of steps each, round after round (the
order rotating), so load that comes and goes hits them alike; the table shows the median tokens/s and
the median same-round ratio. Memory: each peer alone in its own process group for a few steps, its
peak resident set. Both train everything (fullshard with `freeze: none`), the model's own loss,
clipping to 1.0, AdamW; every row holds one image, so native FSDP2 (which has no agreement for ranks
without images) runs too.

    .venv/bin/python bench/bench_vlm.py [--rounds 8]   # writes the vlm section of BENCHMARKS.md
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

TEXT = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_parameters={"rope_type": "default",
            "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
VISION = dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
IMAGE_ID, MICRO, SEQ, SIDE = 500, 4, 256, 8  # SIDE x SIDE patches an image: SIDE^2 / 4 image tokens
WARMUP, WINDOW, MEMORY_STEPS = 2, 3, 3
FULLSHARD, NATIVE = "fullshard (FSDP2Engine)", "transformers native FSDP2"
PEERS = (FULLSHARD, NATIVE)


def _model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_ID,
                           video_token_id=IMAGE_ID + 1, vision_start_token_id=IMAGE_ID + 2)
    return Qwen2VLForConditionalGeneration(config)


def _batch(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, IMAGE_ID, (MICRO, SEQ), generator=generator)
    tokens = SIDE * SIDE // 4
    ids[:, 2:2 + tokens] = IMAGE_ID
    labels = ids.masked_fill(ids == IMAGE_ID, -100)
    patch = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == IMAGE_ID).long(),
            "pixel_values": torch.randn(MICRO * SIDE * SIDE, patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, SIDE, SIDE]] * MICRO)}


def _build(name: str, path: str):
    """One peer's step function (taking the step number)."""
    if name == FULLSHARD:
        from fullshard import FSDP2Engine, from_pretrained
        from fullshard.optim import clip_grad_norm

        model = from_pretrained(path, engine=FSDP2Engine({"mixed_precision": "fp32"}), freeze="none").train()

        def clip(m):
            clip_grad_norm(m.parameters(), 1.0)
    else:
        from transformers import AutoModelForImageTextToText
        from transformers.distributed import DistributedConfig

        model = AutoModelForImageTextToText.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
        model.train()

        def clip(m):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> None:
        model(**_batch(i), use_cache=False).loss.backward()
        clip(model)
        optimizer.step()
        optimizer.zero_grad()
    step.vision_units = _vision_units(model)
    return step


def _vision_units(model) -> int:
    """FSDP units inside the vision tower (each all-gathered on its own)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.model.visual.modules())


def _speed(path: str, rounds: int) -> dict:
    steps = {name: _build(name, path) for name in PEERS}
    for i in range(WARMUP):
        for run in steps.values():
            run(i)
    speeds: dict[str, list[float]] = {name: [] for name in PEERS}
    loads, tokens = [], WINDOW * MICRO * SEQ * torch.distributed.get_world_size()
    for round_ in range(rounds):
        loads.append(os.getloadavg()[0])
        for name in PEERS[round_ % 2:] + PEERS[:round_ % 2]:
            torch.distributed.barrier()
            start = time.perf_counter()
            for i in range(WINDOW):
                steps[name](WARMUP + round_ * WINDOW + i)
            torch.distributed.barrier()
            speeds[name].append(tokens / (time.perf_counter() - start))
    return {"speeds": speeds, "loads": loads, "units": {name: run.vision_units for name, run in steps.items()}}


def _memory(name: str, path: str) -> float:
    run = _build(name, path)
    for i in range(MEMORY_STEPS):
        run(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    rounds = parser.parse_args().rounds
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        _model().save_pretrained(tmp)
        timed = run_distributed(_speed, 2, tmp, rounds, timeout=3600)[0]
        memory = {name: max(run_distributed(_memory, 2, name, tmp, timeout=1200)) for name in PEERS}
    speeds = timed["speeds"]
    ratios = [own / peer for own, peer in zip(speeds[FULLSHARD], speeds[NATIVE])]
    rows = [[name, f"{statistics.median(speeds[name]):,.0f}", f"{memory[name]:,.0f}", str(timed["units"][name])]
            for name in PEERS]
    for row in rows:
        print(row, flush=True)
    params = sum(p.numel() for p in _model().parameters())
    body = (f"Training step (forward, backward, clip to 1.0, AdamW) of a {params / 1e6:.1f}M-parameter Qwen2-VL "
            f"(vision tower {VISION['depth']} blocks, language model {TEXT['num_hidden_layers']} layers), micro batch "
            f"{MICRO} x {SEQ} tokens per rank with one {SIDE * VISION['patch_size']}-pixel image per row, fp32, world "
            f"size 2 (gloo, CPU), everything trained. Speed: both peers in one process group, alternating windows of "
            f"{WINDOW} steps over {rounds} rounds after {WARMUP} warm-up steps each. Peak memory: each peer alone "
            f"for {MEMORY_STEPS} steps, the process's peak resident set, max over ranks. Vision units: the FSDP "
            "units inside the vision tower (fullshard: one per block, the tower's rest, the merger).\n\n")
    body += ("**fullshard / native FSDP2 tokens/s, round by round: " + ", ".join(f"{r:.2f}" for r in ratios)
             + f"; median {statistics.median(ratios):.2f}.**\n\n")
    body += ("Load average (1 min) at the start of each round: " + ", ".join(f"{x:.1f}" for x in timed["loads"])
             + f"; {load_before[0]:.1f} before the run, on {os.cpu_count()} cores shared with other work: above "
             "about 2 the ranks queue for the cores, so only the same-round ratios mean much.\n\n")
    body += markdown_table(["peer", "tokens/s (median window)", "peak RSS MiB", "vision units"], rows)
    write_section("vlm", body)


if __name__ == "__main__":
    main()
