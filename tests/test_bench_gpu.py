"""The GPU benchmark's dry run: every eager peer trains end to end on CPU with a tiny model, so the
one-command GPU benchmark cannot rot between GPU loans. Nothing about speed is asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


LEVERS = ("fullshard-compiled-float8-tensorwise-ac-selective", "fully_shard-compiled-float8-tensorwise-ac-selective")


def test_gpu_benchmark_dry_run_trains_every_eager_peer(tmp_path):
    """The eager peers, and fullshard against the hand-written loop with float8 tensorwise, selective
    checkpointing and compile (aot_eager in the dry run)."""
    out = tmp_path / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--peers",
                           ",".join(("fullshard", "fully_shard") + LEVERS), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    by_peer = {r["peer"]: r for r in results}
    assert set(by_peer) == {"fullshard", "fully_shard", *LEVERS}
    for r in results:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    # the same model, data and bf16 compute: fullshard's units and plain per-layer fully_shard agree
    assert abs(by_peer["fullshard"]["loss"] - by_peer["fully_shard"]["loss"]) < 5e-2
    assert abs(by_peer[LEVERS[0]]["loss"] - by_peer[LEVERS[1]]["loss"]) < 5e-2
    assert "x by hand" in proc.stdout
    assert "| fully_shard |" in proc.stdout and "x fullshard" in proc.stdout
