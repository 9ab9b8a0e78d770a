"""The `fullshard` command: self-launch, export, plan; every error before launch as one line naming the
key; errors inside the ranks as one line; Ctrl-C / SIGTERM stop and resume; remote code; Hub ids."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fullshard.cli import main, parse_train_args
from fullshard.errors import ConfigError
from fullshard.testing import run_distributed
from fullshard.train.config import BUILTIN_MODELS, SECTIONS, load_config
from fullshard.train.data import byte_tokenizer, load_data
from fullshard.train.loss import target_count
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


def clean_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FULLSHARD_DEBUG"):
        env.pop(key, None)  # as from a plain shell: no launcher
    return env


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fullshard.cli", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------- in one group
#
# Checks that train several runs (activation checkpointing, export dtypes, stage two, the built-in VLM)
# run them as `fullshard train` does on each rank, through `train()`, all in ONE spawned group: a launch
# costs a launcher, torchrun's agent and the ranks' imports. What only the command does (self-launch,
# signals, one-line errors from inside the ranks, the console) keeps its real launches below.


def train_as_rank(*argv: str) -> dict:
    """`fullshard train <argv>` on this rank: the command's parsing and checks, then `train()`.
    Returns what rank 0 logged (every message, `once` ones too) and the command's error line if
    the run failed (`fullshard: error: <message>`, as the launcher prints a rank's failure)."""
    import logging

    from fullshard import log
    from fullshard.launch import describe, error_line
    from fullshard.train import train

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lines, handler, caught = [], Lines(), []
    log._ensure_handler()
    log._seen.clear()  # a message logged once per process is logged once per run, as each launch does
    log.logger.addHandler(handler)
    try:
        args = parse_train_args(list(argv))
        config = load_config(args.config_path, args.overrides)
        config.accumulation_steps(torch.distributed.get_world_size())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning the run shows is recorded
            train(config)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test asserts on the line
        error = error_line(describe(exc))
    finally:
        log.logger.removeHandler(handler)
    return {"log": "\n".join(lines), "error": error, "warnings": [str(w.message) for w in caught]}


def _cli_runs(root: str) -> dict:
    """Every multi-run check's runs, each in its own directory (its cwd, as `run_cli` gives)."""
    from pathlib import Path

    root, out = Path(root), {}
    quick = ["--train.steps=2", "--checkpoint.export=false", "--train.plot=false", "--nproc=2"]
    os.chdir(root / "resume")  # the run that test_a_resume_that_cannot_work_is_refused_before_launch refuses to resume
    out["resume/out"] = train_as_rank("tiny.yaml", "--train.output_dir=out", *quick)
    os.chdir(root / "ac")
    for model in ("micro-llama", "qwen3"):
        for ac in ("false", "true"):
            out[f"ac/{model}-{ac}"] = train_as_rank(
                "tiny.yaml", f"--model.name_or_path={model}", f"--train.output_dir={model}-{ac}",
                f"--fsdp.activation_checkpointing={ac}", *quick, "--data.packing=false")
    os.chdir(root / "dtype")
    common = ("tiny.yaml", "--nproc", "2", "--model.name_or_path=bf16-model", "--model.dtype=fp32",
              "--train.steps=2", "--train.plot=false")
    out["dtype/default"] = train_as_rank(*common, "--train.output_dir=default")
    out["dtype/asked"] = train_as_rank(*common, "--train.output_dir=asked", "--train.export_dtype=fp32")
    os.chdir(root / "stage2")
    out["stage2/s1"] = train_as_rank("tiny.yaml", "--nproc", "2", "--train.output_dir=s1")
    stage2 = ("tiny.yaml", "--nproc", "2", "--fsdp.dp_replicate=2", "--data.path=other.txt", "--train.steps=2",
              "--train.log_every=10",  # step 1 is logged all the same, and the last
              "--checkpoint.every=1", "--checkpoint.init_from=s1", "--train.plot=false")
    out["stage2/s2"] = train_as_rank(*stage2, "--train.output_dir=s2")
    out["stage2/s2opt"] = train_as_rank(*stage2, "--train.output_dir=s2opt", "--checkpoint.init_optimizer=true")
    os.chdir(root / "vlm")
    out.update(_vlm_runs())
    return out


@pytest.fixture(scope="module")
def in_one_group(tmp_path_factory):
    """The runs of `_cli_runs`, their inputs written here first; (root, rank 0's results)."""
    root = tmp_path_factory.mktemp("cli_runs")
    for check in ("resume", "ac", "dtype", "stage2", "vlm"):
        (root / check).mkdir()
        (root / check / "tiny.yaml").write_text(CONFIG)
    make_model_dir(root / "ac" / "qwen3", "qwen3")  # micro-llama's shapes, plus q_norm / k_norm in every layer
    shutil.copytree(root / "ac" / "qwen3", root / "resume" / "qwen3")
    write_bf16_model(root / "dtype" / "bf16-model")
    (root / "stage2" / "other.txt").write_text("".join(f"the {i}th other document is not the built-in corpus.\n"
                                                       for i in range(200)))
    (root / "vlm" / "bad.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "gone.png"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a shape"}]}]}) + "\n")
    return root, run_distributed(_cli_runs, 2, str(root), timeout=1200)[0]


def test_train_self_launches_then_export_and_plan(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    done = run_cli("train", "tiny.yaml", "--nproc", "2", "--train.output_dir=out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "launching 2 processes" in done.stdout
    out = tmp_path / "out"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    # 4 sequences a step, both ranks: 31 targets each but at the documents starting inside them
    config = load_config(str(tmp_path / "tiny.yaml"), [])
    steps = load_data(config.data, byte_tokenizer()).step_batches(4, 4, 0, 1, seed=config.train.seed, shuffle=True)
    expected = [target_count(steps.micro_batches(s)[0]) for s in range(3)]
    assert [r["tokens"] for r in records if r["kind"] == "train"] == expected and max(expected) < 4 * 31
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

    # `fullshard plan` and `fullshard export` print a FullshardError as one line
    (tmp_path / "bad_plan.yaml").write_text(CONFIG + "fsdp:\n  plan: {mode: manual, modules: {'lm_head.*': []}}\n")
    assert main(["plan", str(tmp_path / "bad_plan.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard: error: plan entry 'lm_head.*'") and err.count("\n") == 1, err
    broken = tmp_path / "broken" / "step_3"
    shutil.copytree(out / "checkpoints" / "step_3", broken)
    (broken / "state" / ".metadata").write_bytes(b"not a pickle")
    assert main(["export", str(broken), str(tmp_path / "never")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("fullshard: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "never").exists()


def test_plan_shows_the_mesh_and_what_each_tp_rank_holds(tmp_path, capsys):
    """Under tp 2 the plan names the mesh, each split weight's slice, and estimates less per rank than dp alone."""
    (tmp_path / "tp.yaml").write_text(CONFIG + "fsdp:\n  tp_size: 2\n  cp_size: 2\n")
    assert main(["plan", str(tmp_path / "tp.yaml"), "--nproc", "8"]) == 0
    printed = capsys.readouterr().out
    assert "mesh dp_replicate 1 x dp_shard 2 x cp 2 x tp 2 = 8 rank(s): data split 2 way(s)" in printed
    assert re.search(r"self_attn\.q_proj\.weight +colwise +\[32, 32\] +tp rank r holds dim 0 \[r\*16:\(r\+1\)\*16\] "
                     r"-> \[16, 32\]", printed), printed
    assert re.search(r"mlp\.down_proj\.weight +rowwise +\[32, 64\] .* -> \[32, 32\]", printed), printed
    assert "1 micro-batch(es) per step" in printed

    def parameters_mib(text):
        return float(re.search(r"parameters \(shard\) +([\d.]+) MiB", text).group(1))

    assert main(["plan", str(tmp_path / "tp.yaml").replace("tp.yaml", "dp.yaml"), "--nproc", "2"]) == 2
    (tmp_path / "dp.yaml").write_text(CONFIG)
    assert main(["plan", str(tmp_path / "dp.yaml"), "--nproc", "2"]) == 0
    assert parameters_mib(capsys.readouterr().out) > parameters_mib(printed)
    (tmp_path / "bad_tp.yaml").write_text(CONFIG + "parallel:\n  tp_size: 2\n  tp_plan: {'model.blocks.*': colwise}\n")
    assert main(["plan", str(tmp_path / "bad_tp.yaml"), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard: error: tp_plan entry 'model.blocks.*': pattern matches no module"), err


# ---------------------------------------------------------------------------------------------- before launch


@pytest.mark.parametrize("args, message", [
    (["--train.stepz=3"], "unknown key train.stepz; the keys of section 'train' are: steps,"),
    (["--trian.steps=3"], "unknown section 'trian'"),
    (["--train.steps=three"], "train.steps='three': input should be a valid integer"),
    (["--train.global_batch_size=6", "--train.micro_batch_size=2", "--nproc=2"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x data-parallel size 2 = 4"),
    (["--optim.schedule=exp"], "optim.schedule='exp' must be one of ('constant', 'linear', 'cosine')"),
    (["--fsdp.mixed_precision=fp8"], "fsdp.mixed_precision must be one of"),
    (["--model.name_or_path=/no/such/model"], "model.name_or_path='/no/such/model' is neither a built-in model"),
    (["missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["--nproc=0"], "--nproc must be a positive integer"),
    (["--fsdp.dp_replicate=3", "--nproc=2"], "fsdp.dp_replicate=3 x fsdp.dp_shard=-1 does not match the 2 processes"),
    (["--fsdp.dp_replicate=0", "--nproc=2"], "fsdp.dp_replicate=0 must be >= 1"),
    (["--fsdp.tp_size=2", "--fsdp.cp_size=2", "--nproc=2"], "fsdp.dp_replicate=1 x fsdp.dp_shard=-1 x fsdp.cp_size=2 "
                                                            "x fsdp.tp_size=2 does not match the 2 processes (2 is not "
                                                            "divisible by 4)"),
    (["--fsdp.tp_size=2", "--train.global_batch_size=6", "--train.micro_batch_size=2", "--nproc=4"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x data-parallel size 2 = 4"),
    (["--fsdp.tp_size=0"], "fsdp.tp_size must be an int >= 1, got 0"),
    (["--fsdp.cp_size=0"], "fsdp.cp_size must be an int >= 1, got 0"),
    (["--fsdp.timeout_s=0"], "fsdp.timeout_s=0.0 must be > 0 seconds"),
    (["--train.report_to=[mlflow]"], "train.report_to names 'mlflow'; known trackers"),
    (["--data.path=/no/such/data.jsonl"], "data.path='/no/such/data.jsonl' does not exist"),
    (["--checkpoint.resume=/no/such/ckpt"], "checkpoint.resume='/no/such/ckpt': checkpoint directory /no/such/ckpt "
                                            "does not exist"),
    (["--fsdp.plan={mode: manual, modules: {'model.blocks.*': [free_full_weight]}}"],
     "fsdp.plan: plan entry 'model.blocks.*': pattern 'model.blocks.*' matches no module of LlamaForCausalLM"),
])
def test_config_errors_name_the_key(args, message, capsys):
    assert main(["train", "--model.name_or_path=micro-llama", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard: error: ") and message in err and err.count("\n") == 1, err


REFUSED = {
    "batch arithmetic": ["--train.global_batch_size=6", "--train.micro_batch_size=2", "--nproc=2"],
    "data path": ["--data.path=/no/such/data.jsonl"],
    "model path": ["--model.name_or_path=/no/such/model"],
    "mesh": ["--fsdp.dp_replicate=3", "--nproc=2"],
    "plan entry": ["--fsdp.plan={mode: manual, modules: {'model.blocks.*': [free_full_weight]}}"],
    "resume checkpoint": ["--checkpoint.resume=/no/such/ckpt"],
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_run_leaves_nothing_behind(case, tmp_path, monkeypatch, capsys):
    # before: the lock made train.output_dir first, and a refusal left it there, empty
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model.name_or_path=micro-llama", "--train.output_dir=runs/new", *REFUSED[case]]) == 2
    assert capsys.readouterr().err.startswith("fullshard: error: ")
    assert list(tmp_path.iterdir()) == []


def make_model_dir(directory, name: str):
    """A zoo model (random weights) with the byte tokenizer, as a local HF directory."""
    from fullshard.testing import build_model

    tokenizer = byte_tokenizer()
    build_model(name, vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_resume_that_cannot_work_is_refused_before_launch(in_one_group, monkeypatch, capsys):
    """A checkpoint that does not fit the model, or past train.steps, is one short line before torchrun starts."""
    work, runs = in_one_group[0] / "resume", in_one_group[1]  # this test's run directory (`_cli_runs`)
    quick = ["--train.steps=2", "--checkpoint.export=false", "--train.plot=false", "--nproc=2"]
    assert runs["resume/out"]["error"] is None, runs["resume/out"]
    logs = sorted((work / "out" / "logs").glob("*"))  # whatever a rank would write there
    written = {path: path.stat().st_mtime_ns for path in logs}
    new_run = "start a new run: another train.output_dir, or checkpoint.resume=none with checkpoint.overwrite=true"
    for args, message in (
            (["--train.output_dir=out", "--train.steps=1"],
             f"fullshard: error: checkpoint.resume=auto: checkpoint out/checkpoints/step_2 is at step 2, past "
             f"train.steps=1: raise train.steps to at least 2 to continue it, or {new_run}"),
            (["--train.output_dir=out", "--model.name_or_path=qwen3"],
             "fullshard: error: checkpoint.resume=auto: checkpoint out/checkpoints/step_2 does not fit this model (4 "
             "missing from it: model.layers.0.self_attn.k_norm.weight, model.layers.0.self_attn.q_norm.weight, "
             f"model.layers.1.self_attn.k_norm.weight, ...): use the model it was trained from, or {new_run}"),
            (["--train.output_dir=elsewhere/new", "--model.name_or_path=qwen3", "--checkpoint.resume=out/checkpoints"],
             "fullshard: error: checkpoint.resume=out/checkpoints: checkpoint out/checkpoints/step_2 does not fit this "
             "model (4 missing from it: ")):
        monkeypatch.chdir(work)  # the command's checks before launch, in this process (no rank to start)
        code, done = main(["train", "tiny.yaml", *quick, *args]), capsys.readouterr()
        assert code == 2 and "launching" not in done.out, done.out + done.err
        assert done.err.splitlines() == [done.err.strip()] and done.err.startswith(message), done.err
        assert len(done.err) < 400
    assert sorted((work / "out" / "logs").glob("*")) == logs and all(
        path.stat().st_mtime_ns == mtime for path, mtime in written.items())  # no rank started
    assert not (work / "elsewhere").exists()  # made for the refused run, removed with it
    # the fitting model, with enough steps, resumes; rank 1, whose RNG file is gone, says it re-derives its
    # RNG on the launcher's console (before: rank 0 alone spoke, and it had its file)
    (work / "out" / "checkpoints" / "step_2" / "rng" / "rank_00001.pt").unlink()
    done = run_cli("train", "tiny.yaml", "--train.output_dir=out", *quick, "--train.steps=3", cwd=work)
    assert done.returncode == 0 and "(resumed from step 2)" in done.stderr, done.stdout + done.stderr
    assert ("[fullshard] rank 1: out/checkpoints/step_2/rng/rank_00001.pt is missing, so this rank re-seeded "
            "python/numpy/torch RNGs with derived_seed(") in done.stderr, done.stderr
    assert done.stderr.count("re-seeded") == 1, done.stderr  # only by the rank that did


def train_losses(directory) -> list[float]:
    return [r["loss"] for r in read_metrics(directory / "metrics.jsonl") if r["kind"] == "train"]


def test_activation_checkpointing_on_padded_rows_trains_as_without(in_one_group):
    """One record per row (padded) through `fullshard train`: the same losses with and without activation
    checkpointing, for the built-in Llama and a Qwen3 directory whose config says use_cache."""
    root, runs = in_one_group
    for model in ("micro-llama", "qwen3"):
        losses = []
        for ac in ("false", "true"):
            out = f"{model}-{ac}"
            done = runs[f"ac/{out}"]
            assert done["error"] is None, done
            assert "one record per row" in done["log"]
            losses.append(train_losses(root / "ac" / out))
        assert len(losses[0]) == 2 and max(abs(a - b) for a, b in zip(*losses)) < 1e-6, (model, losses)


def test_paths_checked_before_launch(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "ckpts" / "step_2").mkdir(parents=True)
    (tmp_path / "ckpts" / "step_2" / "trainer_state.json").write_text("{}")
    for args, message in ((["--train.output_dir", str(tmp_path / "file")], "train.output_dir="),
                          ([f"--checkpoint.dir={tmp_path / 'file'}"], "checkpoint.dir="),
                          ([f"--checkpoint.resume={tmp_path / 'ckpts'}"], "holds no complete checkpoint"),
                          ([f"--checkpoint.resume={tmp_path / 'ckpts' / 'step_2'}"], "is an incomplete checkpoint")):
        assert main(["train", "--model.name_or_path=micro-llama", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert "is an existing file, not a directory" in (main(["train", f"--train.output_dir={tmp_path / 'file'}"]),
                                                      capsys.readouterr().err)[1]


def test_version_help_and_print_config(tmp_path, capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("fullshard 0.")
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--print-config" in text and "--optim.min_lr_ratio  float in [0, 1] = 0.1" in text
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 1e-4\n")
    assert main(["train", "--train.steps=5", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 1e-4 and printed["train"]["steps"] == 5 and set(printed) == set(SECTIONS)
    assert not (tmp_path / "runs").exists()


def write_remote_code_model(directory, marker):
    """A model directory whose config and tokenizer classes live in its own Python files, which
    write `marker` when they are executed."""
    directory.mkdir()
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('executed')\n"
    (directory / "configuration_custom.py").write_text(
        payload + "from transformers import LlamaConfig\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom'\n")
    (directory / "tokenization_custom.py").write_text(payload)
    (directory / "config.json").write_text(json.dumps(dict(
        model_type="custom", architectures=["LlamaForCausalLM"], auto_map={"AutoConfig": "configuration_custom.CustomConfig"},
        vocab_size=64, **BUILTIN_MODELS["micro-llama"])))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}))


def test_remote_code_is_refused_by_name_unless_allowed(tmp_path, capsys):
    from fullshard.train.trainer import load_tokenizer

    model, marker = tmp_path / "custom", tmp_path / "EXECUTED"
    write_remote_code_model(model, marker)
    refused = "ships its own Python code, which fullshard does not run unless model.trust_remote_code is true"
    assert main(["plan", str(model)]) == 2
    assert refused in capsys.readouterr().err
    assert main(["train", f"--model.name_or_path={model}", "--nproc=2"]) == 2
    assert refused in capsys.readouterr().err
    with pytest.raises(ConfigError, match="the tokenizer of model.name_or_path=.* ships its own Python code"):
        load_tokenizer(load_config(None, [f"--model.name_or_path={model}"]))
    assert not marker.exists()
    # the same files do run when the user says so: the check above could have failed
    assert main(["plan", str(model), "--trust-remote-code", "--nproc=2"]) == 0
    assert marker.read_text() == "executed"


def test_a_classification_checkpoint_is_refused_for_sft_before_launch(tmp_path, monkeypatch, capsys):
    """A reward model's checkpoint (score head) for SFT: one line before launch, naming the objective
    that trains it (before: every pre-launch check passed and the ranks failed on the shapes)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=257,
                num_labels=1, architectures=["LlamaForSequenceClassification"]).save_pretrained(tmp_path / "rm")
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--model.name_or_path={tmp_path / 'rm'}", "--nproc=2", "--train.output_dir=out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard: error: model.name_or_path=") and err.count("\n") == 1, err
    assert "LlamaForSequenceClassification checkpoint" in err and "train.objective=reward" in err, err
    assert not (tmp_path / "out").exists()


HUB_SCRIPT = """
from fullshard.cli import main
tiny = ["--data.seq_len=32", "--train.steps=1", "--train.micro_batch_size=2", "--train.global_batch_size=2",
        "--train.eval_batches=1", "--train.plot=false", "--nproc=1", "--train.output_dir=hub_run"]
codes = [main(["plan", "Org/tiny", "--nproc=2"]), main(["plan", "Org/absent"]),
         main(["train", "--model.name_or_path=Org/absent"]), main(["train", "--model.name_or_path=Org/tiny", *tiny])]
print("codes", codes)
"""


def test_hub_id_resolved_from_the_cache_offline(tmp_path):
    """`model.name_or_path=Org/name` from a cached snapshot with HF_HUB_OFFLINE=1; an id neither
    cached nor reachable is one line naming it (huggingface_hub reads its environment at import,
    hence a fresh process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.train.data import byte_tokenizer

    cache = tmp_path / "hub"
    snapshot = cache / "models--Org--tiny" / "snapshots" / ("a" * 40)
    tokenizer = byte_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **BUILTIN_MODELS["micro-llama"])).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (cache / "models--Org--tiny" / "refs").mkdir()
    (cache / "models--Org--tiny" / "refs" / "main").write_text("a" * 40)
    done = subprocess.run([sys.executable, "-c", HUB_SCRIPT], env=dict(clean_env(), HF_HUB_CACHE=str(cache),
                          HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "codes [0, 2, 2, 0]" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "hub_run" / "hf" / "model.safetensors").exists()  # trained from the cached snapshot
    assert "LlamaForCausalLM" in done.stdout and "model.layers.1" in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("fullshard: error:")]
    assert len(errors) == 2 and all("'Org/absent'" in line for line in errors), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("hub", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline", "unreachable"])
def test_a_mistyped_model_name_with_no_hub_is_one_line(hub, tmp_path):
    # before: the Hub client's error ("LocalEntryNotFoundError: Got: ConnectError: [Errno 111] Connection refused ...")
    done = subprocess.run([sys.executable, "-m", "fullshard.cli", "train", "--model.name_or_path=Llama-micro"],
                          env={**{k: v for k, v in clean_env().items() if k != "HF_HUB_OFFLINE"},
                               "HF_HUB_CACHE": str(tmp_path / "hub"), **hub}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    offline = " (HF_HUB_OFFLINE is set)" if "HF_HUB_OFFLINE" in hub else ""
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "fullshard: error: model.name_or_path='Llama-micro' is not a local directory, not a built-in name (did you "
        f"mean 'micro-llama'?), and the Hub is unreachable{offline}"], done.stderr
    assert list(tmp_path.iterdir()) == [] or [p.name for p in tmp_path.iterdir()] == ["hub"]


# ---------------------------------------------------------------------------------------------- inside the ranks


def test_an_error_inside_the_ranks_is_one_line_with_tracebacks_logged(tmp_path):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    done = run_cli("train", "tiny.yaml", "--data.path=bad.jsonl", "--train.output_dir=out", "--nproc=2", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "fullshard: error: bad.jsonl:2 is not valid JSON (Expecting value) (every rank's traceback: out/logs/rank*.log)"]
    for rank in (0, 1):
        assert "Traceback" in (tmp_path / "out" / "logs" / f"rank{rank}.log").read_text()
    assert no_process_left("out", cwd=tmp_path)


def fullshard_processes(marker: str, cwd=None) -> list[str]:
    """Every process on the machine whose command line names `marker` (the run's output dir), and,
    given `cwd`, that runs in that directory: other tests' and other users' runs are not this one."""
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    found = [line for line in listing if "fullshard" in line and marker in line]
    return found if cwd is None else [line for line in found if _runs_in(line.split()[0], cwd)]


def _runs_in(pid: str, cwd) -> bool:
    try:
        return os.path.samefile(f"/proc/{pid}/cwd", cwd)
    except OSError:  # gone, or not ours to look at
        return False


def no_process_left(marker: str, within_s: float = 10, cwd=None) -> bool:
    deadline = time.monotonic() + within_s
    while fullshard_processes(marker, cwd) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not fullshard_processes(marker, cwd)


def start_and_signal(command: list[str], cwd, sig: int, after: str) -> tuple[int, str]:
    """Start the launcher, send `sig` to it once `after` appears in its output, return (status, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "fullshard.cli", *command], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if after in line:
            proc.send_signal(sig)
            break
    lines += proc.stdout.readlines()
    return proc.wait(timeout=300), "".join(lines)


def test_sigint_and_sigterm_stop_cleanly_and_the_same_command_resumes(tmp_path):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    command = ["train", "tiny.yaml", "--train.steps=100000", "--train.output_dir=stopped", "--nproc=2"]
    status, output = start_and_signal(command, tmp_path, signal.SIGINT, after="step     2 ")
    assert status == 128 + signal.SIGINT, output
    assert no_process_left("stopped", cwd=tmp_path), fullshard_processes("stopped", tmp_path)
    stopped = re.search(r"stopped at step (\d+) of 100000; checkpoint (\S+); run the same command to resume", output)
    assert stopped, output
    step = int(stopped.group(1))
    assert (tmp_path / stopped.group(2) / "COMPLETE").exists() and stopped.group(2).endswith(f"step_{step}")
    assert "Traceback" not in output and "KeyboardInterrupt" not in output

    status, output = start_and_signal(command, tmp_path, signal.SIGTERM, after=f"step {step + 2:5d} ")
    assert status == 128 + signal.SIGTERM, output
    assert f"(resumed from step {step})" in output and f"step {step + 1:5d} " in output
    assert no_process_left("stopped", cwd=tmp_path), fullshard_processes("stopped", tmp_path)
    again = int(re.search(r"stopped at step (\d+) of 100000", output).group(1))
    assert again >= step + 2 and (tmp_path / "stopped" / "checkpoints" / f"step_{again}" / "COMPLETE").exists()
    records = read_metrics(tmp_path / "stopped" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, again + 1))


# ---------------------------------------------------------------------------------------------- vision-language


def caption(directory) -> str:
    """What the exported VLM says of a red circle, with transformers alone (greedy, 12 tokens)."""
    import random

    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from fullshard.data.builtin import draw_shape

    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    tokenizer, images = AutoTokenizer.from_pretrained(directory), AutoImageProcessor.from_pretrained(directory)
    pixels = images(draw_shape("circle", "red", random.Random(1)), return_tensors="pt")
    # what Qwen2VLProcessor does (it needs torchvision for its video half): one <|image_pad|> per merged patch
    count = int(pixels["image_grid_thw"].prod()) // images.merge_size ** 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}],
        tokenize=False, add_generation_prompt=True).replace("<|image_pad|>", "<|image_pad|>" * count)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    types = (ids["input_ids"] == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(**ids, **pixels, mm_token_type_ids=types, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


VLM_ARGS = ("--model.name_or_path=tiny-qwen2-vl", "--nproc", "2", "--train.output_dir=out", "--train.steps=24",
            "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.log_every=1", "--data.seq_len=256",
            "--data.cache_dir=cache", "--optim.lr=1e-2", "--optim.warmup_steps=2", "--train.eval_batches=1")


def _vlm_runs() -> dict:
    """The built-in VLM trained, its export captioning on rank 0; then two runs that fail inside the
    ranks: a record naming a missing picture, and the export without its processor."""
    out = {"vlm/train": train_as_rank(*VLM_ARGS)}
    if torch.distributed.get_rank() == 0 and out["vlm/train"]["error"] is None:
        out["vlm/caption"] = caption("out/hf")
        shutil.copytree("out/hf", "bare")
        os.unlink("bare/processor_config.json")
    torch.distributed.barrier()
    out["vlm/bad"] = train_as_rank(*VLM_ARGS[:3], "--train.output_dir=bad", "--data.path=bad.jsonl",
                                   "--data.format=chat", "--data.cache_dir=cache")
    out["vlm/bare"] = train_as_rank("--model.name_or_path=bare", "--nproc", "2", "--train.output_dir=bare_run",
                                    "--data.cache_dir=cache")
    return out


def test_builtin_vlm_trains_offline_exports_its_processor_and_captions(in_one_group):
    """`fullshard train --model.name_or_path=tiny-qwen2-vl` on 2 processes: generated pictures, the loss
    falls, the export carries processor, tokenizer and chat template and captions a picture in transformers."""
    root, runs = in_one_group
    root = root / "vlm"
    assert runs["vlm/train"]["error"] is None, runs["vlm/train"]
    # torch's warning about the image features' views (never changed in place): silenced, with the reason in code
    assert not [w for w in runs["vlm/train"]["warnings"] if "returned a view tensor" in w], runs["vlm/train"]["warnings"]
    losses = [r["loss"] for r in read_metrics(root / "out" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses
    exported = root / "out" / "hf"
    assert {"processor_config.json", "chat_template.jinja", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in exported.iterdir()}
    caption = runs["vlm/caption"].strip()
    assert caption.startswith("a "), caption  # the answers' form; 24 steps do not name shapes reliably yet

    # a record naming a missing picture: one line naming the record and the file
    lines = runs["vlm/bad"]["error"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fullshard: error: bad.jsonl:1 names image ") \
        and "gone.png, which does not exist" in lines[0], runs["vlm/bad"]

    # the exported model without its processor: one line naming the directory
    lines = runs["vlm/bare"]["error"].strip().splitlines()
    assert len(lines) == 1, runs["vlm/bare"]
    assert lines[0].startswith("fullshard: error: model.name_or_path='bare' is a vision-language model without a "
                               "processor"), lines[0]


# ---------------------------------------------------------------------------------------------- export dtype


def write_bf16_model(directory):
    """A micro-llama stored in bf16, with the byte tokenizer: what people fine-tune from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=32,
                                         **BUILTIN_MODELS["micro-llama"])).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_exports_keep_the_dtype_fine_tuned_from(in_one_group, tmp_path, capsys):
    """A bf16 checkpoint fine-tuned with fp32 masters exports bf16 (hf/ and `fullshard export`), fp32 when asked."""
    root, runs = in_one_group
    root = root / "dtype"
    default, asked = runs["dtype/default"], runs["dtype/asked"]
    assert default["error"] is None and asked["error"] is None, (default, asked)
    done = [line for line in default["log"].splitlines() if "done:" in line]
    assert done and "model default/hf (bfloat16)" in done[0], default["log"][-2000:]
    assert "model asked/hf (float32)" in asked["log"]
    half, full = (load_file(root / run / "hf" / "model.safetensors") for run in ("default", "asked"))
    assert {t.dtype for t in half.values()} == {torch.bfloat16} and {t.dtype for t in full.values()} == {torch.float32}
    assert json.loads((root / "default" / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    # the fp32 masters did train (they are not the bf16 values), and the bf16 export is them rounded
    source = load_file(root / "bf16-model" / "model.safetensors")
    assert any(not torch.equal(full[k], source[k].float()) for k in source)
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in half)
    # `fullshard export` of the checkpoint: the source's dtype by default, --dtype to override
    assert main(["export", str(root / "default" / "checkpoints"), str(tmp_path / "offline")]) == 0
    assert main(["export", str(root / "default" / "checkpoints"), str(tmp_path / "offline32"), "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "offline (bfloat16)" in printed and "offline32 (float32)" in printed
    offline, offline32 = (load_file(tmp_path / d / "model.safetensors") for d in ("offline", "offline32"))
    assert all(torch.equal(offline[k], half[k]) for k in half) and {t.dtype for t in offline32.values()} == {torch.float32}


# ---------------------------------------------------------------------------------------------- stage-2 training


def optimizer_state(checkpoint) -> dict[str, torch.Tensor]:
    """Every optimizer-state tensor of a checkpoint, whole, by its DCP key (`optim.state.<param>.<key>`)."""
    from fullshard.checkpoint.read import CheckpointReader

    reader = CheckpointReader(checkpoint)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in reader.metadata.state_dict_metadata.items() if k.startswith("optim.state.") and hasattr(v, "size")}
    reader.read(state)
    return state


def test_stage_two_starts_a_new_run_from_another_runs_checkpoint(in_one_group, tmp_path, capsys):
    """`checkpoint.init_from`: a new run in another directory, on other data and another layout, starts
    from stage 1's weights (its first loss is stage 1's model's on that data), at step 0, with a fresh
    schedule; `checkpoint.init_optimizer` also brings stage 1's optimizer state."""
    from transformers import AutoModelForCausalLM

    from fullshard.train.loss import causal_lm_loss_sum

    root, runs = in_one_group
    root = root / "stage2"
    one = runs["stage2/s1"]
    assert one["error"] is None, one
    # a mistake is one line before launch: a checkpoint that does not fit the model, optimizer state without init_from
    assert main(["train", str(root / "tiny.yaml"), "--model.name_or_path=tiny-llama",
                 f"--checkpoint.init_from={root / 's1'}", f"--train.output_dir={tmp_path / 'never'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fullshard: error: checkpoint.init_from='{root / 's1'}': ") and "does not fit" in err
    assert err.count("\n") == 1, err
    assert main(["train", str(root / "tiny.yaml"), "--checkpoint.init_optimizer=true"]) == 2
    assert "checkpoint.init_optimizer=True needs checkpoint.init_from" in capsys.readouterr().err

    fresh, moments = runs["stage2/s2"], runs["stage2/s2opt"]
    assert fresh["error"] is None, fresh
    assert moments["error"] is None, moments
    assert "initialised from" in fresh["log"] and "steps 0..2 of 2" in fresh["log"]

    # the reference: stage 1's exported model, in this process, on stage 2's first batch
    config = load_config(str(root / "tiny.yaml"), [f"--data.path={root / 'other.txt'}",
                                                    f"--data.cache_dir={tmp_path / 'cache'}"])
    batch = load_data(config.data, byte_tokenizer()).step_batches(4, 4, 0, 1, seed=config.train.seed,
                                                                  shuffle=True).micro_batches(0)[0]
    model = AutoModelForCausalLM.from_pretrained(root / "s1" / "hf", dtype=torch.float32)
    with torch.no_grad():
        expected = float(causal_lm_loss_sum(model, batch, 0)) / target_count(batch)
    runs = {name: [r for r in read_metrics(root / name / "metrics.jsonl") if r["kind"] == "train"]
            for name in ("s2", "s2opt")}
    for records in runs.values():
        assert [r["step"] for r in records] == [1, 2]  # log_every 10: the first step and the last
        assert abs(records[0]["loss"] - expected) < 1e-5, (records[0]["loss"], expected)
    assert runs["s2"][0]["lr"] == runs["s2opt"][0]["lr"]  # the schedule is this run's, whatever the optimizer held
    assert (root / "s2" / "checkpoints" / "step_2" / "COMPLETE").exists()

    # optimizer state: after the same first gradient, m = b1 m0 + (1 - b1) g and v = b2 v0 + (1 - b2) g^2,
    # so the run that loaded it differs from the fresh one by exactly stage 1's moments times beta, and counts on
    saved = optimizer_state(root / "s1" / "checkpoints" / "step_3")
    after_fresh, after_loaded = (optimizer_state(root / name / "checkpoints" / "step_1") for name in ("s2", "s2opt"))
    betas = config.optim.betas
    assert saved.keys() == after_loaded.keys() and saved
    for key, value in saved.items():
        if key.endswith(".step"):
            assert float(after_loaded[key]) == float(value) + 1 and float(after_fresh[key]) == 1
        else:
            beta = betas[0] if key.endswith("exp_avg") else betas[1]
            torch.testing.assert_close(after_loaded[key] - after_fresh[key], beta * value, rtol=1e-5, atol=1e-9)
