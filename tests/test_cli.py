"""The `fullshard` command end to end: self-launch without torchrun, export, plan, and every config error."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fullshard.cli import main
from fullshard.train.metrics import read_metrics

CONFIG = """
model:
  name_or_path: micro-llama
data:
  seq_len: 32
train:
  steps: 3
  micro_batch_size: 2
  global_batch_size: 4
  log_every: 1
  eval_batches: 1
optim:
  warmup_steps: 0
"""


def run_cli(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # as from a plain shell: no launcher
    return subprocess.run([sys.executable, "-m", "fullshard.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_train_self_launches_then_export_and_plan(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    done = run_cli("train", "tiny.yaml", "--nproc", "2", "--train.output_dir=out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "launching 2 processes" in done.stdout
    out = tmp_path / "out"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert all(r["tokens"] == 4 * 31 for r in records if r["kind"] == "train")  # 4 sequences a step, both ranks
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "checkpoints" / "step_3" / "COMPLETE").exists()

    # `fullshard export` of the final checkpoint gives the weights the trainer exported
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "exported")]) == 0
    ours, theirs = load_file(out / "hf" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # `fullshard plan` prints the unit table and the memory estimate for the config's model
    assert main(["plan", str(tmp_path / "tiny.yaml"), "--nproc", "2"]) == 0
    printed = capsys.readouterr().out
    assert "model.layers.1" in printed and "optimizer state (shard)" in printed and "sharded over 2 rank(s)" in printed


@pytest.mark.parametrize("args, message", [
    (["--train.stepz=3"], "unknown key train.stepz; the keys of section 'train' are: steps,"),
    (["--trian.steps=3"], "unknown section 'trian'"),
    (["--train.steps=three"], "train.steps must be int, got 'three' (str)"),
    (["--train.global_batch_size=6", "--train.micro_batch_size=2", "--nproc=2"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x data-parallel size 2 = 4"),
    (["--optim.schedule=exp"], "optim.schedule='exp' must be one of ('constant', 'linear', 'cosine')"),
    (["--fsdp.mixed_precision=fp8"], "mixed_precision must be one of"),
    (["--model.name_or_path=/no/such/model"], "model.name_or_path='/no/such/model' is neither a built-in model"),
    (["missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["--nproc=0"], "--nproc must be a positive integer"),
    (["--fsdp.dp_replicate=3", "--nproc=2"], "fsdp.dp_replicate=3"),
])
def test_config_errors_name_the_key(args, message, capsys):
    assert main(["train", *args]) == 2
    assert message in capsys.readouterr().err


def test_config_error_from_the_command_line_starts_no_process(tmp_path):
    done = run_cli("train", "--train.global_batch_size=5", cwd=tmp_path)
    assert done.returncode == 2
    assert "train.global_batch_size=5 is not divisible" in done.stderr
    assert "launching" not in done.stdout and not (tmp_path / "runs").exists()
