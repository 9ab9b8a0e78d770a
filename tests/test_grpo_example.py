"""examples/grpo.py end to end on CPU: 2 FSDP trainer ranks, 1 engine fed through WeightSync, a frozen
offloaded reference; the mean reward of the last 5 steps is above the first 5's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.py"


def test_grpo_example_learns(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(EXAMPLE.parents[1] / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--steps", "20"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((tmp_path / "rewards.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 21))
    assert [h["sync_version"] for h in history] == list(range(2, 22))  # one push before the first step, one per step
    first = sum(h["reward"] for h in history[:5]) / 5
    last = sum(h["reward"] for h in history[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert all(h["kl"] >= 0 for h in history) and history[-1]["kl"] > 0  # the actor moved away from the reference
    assert (tmp_path / "rewards.png").stat().st_size > 0
    assert "mean reward: first 5 steps" in done.stdout
