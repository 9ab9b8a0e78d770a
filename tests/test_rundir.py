"""A run directory holds one run: one live run (the lock, and no rank outliving its launcher), one
run's checkpoints (resume, refusal, overwrite), writable before launch, metrics that hold each step
once; and what the console tells about a run."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
from test_cli import CONFIG, clean_env, fullshard_processes, no_process_left, run_cli
from test_train import tiny_config

from fullshard.cli import main
from fullshard.errors import ConfigError
from fullshard.testing import run_distributed
from fullshard.train import load_config, train
from fullshard.train.metrics import MetricsLogger, read_metrics
from fullshard.train.rundir import LOCK_FILE, RunLock, claim_run_directory

# ---------------------------------------------------------------------------------------------- through the launcher


def test_one_run_per_directory_through_the_launcher(tmp_path):
    """A live run refuses a second one naming its host and PID; kill -9 of its launcher ends every
    rank; its lock is then taken over; a fresh run into its checkpoints is refused until
    checkpoint.overwrite deletes them, and that run's done line names its own checkpoint."""
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    first = subprocess.Popen([sys.executable, "-m", "fullshard.cli", "train", "tiny.yaml", "--train.steps=100000",
                              "--checkpoint.every=1", "--train.output_dir=held", "--nproc=2"], cwd=tmp_path,
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if "step     4 " in line:
                break
        second = run_cli("train", "tiny.yaml", "--train.output_dir=held", "--nproc=2", cwd=tmp_path)
        assert second.returncode == 2 and "launching" not in second.stdout, second.stdout + second.stderr
        refusal = second.stderr.strip().splitlines()
        assert len(refusal) == 1 and refusal[0].startswith(
            f"fullshard: error: train.output_dir='held' is in use by another run (host {socket.gethostname()}, "
            f"PID {first.pid}, since "), second.stderr
    finally:
        first.kill()  # SIGKILL: no handler runs in the launcher
        first.wait()
    assert no_process_left("held", cwd=tmp_path), fullshard_processes("held", tmp_path)

    fresh = run_cli("train", "tiny.yaml", "--train.output_dir=held", "--checkpoint.resume=none", "--nproc=2",
                    cwd=tmp_path)
    # listed after that run looked: a save the kill cut between its two renames is finished by it
    old = sorted(int(p.name[5:]) for p in (tmp_path / "held" / "checkpoints").glob("step_*"))
    assert old and old[-1] > 3  # the old run got past the step the new one ends at
    assert fresh.returncode == 2 and "launching" not in fresh.stdout
    assert f"taking over the lock of a run that is gone (host {socket.gethostname()}, PID {first.pid})" in fresh.stderr
    refusal = fresh.stderr.strip().splitlines()[-1]
    assert refusal.startswith("fullshard: error: train.output_dir='held' holds the checkpoints of another run "
                              f"(newest: held/checkpoints/step_{old[-1]})") and "checkpoint.overwrite=true" in refusal
    assert not (tmp_path / "held" / LOCK_FILE).exists()  # a refused run lets go of the lock

    fresh = run_cli("train", "tiny.yaml", "--train.output_dir=held", "--checkpoint.resume=none",
                    "--checkpoint.overwrite=true", "--nproc=2", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    assert "done: checkpoint held/checkpoints/step_3," in fresh.stderr
    assert sorted(p.name for p in (tmp_path / "held" / "checkpoints").iterdir()) == ["latest", "step_3"]
    records = read_metrics(tmp_path / "held" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]


def test_unwritable_outputs_are_refused_before_launch(tmp_path, capsys):
    """As root nothing in a normal directory is read-only; /sys takes no new directory from anyone."""
    for key in ("train.output_dir", "checkpoint.dir", "data.cache_dir"):
        assert main(["train", "--model.name_or_path=micro-llama", "--train.steps=1", f"--{key}=/sys/fullshard-never",
                     f"--train.output_dir={tmp_path / 'out'}" if key != "train.output_dir" else "--nproc=2"]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"fullshard: error: {key}='/sys/fullshard-never' is not writable: ")
        assert captured.err.count("\n") == 1 and "launching" not in captured.out
    assert not (tmp_path / "out").exists()  # nothing created for a refused run


# ---------------------------------------------------------------------------------------------- the rules, directly


def fake_checkpoint(save_dir, step):
    path = save_dir / f"step_{step}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(json.dumps({"step": step, "time_ns": step}))
    return path


def test_which_run_may_write_a_directory_that_holds_checkpoints(tmp_path):
    out = tmp_path / "run"
    save_dir = out / "checkpoints"
    older, newest = fake_checkpoint(save_dir, 10), fake_checkpoint(save_dir, 20)
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (out / "hf").mkdir()

    def claim(*overrides):
        claim_run_directory(load_config(None, [f"--train.output_dir={out}", *overrides]))

    claim()  # auto continues it
    claim(f"--checkpoint.resume={newest}")  # so does naming its newest checkpoint
    elsewhere = fake_checkpoint(tmp_path / "other", 5)
    for resume, message in (("none", "checkpoint.resume=none starts a new run"),
                            (str(elsewhere), "starts a new run from another checkpoint")):
        with pytest.raises(ConfigError, match=rf"train.output_dir='{out}' holds the checkpoints of another run "
                                              rf"\(newest: {newest}\) and .*{message}.*checkpoint.overwrite=true"):
            claim(f"--checkpoint.resume={resume}")
    for extra in ([], ["--checkpoint.overwrite=true"]):  # an older step would branch the run in place
        with pytest.raises(ConfigError, match=rf"is an older step of the run in {save_dir}"):
            claim(f"--checkpoint.resume={older}", *extra)
    assert newest.exists() and older.exists() and (out / "hf").exists()  # refusals delete nothing
    claim("--checkpoint.resume=none", "--checkpoint.overwrite=true")
    assert sorted(p.name for p in out.iterdir()) == [] and not save_dir.exists()


def test_the_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path, caplog):
    held = RunLock(tmp_path)
    held.acquire()
    host = socket.gethostname()
    with pytest.raises(ConfigError, match=rf"is in use by another run \(host {host}, PID {os.getpid()}"):
        RunLock(tmp_path).acquire()
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    logging.getLogger("fullshard").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="fullshard"), RunLock(tmp_path):
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        logging.getLogger("fullshard").propagate = False
    assert f"taking over the lock of a run that is gone (host {socket.gethostname()}, PID {int(dead.stdout)})" \
        in caplog.text
    # another host's lock: its process cannot be checked from here
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(ConfigError, match=r"\(host elsewhere, PID 1, .*if that run is gone, delete "):
        RunLock(tmp_path).acquire()


# ---------------------------------------------------------------------------------------------- in the ranks


def _python_api_runs(root: str) -> dict:
    """Two ranks calling `train` (rank 0 holds the lock; rank 1 must not refuse its own run)."""
    import torch.distributed as dist

    from fullshard.train.stop import STOP_FILE_ENV

    out, rank = {}, dist.get_rank()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("fullshard").addHandler(handler)
    # the newest checkpoint is unreadable: the run falls back to the older one and trains its steps again
    config = tiny_config(f"{root}/fallback", "--train.steps=4", "--checkpoint.every=2", "--optim.warmup_steps=4")
    train(config)
    if rank == 0:
        (config.checkpoint_dir / "step_4" / "state" / ".metadata").write_bytes(b"garbage")
    dist.barrier()
    out["fallback"] = train(config)
    out["warmup_warnings"] = sum("optim.warmup_steps=4 >= train.steps=4" in m for m in seen)
    # a stop asked for before the first step: nothing trained, nothing saved
    stop_file = f"{root}/stop-{rank}"
    open(stop_file, "w").close()
    os.environ[STOP_FILE_ENV] = stop_file
    try:
        out["early"] = train(tiny_config(f"{root}/early"))
    finally:
        del os.environ[STOP_FILE_ENV]
    # a new run into the first one's directory, refused on every rank
    try:
        train(tiny_config(f"{root}/fallback", "--checkpoint.resume=none"))
    except ConfigError as err:
        out["refused"] = str(err)
    return out


def test_runs_through_the_python_api(tmp_path):
    results = run_distributed(_python_api_runs, 2, str(tmp_path))
    for r in results:
        assert (r["fallback"]["start_step"], r["fallback"]["end_step"]) == (2, 4)
        assert r["fallback"]["checkpoint"] == str(tmp_path / "fallback" / "checkpoints" / "step_4")
        assert r["early"]["end_step"] == 0 and r["early"]["losses"] == {}
        assert "holds the checkpoints of another run" in r["refused"]
    assert [r["warmup_warnings"] for r in results] == [1, 0]  # once, by rank 0
    records = read_metrics(tmp_path / "fallback" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4]
    assert not (tmp_path / "early" / "checkpoints").exists() and not (tmp_path / "early" / "hf").exists()
    assert not (tmp_path / "fallback" / LOCK_FILE).exists()


# ---------------------------------------------------------------------------------------------- the console


def test_tensorboard_only_when_asked(tmp_path, monkeypatch):
    import types

    written = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            written.append((log_dir, purge_step))

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if it were installed
    MetricsLogger(tmp_path, 3).close()
    assert written == []
    MetricsLogger(tmp_path, 3, initial_step=2, report_to=["tensorboard"]).close()
    assert written == [(str(tmp_path / "tensorboard"), 3)]  # a resumed run drops what came after its checkpoint


def test_commands_and_model_names_the_user_mistyped(tmp_path, capsys):
    assert main(["trian"]) == 2
    assert capsys.readouterr().err == ("fullshard: error: unknown command 'trian'; the commands are train, plan, "
                                       "export, generate (fullshard --help)\n")
    assert main(["train", "--model.name_or_path=tiny-lama"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'tiny-llama'? The built-in models are tiny-llama, micro-llama" in err and err.count("\n") == 1
    # `fullshard plan` takes train's overrides, from a model name or a config file
    assert main(["plan", "micro-llama", "--fsdp.tp_size=2", "--data.seq_len", "16", "--nproc", "2"]) == 0
    printed = capsys.readouterr().out
    assert "x tp 2 = 2 rank(s)" in printed and "micro batch 8 x 16 tokens" in printed
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    assert main(["plan", str(tmp_path / "tiny.yaml"), "--train.micro_batch_size=1"]) == 0
    assert "micro batch 1 x 32 tokens" in capsys.readouterr().out
    assert main(["plan", "micro-llama", "--fsdp.tp_sise=2"]) == 2
    assert "unknown key fsdp.tp_sise" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- elastic restarts

DIE_ONCE = """
import os, sys, time
from fullshard.checkpoint import CheckpointManager
from fullshard.cli import main

save = CheckpointManager.save


def save_then_die_once(self, step, *args, **kwargs):
    # the first life of rank 1 dies right after the step-1 checkpoint is complete
    saved = save(self, step, *args, **kwargs)
    if step == 1 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os._exit(17)
    return saved


CheckpointManager.save = save_then_die_once
life = os.environ["TORCHELASTIC_RESTART_COUNT"]


def torchruns_store():
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


if life == "1" and os.environ["RANK"] == "0":
    import torch.distributed as dist

    class SaysItCounted(dist.TCPStore):  # the store fullshard opens on torchrun's
        def add(self, key, amount):
            count = super().add(key, amount)
            if amount:  # rank 0 has counted itself in
                self.set("die_once/rank0_arrived", "1")
            return count

    dist.TCPStore = SaysItCounted
if life == "1" and os.environ["RANK"] == "1":
    # the second life of rank 1 dies before it reaches the process group, once rank 0 of its group
    # has: the third group of workers must still agree on its store prefix (counting arrivals split it)
    torchruns_store().wait(["die_once/rank0_arrived"])
    os._exit(18)
if life == "2" and os.environ["RANK"] == "1":
    # the restarted rank 1 comes late: rank 0 must not take the dead rank 1's address, still in
    # torchrun's store, for the new one's (torch#135712: refused connections, or a hang)
    time.sleep(3)
sys.exit(main())
"""


def test_restarted_groups_agree_on_their_store_prefix_whoever_died_before_counting():
    """`distributed.group_key` over a store that outlives the groups (torchrun's): a group whose rank 1
    died before counting itself in does not split the next group, however its ranks arrive."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from fullshard.distributed import group_key

    store, world = dist.HashStore(), 3

    def group(delays):
        keys = [None] * world

        def rank(r):
            time.sleep(delays[r])
            keys[r] = group_key(store, world, timedelta(seconds=20), poll_s=0.005)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return keys

    first = group([0, 0.02, 0.01])
    assert len(set(first)) == 1, first
    store.add("fullshard/arrivals", 1)  # a group whose rank 0 counted itself in, then its rank 1 died
    store.add("fullshard/arrivals", 1)
    for delays in ([0.05, 0, 0.02], [0, 0.03, 0.06]):
        keys = group(delays)
        assert len(set(keys)) == 1 and keys[0] > first[0], (keys, first)
        first = keys


def test_workers_torchrun_restarts_resume_their_own_runs_checkpoints(tmp_path):
    """`torchrun --max-restarts=2` with checkpoint.resume=none: rank 1 dies after the step-1 checkpoint,
    then dies again before it reaches the process group; the third group of workers continues from
    that checkpoint (before: refused as another run's checkpoints; then a hang, the group split)."""
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    (tmp_path / "die_once.py").write_text(DIE_ONCE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=2", "--monitor-interval=0.1", "die_once.py", "train", "tiny.yaml",
                           "--train.output_dir=elastic", "--checkpoint.resume=none", "--checkpoint.every=1",
                           "--fsdp.timeout_s=60",
                           "--train.steps=3", "--checkpoint.export=false", "--train.plot=false"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "was saved by this run before torchrun restarted its workers: resuming it" in output, output[-5000:]
    assert "(resumed from step 1)" in output, output[-5000:]
    steps = [r["step"] for r in read_metrics(tmp_path / "elastic" / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3], steps
    assert (tmp_path / "elastic" / "checkpoints" / "step_3" / "COMPLETE").exists()

    # another torchrun job (another run id) into those checkpoints with resume=none is still refused
    again = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "fullshard.cli", "train", "tiny.yaml", "--train.output_dir=elastic",
                            "--checkpoint.resume=none", "--train.steps=3"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "holds the checkpoints of another run" in again.stderr, again.stderr[-3000:]
