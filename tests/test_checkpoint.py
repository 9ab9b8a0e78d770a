"""Checkpoints resume exactly (same and other world sizes), survive a rank killed mid-save, rotate
safely, reject bad input on every rank, and export to directories plain transformers loads."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.compare import full_state, full_tensor
from safetensors import safe_open

from fullshard import FSDP2Engine
from fullshard.checkpoint import CheckpointManager, export_checkpoint, export_hf, layout, load_ckpt, save_ckpt
from fullshard.distributed import get_rank
from fullshard.errors import CheckpointError
from fullshard.testing import reported_by_every_rank, run_distributed
from fullshard.testing.spawn import DistributedTestError
from fullshard.testing.zoo import VOCAB, build_model, make_batch

K = 3  # steps before and after the save


# ---------------------------------------------------------------------------- helpers (run on ranks)

def _setup(name="llama", seed=0, **overrides):
    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(build_model(name, seed=seed, **overrides))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps):
    """Batches come from each rank's global RNG, so a resume is only exact if RNG is restored."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def _full_train_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Model weights and every optimizer tensor, gathered, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"param/{k}": v for k, v in full_state(model).items()}
    for fqn, per_param in get_optimizer_state_dict(model, optimizer)["state"].items():
        for key, value in per_param.items():
            out[f"optim/{fqn}/{key}"] = full_tensor(value).clone()
    return out


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


@contextlib.contextmanager
def _slow_staging(seconds: float = 0.5):
    """Delay the background copy of an async save's state to host memory."""
    from torch.distributed.checkpoint.staging import DefaultStager

    original = DefaultStager._stage

    def stage(self, state_dict, **kwargs):
        time.sleep(seconds)
        return original(self, state_dict, **kwargs)

    DefaultStager._stage = stage
    try:
        yield
    finally:
        DefaultStager._stage = original


@contextlib.contextmanager
def _on_shard_write(rank, action):
    """Run `action` on `rank` once that rank has written its DCP shard (before the index exists)."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        result = original(self, plan, planner)
        if get_rank() == rank:
            result.wait()
            action()
        return result

    FileSystemWriter.write_data = write_data
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


def _tree_digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*")) if f.is_file()}


def _fail():
    raise OSError("disk full (injected)")


def _pack(result) -> bytes:
    """Results travel as bytes: tensors put on the harness's queue are shared by file descriptor,
    which is gone once the rank exits."""
    import io

    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _run(fn, world_size, *args):
    import io

    return [torch.load(io.BytesIO(r), weights_only=False) for r in run_distributed(fn, world_size, *args)]


# ---------------------------------------------------------------------------- group bodies

def _first_life(tmp: str) -> dict:
    tmp = Path(tmp)
    rank = get_rank()
    out = {}

    # the straight run: 2K steps
    model, optimizer, scheduler = _setup()
    torch.manual_seed(1000 + rank)
    out["straight_losses"] = _train(model, optimizer, scheduler, 2 * K)
    out["straight_weights"] = full_state(model)

    # the interrupted run: K steps, save, (a fresh group continues)
    model, optimizer, scheduler = _setup()
    torch.manual_seed(1000 + rank)
    out["first_losses"] = _train(model, optimizer, scheduler, K)
    manager = CheckpointManager(tmp / "resume")
    path = manager.save(K, model, optimizer, scheduler, extra_state={"data_position": K * 4})
    saved = _full_train_state(model, optimizer)
    if rank == 0:
        torch.save(saved, tmp / "saved_state.pt")
    out["path"] = str(path)

    # async: training right after save() must not leak into the checkpoint, though the copy to
    # host memory runs in the background (slowed here, so a step not waiting for it would leak);
    # the second save copies into the first one's host buffers
    async_manager = CheckpointManager(tmp / "async", async_save=True)
    expected = {}
    for step in (K, K + 1):
        expected[step] = _full_train_state(model, optimizer)
        with _slow_staging():
            async_manager.save(step, model, optimizer, scheduler)
            _train(model, optimizer, scheduler, 1)
    async_manager.wait()
    out["async_equal"], out["async_keys_match"] = [], True
    for step, state in expected.items():
        fresh, fresh_opt, fresh_sched = _setup(seed=5)
        async_manager.load(fresh, fresh_opt, fresh_sched, path=tmp / "async" / f"step_{step}")
        reloaded = _full_train_state(fresh, fresh_opt)
        out["async_equal"] += [f"step {step}: {k}" for k in state if not torch.equal(state[k], reloaded[k])]
        out["async_keys_match"] &= set(state) == set(reloaded)

    # rotation: by count, then by size; the newest always survives
    rotating = CheckpointManager(tmp / "rotate", max_num=2)
    for step in (1, 2, 3):
        rotating.save(step, model, optimizer)
    out["kept_by_count"] = [p.name for p in rotating.checkpoints()]
    tiny = CheckpointManager(tmp / "rotate", max_num=5, max_mem=0.001)
    tiny.save(4, model, optimizer)
    out["kept_by_size"] = [p.name for p in tiny.checkpoints()]

    # a save that fails on one rank mid-write leaves the same-tag checkpoint on disk untouched
    before = _tree_digest(tmp / "rotate" / "step_4") if rank == 0 else None
    with _on_shard_write(1, _fail):
        out["failed_save_error"] = _error_of(lambda: tiny.save(4, model, optimizer))
    dist.barrier()
    if rank == 0:
        layout.wait_for_discards()  # rotation deletes in the background
        out["untouched"] = before == _tree_digest(tmp / "rotate" / "step_4")
        out["debris"] = sorted(p.name for p in (tmp / "rotate").iterdir() if p.name.startswith("."))
    out["still_loads"] = tiny.load(model, optimizer)["step"]

    # bad input
    out["err_missing_dir"] = _error_of(lambda: load_ckpt(model, tmp / "nope"))
    out["err_auto_empty"] = CheckpointManager(tmp / "empty").load(model)
    other, other_opt, _ = _setup("llama", intermediate_size=48)
    out["err_shape"] = _error_of(lambda: manager.load(other, other_opt))
    other, other_opt, _ = _setup("qwen3")
    out["err_keys"] = _error_of(lambda: manager.load(other, other_opt))
    out["err_no_optim"] = _error_of(lambda: CheckpointManager(tmp / "no_optim").save(1, model) and
                                    CheckpointManager(tmp / "no_optim").load(model, optimizer))
    if rank == 0:
        import shutil

        shutil.copytree(path, tmp / "truncated" / "step_3")
        shard = sorted((tmp / "truncated" / "step_3" / "state").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    out["err_truncated"] = _error_of(lambda: load_ckpt(model, tmp / "truncated"))

    # seed-001 face
    out["seed_path"] = str(save_ckpt(model, tmp / "seed", client_state={"global_step": 7, "note": "x"}, optimizer=optimizer))
    out["seed_load"] = load_ckpt(model, tmp / "seed", optimizer=optimizer)

    # export, tied and untied, several files; the same weights also as a checkpoint for offline export
    batch = make_batch("qwen3", batch_size=2, seq_len=12, seed=3)
    for name in ("qwen3", "llama"):
        model, optimizer, scheduler = _setup(name)
        torch.manual_seed(1000 + rank)
        _train(model, optimizer, scheduler, 1)
        export_hf(model, tmp / f"export_{name}", max_shard_size="20KB")
        CheckpointManager(tmp / f"ckpt_{name}").save(1, model, optimizer)
        with torch.no_grad():
            out[f"logits_{name}"] = model(input_ids=batch["input_ids"]).logits
        out[f"tied_{name}"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return _pack(out)


def _second_life(tmp: str) -> dict:
    tmp = Path(tmp)
    model, optimizer, scheduler = _setup(seed=123)  # other weights: the checkpoint must overwrite them
    torch.manual_seed(99)  # other RNG: the checkpoint must restore it
    manager = CheckpointManager(tmp / "resume")
    extra = manager.load(model, optimizer, scheduler)
    out = {"extra": extra, "info": manager.last_load_info, "lr": scheduler.get_last_lr(),
           "losses": _train(model, optimizer, scheduler, K), "weights": full_state(model)}

    # after the crash of _save_then_die: "auto" picks the last complete checkpoint and clears the debris
    killed = CheckpointManager(tmp / "killed")
    out["killed_extra"] = killed.load(model, optimizer, scheduler)
    dist.barrier()
    out["killed_after"] = sorted(p.name for p in (tmp / "killed").iterdir())
    return _pack(out)


def _resume_elsewhere(tmp: str) -> dict:
    """At another world size: the loaded state equals what was saved, and training goes on."""
    tmp = Path(tmp)
    model, optimizer, scheduler = _setup(seed=321)
    manager = CheckpointManager(tmp / "resume")
    with _captured_warnings() as caught:
        extra = manager.load(model, optimizer, scheduler)
    saved = torch.load(tmp / "saved_state.pt", weights_only=True)
    loaded = _full_train_state(model, optimizer)
    # uneven row shards at 3 ranks, ranks without a file at 4; cast on the way (offline export compares)
    export_hf(model, tmp / f"export_world{dist.get_world_size()}", dtype="bf16", max_shard_size="20KB")
    losses = _train(model, optimizer, scheduler, 2)
    return _pack({"extra": extra, "info": manager.last_load_info, "keys_match": set(saved) == set(loaded),
                  "different": sorted(k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k])),
                  "warned": sum("re-seeded" in message for message in caught), "losses": losses})


def _save_then_die(tmp: str) -> None:
    """Rank 1 is SIGKILLed once its shard is written; rank 0 then sits in a collective that never
    returns (as NCCL would) until the launcher (here the harness) kills it too."""
    import time

    tmp = Path(tmp)
    model, optimizer, scheduler = _setup()
    torch.manual_seed(1000 + get_rank())
    manager = CheckpointManager(tmp / "killed", max_num=1)
    _train(model, optimizer, scheduler, 1)
    manager.save(1, model, optimizer, scheduler)
    _train(model, optimizer, scheduler, 1)
    die = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if get_rank() == 1 else (lambda: time.sleep(600))
    with _on_shard_write(get_rank(), die):
        manager.save(2, model, optimizer, scheduler)


# ---------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def lives(tmp_path_factory):
    """Three process groups in turn: a first life that trains, saves and exports; a save crashed by
    SIGKILL; a second life that resumes both. Tests below check pieces of what they returned."""
    tmp = tmp_path_factory.mktemp("ckpt")
    first = _run(_first_life, 2, str(tmp))
    with pytest.raises(DistributedTestError) as crash:
        run_distributed(_save_then_die, 2, str(tmp), grace=2)
    after_crash = sorted(p.name for p in (tmp / "killed").iterdir())
    second = _run(_second_life, 2, str(tmp))
    return {"tmp": tmp, "first": first, "crash": str(crash.value), "after_crash": after_crash, "second": second}


@pytest.fixture(scope="module")
def first_life(lives):
    return lives["tmp"], lives["first"]


def test_resume_in_a_fresh_group_is_bit_exact(lives):
    first = lives["first"][0]
    for rank, r in enumerate(lives["second"]):
        assert r["info"]["rng"] == "restored" and r["extra"] == {"data_position": K * 4, "step": K}
        assert first["first_losses"] + r["losses"] == first["straight_losses"], rank
        bad = [k for k, w in first["straight_weights"].items() if not torch.equal(w, r["weights"][k])]
        assert not bad, f"rank {rank}: weights differ from the straight run: {bad}"
        assert r["lr"] == pytest.approx([1e-2 * 0.5 ** (K // 2)])


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(lives):
    assert "rank 1 died with exit code -9" in lives["crash"]
    partial = [n for n in lives["after_crash"] if n.startswith(layout.TMP_PREFIX)]
    assert partial and "step_1" in lives["after_crash"] and "step_2" not in lives["after_crash"]
    for r in lives["second"]:
        assert r["killed_extra"]["step"] == 1
        assert r["killed_after"] == ["latest", "step_1"]  # the partial save is gone


@pytest.mark.parametrize("world_size", [4, 3, 1])
def test_checkpoint_from_two_ranks_resumes_on(first_life, world_size):
    tmp, _ = first_life
    for rank, r in enumerate(_run(_resume_elsewhere, world_size, str(tmp))):
        assert r["keys_match"] and not r["different"], f"rank {rank}: {r['different']}"
        assert r["info"]["rng"] == "re-derived" and r["info"]["saved_world_size"] == 2
        assert r["warned"] == (rank == 0)  # once, by rank 0
        assert r["extra"]["data_position"] == K * 4
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    live = tmp / f"export_world{world_size}"
    offline = export_checkpoint(tmp / "resume", tmp / f"offline_for_world{world_size}", dtype="bf16",
                                max_shard_size="20KB")
    files = sorted(p.name for p in offline.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(p.name for p in live.glob("*.safetensors"))
    for fname in files:
        with safe_open(live / fname, "pt") as written, safe_open(offline / fname, "pt") as expected:
            assert sorted(written.keys()) == sorted(expected.keys())
            for key in expected.keys():
                assert written.get_tensor(key).dtype == torch.bfloat16
                assert torch.equal(written.get_tensor(key), expected.get_tensor(key)), (fname, key)


def test_async_save_holds_the_state_of_its_step(first_life):
    _, results = first_life
    for r in results:
        assert r["async_keys_match"] and r["async_equal"] == []


def test_rotation_keeps_its_promise(first_life):
    _, results = first_life
    for r in results:
        assert r["kept_by_count"] == ["step_3", "step_2"]
        assert r["kept_by_size"] == ["step_4"]  # over max_mem alone: kept, never zero left


def test_failed_save_overwrites_nothing(first_life):
    tmp, results = first_life
    for r in results:
        assert "disk full (injected)" in r["failed_save_error"]
        assert r["still_loads"] == 4
    assert results[0]["untouched"] and results[0]["debris"] == []


def test_bad_input_is_named_on_every_rank(first_life):
    _, results = first_life
    for r in results:
        assert "does not exist" in r["err_missing_dir"] and "nope" in r["err_missing_dir"]
        assert r["err_auto_empty"] is None
        assert "shape mismatch" in r["err_shape"] and "model.layers.0.mlp.gate_proj.weight" in r["err_shape"]
        assert "(64, 32) vs model (48, 32)" in r["err_shape"]
        assert "missing from the checkpoint" in r["err_keys"] and "q_norm" in r["err_keys"]
        assert "no optimizer state" in r["err_no_optim"]
        assert "truncated" in r["err_truncated"] and ".distcp" in r["err_truncated"]
        assert reported_by_every_rank(r["err_shape"], 2), r["err_shape"]


def test_seed_api_round_trip(first_life):
    _, results = first_life
    for r in results:
        assert Path(r["seed_path"]).name == "global_step7"
        path, client = r["seed_load"]
        assert path == r["seed_path"] and client == {"global_step": 7, "note": "x", "step": 7}


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_export_loads_in_plain_transformers(first_life, name):
    from transformers import AutoModelForCausalLM

    tmp, results = first_life
    exported = tmp / f"export_{name}"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # several files, written by both ranks
    assert ("lm_head.weight" in index["weight_map"]) == (not results[0][f"tied_{name}"])
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.config.tie_word_embeddings == results[0][f"tied_{name}"]
    batch = make_batch("qwen3", batch_size=2, seq_len=12, seed=3)
    with torch.no_grad():
        logits = reloaded(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(logits, results[0][f"logits_{name}"], atol=1e-5, rtol=1e-5)

    offline = export_checkpoint(tmp / f"ckpt_{name}", tmp / f"offline_{name}", max_shard_size="20KB")
    assert json.loads((offline / "model.safetensors.index.json").read_text()) == index
    for fname in set(index["weight_map"].values()):
        with safe_open(exported / fname, "pt") as live, safe_open(offline / fname, "pt") as off:
            assert sorted(live.keys()) == sorted(off.keys())
            for key in live.keys():
                assert torch.equal(live.get_tensor(key), off.get_tensor(key)), key

    half = export_checkpoint(tmp / f"ckpt_{name}", tmp / f"bf16_{name}", dtype="bf16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded_half = AutoModelForCausalLM.from_pretrained(half)
    assert reloaded_half.dtype == torch.bfloat16
    torch.testing.assert_close(reloaded_half.get_input_embeddings().weight.float(),
                               reloaded.get_input_embeddings().weight, atol=1e-2, rtol=1e-2)


def test_export_of_an_unsharded_model_needs_no_process_group(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model("gpt2", seed=4)
    export_hf(model, tmp_path / "gpt2", dtype="bf16")
    with safe_open(tmp_path / "gpt2" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", dtype=torch.float32)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    expected = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_second_export_replaces_the_first_and_leaves_nothing_behind(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model("llama", seed=4)
    out = tmp_path / "out"
    export_hf(model, out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    (out / "README.md").write_text("the user's own file")
    export_hf(model, out)  # one file this time: the shards and index of the first are gone
    layout.wait_for_discards()
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "README.md" in names and "config.json" in names, names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")], names
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or replaced files left beside it
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


# ---------------------------------------------------------------------------- hardening (issue 10)

class _Payload:
    """Unpickling this runs `touch path`: what a crafted checkpoint file would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Counter:
    """A Stateful training state beside the model (as the strategy is)."""

    def __init__(self, n=0, payload=None):
        self.n, self.payload = n, payload

    def state_dict(self):
        return {"n": self.n} if self.payload is None else {"n": _Payload(self.payload)}

    def load_state_dict(self, state):
        self.n = state["n"]


def _copy_checkpoint(source: Path, target: Path, mutate=None) -> None:
    """On rank 0: copy a checkpoint (and change one file in the copy); every rank waits for it."""
    import shutil

    if get_rank() == 0:
        shutil.copytree(source, target)
        if mutate is not None:
            mutate(target)
    dist.barrier()


def _craft_metadata(payload: Path):
    import pickle

    return lambda c: (c / "state" / ".metadata").write_bytes(pickle.dumps(_Payload(payload)))


def _replace_file(relative: str, data=None, payload: Path | None = None):
    def mutate(checkpoint: Path) -> None:
        file = checkpoint / relative
        if payload is not None:
            torch.save(_Payload(payload), file)
        else:
            file.write_bytes(data(file.read_bytes()))

    return mutate


def _resummed(mutate):
    """A crafted checkpoint carries sums that match its crafted files: the checks behind them must hold."""
    from fullshard.checkpoint import checksums

    def crafted(checkpoint: Path) -> None:
        mutate(checkpoint)
        record = json.loads((checkpoint / layout.CHECKSUMS).read_text())
        record["files"] = {name: list(checksums.file_checksum(checkpoint / name)) for name in record["files"]}
        (checkpoint / layout.CHECKSUMS).write_text(json.dumps(record))

    return crafted


def _nan_in_place(checkpoint: Path) -> None:
    """Overwrite 16 bytes in the middle of the largest model tensor of a shard with 0xff (float NaNs):
    the file keeps its size and DCP reads it without complaint."""
    from fullshard.safe_dcp import read_dcp_metadata

    index = read_dcp_metadata(checkpoint / "state", CheckpointError)
    info = max((info for key, info in index.storage_data.items() if key.fqn.startswith("model.")),
               key=lambda info: info.length)
    with open(checkpoint / "state" / info.relative_path, "r+b") as handle:
        handle.seek(info.offset + info.length // 2)
        handle.write(b"\xff" * 16)


def _first_shard(checkpoint: Path) -> str:
    return "state/" + sorted(p.name for p in (checkpoint / "state").glob("*.distcp"))[0]


def _hardening(tmp: str) -> bytes:
    """Crafted and damaged files, interrupted commits, fallbacks: one group for every check."""
    tmp = Path(tmp)
    source = tmp / "resume" / "step_3"  # a complete checkpoint of the first life (llama, AdamW, StepLR)
    model, optimizer, scheduler = _setup()
    payload = tmp / "payload"
    out = {}

    def error_loading(name, mutate, **load):
        _copy_checkpoint(source, tmp / name / "step_3", mutate)
        return _error_of(lambda: CheckpointManager(tmp / name).load(model, optimizer, scheduler, **load))

    # nothing read from a checkpoint runs code: metadata, side files, DCP byte entries
    out["crafted_metadata"] = error_loading("crafted_metadata", _resummed(_craft_metadata(payload)))
    out["crafted_metadata_load_ckpt"] = _error_of(lambda: load_ckpt(model, tmp / "crafted_metadata" / "step_3"))
    out["crafted_scheduler"] = error_loading("crafted_scheduler", _resummed(_replace_file("scheduler.pt", payload=payload)))
    out["crafted_rng"] = error_loading("crafted_rng", _resummed(_replace_file("rng/rank_00001.pt",
                                                                                  payload=payload)))
    CheckpointManager(tmp / "crafted_entry").save(1, model, states={"counter": _Counter(payload=payload)})
    out["crafted_entry"] = _error_of(lambda: CheckpointManager(tmp / "crafted_entry").load(
        model, states={"counter": _Counter()}))

    # damaged files: one error naming the checkpoint and the file, on every rank
    out["garbled_metadata"] = error_loading("garbled_metadata", _replace_file("state/.metadata", lambda b: b"\x80\x04garbage" * 50))
    out["truncated_metadata"] = error_loading("truncated_metadata", _replace_file("state/.metadata", lambda b: b[: len(b) // 2]))
    shard = _first_shard(source)
    out["garbled_shard_name"] = shard
    out["garbled_shard"] = error_loading("garbled_shard", _replace_file(shard, lambda b: b"\x00" * len(b)))

    # a shard overwritten in place at its own size (NaN weights) is refused by its recorded CRC32, and
    # "auto" falls back past it; a checkpoint saved without sums (an older fullshard) still loads
    out["nan_shard"] = error_loading("nan_shard", _nan_in_place)
    nan_fallback = CheckpointManager(tmp / "nan_fallback")
    nan_fallback.save(1, model, optimizer, scheduler, states={"counter": _Counter(5)})
    nan_fallback.save(2, model, optimizer, scheduler, states={"counter": _Counter(6)})
    if get_rank() == 0:
        _nan_in_place(tmp / "nan_fallback" / "step_2")
    dist.barrier()
    restored = _Counter()
    with _captured_warnings() as warned:
        out["nan_fallback_step"] = nan_fallback.load(model, optimizer, scheduler, states={"counter": restored})["step"]
    out["nan_fallback_counter"], out["nan_fallback_warning"] = restored.n, warned
    _copy_checkpoint(source, tmp / "unsummed" / "step_3", lambda c: (c / layout.CHECKSUMS).unlink())
    out["unsummed_step"] = CheckpointManager(tmp / "unsummed").load(model, optimizer, scheduler)["step"]

    # "auto" falls back past an unreadable newest checkpoint, naming both; "does not fit" never falls back
    counter = _Counter(5)
    fallback = CheckpointManager(tmp / "fallback")
    fallback.save(1, model, optimizer, scheduler, states={"counter": counter})
    counter.n = 6
    fallback.save(2, model, optimizer, scheduler, states={"counter": counter})
    if get_rank() == 0:
        (tmp / "fallback" / "step_2" / "state" / ".metadata").write_bytes(b"garbage")
    dist.barrier()
    restored = _Counter()
    with _captured_warnings() as warned:
        out["fallback_step"] = fallback.load(model, optimizer, scheduler, states={"counter": restored})["step"]
    out["fallback_counter"], out["fallback_warning"] = restored.n, warned
    other, other_opt, _ = _setup("llama", intermediate_size=48)
    out["no_fallback_on_misfit"] = _error_of(lambda: fallback.load(other, other_opt))

    # ordered by step, not by commit time
    ordered = CheckpointManager(tmp / "ordered", max_num=None)
    ordered.save(5, model, tag="late_step")
    ordered.save(3, model, tag="early_step")
    out["ordered"] = [p.name for p in ordered.checkpoints()]
    out.update(_interrupted_commits(tmp, model, optimizer, scheduler))
    out.update(_strategy_state_saved_once(tmp, model, optimizer))
    return _pack(out)


def _strategy_state_saved_once(tmp: Path, model, optimizer) -> dict:
    """FSDPStrategy.save_ckpt / load_ckpt: the step counter and the fp16 loss scaler ride in the
    checkpoint once, as its "strategy" state; the client state stays the caller's."""
    from fullshard.safe_dcp import read_dcp_metadata
    from fullshard.strategy import FSDPStrategy

    saving = FSDPStrategy(bf16=False, fp16=True)
    saving._micro_step, saving.skipped_steps = 7, 2
    saving.scaler.scale, saving.scaler.growth_tracker = 1024.0, 3
    path = saving.save_ckpt(model, tmp / "strategy", client_state={"global_step": 4}, optimizer=optimizer)
    loading = FSDPStrategy(bf16=False, fp16=True)
    loaded_path, client = loading.load_ckpt(model, tmp / "strategy", optimizer=optimizer)
    index = read_dcp_metadata(Path(path) / "state").state_dict_metadata
    return {"strategy_state": (loading.state_dict(), saving.state_dict()), "strategy_client": client,
            "strategy_files": sorted(p.name for p in Path(path).iterdir()),
            "strategy_keys": sorted(k for k in index if k.startswith("states.")),
            "strategy_json": json.loads((Path(path) / layout.TRAINER_STATE).read_text())["extra_state"]}


@contextlib.contextmanager
def _captured_warnings():
    import logging

    from fullshard.log import logger

    class Keep(logging.Handler):
        def emit(self, record):
            caught.append(record.getMessage())

    caught: list[str] = []
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)


def _crash_between_discard_and_rename(save_dir: Path, model, step: int, tag: str) -> str:
    """Save `tag` again; the commit dies right after discarding the old `tag` (rank 0's rename fails)."""
    from fullshard.checkpoint import manager as manager_module

    real_rename = os.rename

    class CrashingOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def rename(src, dst):
            if Path(src).name.startswith(layout.TMP_PREFIX):
                raise OSError("killed (injected) between discard and rename")
            real_rename(src, dst)

    manager_module.os = CrashingOs()
    try:
        return _error_of(lambda: CheckpointManager(save_dir).save(step, model, tag=tag))
    finally:
        manager_module.os = os


def _interrupted_commits(tmp: Path, model, optimizer, scheduler) -> dict:
    """A crash between discarding the old checkpoint of a tag and renaming the new one: every
    resolver finishes the marked temp dir the same way."""
    out = {}
    for name in ("auto", "load_ckpt_dir", "load_ckpt_path", "latest", "export"):
        directory = tmp / "interrupted" / name
        CheckpointManager(directory).save(1, model, tag="same")
        out[f"crash_{name}"] = _crash_between_discard_and_rename(directory, model, 2, "same")
        dist.barrier()
        out[f"left_{name}"] = sorted(p.name for p in directory.iterdir())
    base = tmp / "interrupted"
    out["resolved_auto"] = CheckpointManager(base / "auto").load(model)["step"]
    out["resolved_load_ckpt_dir"] = load_ckpt(model, base / "load_ckpt_dir")[1]["step"]
    out["resolved_load_ckpt_path"] = load_ckpt(model, base / "load_ckpt_path" / "same")[1]["step"]
    out["resolved_latest"] = str(CheckpointManager(base / "latest").latest())
    dist.barrier()
    out["after"] = {name: sorted(p.name for p in (base / name).iterdir()) for name in ("auto", "load_ckpt_dir", "latest")}
    return out


@pytest.fixture(scope="module")
def hardening(first_life):
    tmp, _ = first_life
    return tmp, _run(_hardening, 2, str(tmp))


def test_nothing_read_from_a_checkpoint_runs_code(hardening):
    tmp, results = hardening
    for r in results:
        for key, file in (("crafted_metadata", ".metadata"), ("crafted_metadata_load_ckpt", ".metadata"),
                          ("crafted_scheduler", "scheduler.pt"), ("crafted_rng", "rank_00001.pt")):
            assert r[key].startswith("UnreadableCheckpoint") and "refused" in r[key] and file in r[key], r[key]
            assert "\n" not in r[key] and "weights_only` set to `False" not in r[key], r[key]  # one line, no bad advice
            # every rank raises; the RNG file crafted is rank 1's own, so the error says rank 1
            assert reported_by_every_rank(r[key], 2) or (key == "crafted_rng" and "rank 1: " in r[key]), r[key]
        assert "states.counter.n" in r["crafted_entry"] and "refused" in r["crafted_entry"], r["crafted_entry"]
        assert reported_by_every_rank(r["crafted_entry"], 2)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        export_checkpoint(tmp / "crafted_metadata", tmp / "crafted_export")
    assert not (tmp / "payload").exists(), "a crafted checkpoint ran its payload"
    assert not (tmp / "crafted_export").exists()


def test_damaged_files_are_one_error_naming_checkpoint_and_file(hardening):
    tmp, results = hardening
    for r in results:
        for key, file in (("garbled_metadata", ".metadata"), ("truncated_metadata", ".metadata"),
                          ("garbled_shard", r["garbled_shard_name"].split("/")[1])):
            message = r[key]
            assert message.startswith("UnreadableCheckpoint") and file in message, message
            assert str(tmp / key / "step_3") in message, message
            if key != "garbled_shard":  # the index is read by every rank, a shard only by the rank it belongs to
                assert reported_by_every_rank(message, 2), message
            assert "Traceback" not in message and "CheckpointException" not in message and "\n" not in message, message
    for key in ("garbled_metadata", "truncated_metadata", "garbled_shard"):
        assert len({r[key] for r in results}) == 1, key  # one agreed error, raised on every rank
    for damaged in ("garbled_metadata", "garbled_shard"):
        with pytest.raises(CheckpointError, match=re.escape(str(tmp / damaged / "step_3"))):
            export_checkpoint(tmp / damaged, tmp / f"{damaged}_export")
        assert not (tmp / f"{damaged}_export").exists()


def test_a_shard_overwritten_at_its_own_size_is_refused_by_its_checksum(hardening):
    """Every file's CRC32 is recorded at save: a shard holding NaNs where the weights were, at its
    own size, is refused by resume (falling back to the checkpoint before), export and
    checkpoint_hf_weights, naming the file (before: NaN weights, exported as a success)."""
    from fullshard.checkpoint import checkpoint_hf_weights

    tmp, results = hardening
    for r in results:
        message = r["nan_shard"]
        assert message.startswith("UnreadableCheckpoint") and str(tmp / "nan_shard" / "step_3") in message, message
        assert ".distcp does not hold the bytes it was saved with" in message, message
        assert r["nan_fallback_step"] == 1 and r["nan_fallback_counter"] == 5, r
        assert r["unsummed_step"] == 3
    warning = " ".join(results[0]["nan_fallback_warning"])
    assert str(tmp / "nan_fallback" / "step_2") in warning and "does not hold the bytes" in warning, warning
    assert len({r["nan_shard"] for r in results}) == 1
    for read in (lambda: export_checkpoint(tmp / "nan_shard", tmp / "nan_export"),
                 lambda: list(checkpoint_hf_weights(tmp / "nan_shard"))):
        with pytest.raises(CheckpointError, match=r"\.distcp does not hold the bytes it was saved with"):
            read()
    assert not (tmp / "nan_export").exists()
    export_checkpoint(tmp / "unsummed", tmp / "unsummed_export")  # saved without sums: exports as before
    assert (tmp / "unsummed_export" / "config.json").is_file()


def test_auto_resume_falls_back_past_an_unreadable_checkpoint(hardening):
    tmp, results = hardening
    for r in results:
        assert r["fallback_step"] == 1 and r["fallback_counter"] == 5
        assert "does not fit this model" in r["no_fallback_on_misfit"], r["no_fallback_on_misfit"]
    warning = " ".join(results[0]["fallback_warning"])
    assert str(tmp / "fallback" / "step_2") in warning and str(tmp / "fallback" / "step_1") in warning, warning
    assert results[1]["fallback_warning"] == []  # said once, by rank 0


def test_checkpoints_are_ordered_by_step(hardening):
    for r in hardening[1]:
        assert r["ordered"] == ["late_step", "early_step"]


def test_every_resolver_finishes_a_commit_interrupted_after_the_discard(hardening):
    tmp, results = hardening
    for r in results:
        for name in ("auto", "load_ckpt_dir", "load_ckpt_path", "latest", "export"):
            assert "killed (injected)" in r[f"crash_{name}"], r[f"crash_{name}"]
            left = r[f"left_{name}"]
            assert "same" not in left and len([n for n in left if n.startswith(layout.TMP_PREFIX + "same-")]) == 1, left
        assert r["resolved_auto"] == r["resolved_load_ckpt_dir"] == r["resolved_load_ckpt_path"] == 2
        assert r["resolved_latest"] == str(tmp / "interrupted" / "latest" / "same")
        for name, names in r["after"].items():
            assert "same" in names and not any(n.startswith(layout.TMP_PREFIX) for n in names), (name, names)
    offline = export_checkpoint(tmp / "interrupted" / "export", tmp / "interrupted_export")
    assert (offline / "model.safetensors").is_file()
    assert json.loads((tmp / "interrupted" / "export" / "same" / "COMPLETE").read_text())["step"] == 2


# ---------------------------------------------------------------------------- async saves at exit

_ASYNC_EXIT_SCRIPT = """
import os, sys, time
from torch.distributed import destroy_process_group as raw_destroy  # bound before any save: no wait in it
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

rank, port, mode, save_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=str(rank))
dist.init_process_group("gloo")
from fullshard.checkpoint import CheckpointManager

if mode == "raw_destroy":  # the background write is still running when the group goes
    from torch.distributed.checkpoint import FileSystemWriter
    write_data = FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, plan, planner: (time.sleep(3), write_data(self, plan, planner))[1]
torch.manual_seed(0)
model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 8)))
manager = CheckpointManager(save_dir, async_save=True)
manager.save(1, model)
manager.save(2, model)
(raw_destroy if mode == "raw_destroy" else dist.destroy_process_group)()
print("script end", flush=True)
"""


# Python 3.11 ends a C++ thread that wants the GIL during interpreter finalization with pthread_exit;
# when gloo's worker thread drops its last tensor reference then, the forced unwind aborts the process
# with this line and nothing else (pytorch/pytorch#179291). It is rare (seen once in CI, never in 27
# local repeats) and not fullshard's; a run it hit is repeated once, and the repeat is judged strictly.
_TEARDOWN_ABORT = "terminate called without an active exception"


def _run_two_ranks(tmp_path: Path, mode: str) -> list:
    results = _spawn_two_ranks(tmp_path, mode)
    if any(rc == -6 and err.strip() == _TEARDOWN_ABORT for rc, _, err in results):
        shutil.rmtree(tmp_path / mode)
        results = _spawn_two_ranks(tmp_path, mode)
    return [(rc, err) for rc, _, err in results]


def _spawn_two_ranks(tmp_path: Path, mode: str) -> list:
    import subprocess
    import sys

    from fullshard.distributed import find_free_port

    script = tmp_path / "script.py"
    script.write_text(_ASYNC_EXIT_SCRIPT)
    port, save_dir = str(find_free_port()), tmp_path / mode
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, mode, str(save_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def test_an_async_save_pending_at_destroy_process_group_is_committed(tmp_path):
    """The script ends with destroy_process_group() and no wait(): step 2 is committed, exit 0."""
    from fullshard.safe_dcp import read_dcp_metadata

    results = _run_two_ranks(tmp_path, "destroy")
    assert [rc for rc, _ in results] == [0, 0], results
    step_2 = tmp_path / "destroy" / "step_2"
    assert json.loads((step_2 / "COMPLETE").read_text())["step"] == 2
    assert layout.index_gaps(read_dcp_metadata(step_2 / "state")) == []
    assert sorted(p.name for p in (tmp_path / "destroy").iterdir()) == ["latest", "step_1", "step_2"]


def test_an_async_save_lost_at_exit_is_reported_with_a_non_zero_exit(tmp_path):
    """The group is destroyed (by a destroy bound before fullshard could wait in it) while step 2 is
    still being written. Whether DCP had agreed its global plan before the group went depends on
    timing, so two outcomes are right and a third is the bug: step 2 committed whole with every rank
    exiting 0, or every rank exiting non-zero naming step 2 with nothing of it committed; never a
    silent loss or a half checkpoint."""
    from fullshard.safe_dcp import read_dcp_metadata

    results = _run_two_ranks(tmp_path, "raw_destroy")
    step_2 = tmp_path / "raw_destroy" / "step_2"
    assert (tmp_path / "raw_destroy" / "step_1" / "COMPLETE").is_file()
    if step_2.exists():  # committed: complete, every byte its index names on disk
        assert json.loads((step_2 / "COMPLETE").read_text())["step"] == 2
        metadata = read_dcp_metadata(step_2 / "state")
        assert layout.index_gaps(metadata) == []
        for item in metadata.storage_data.values():
            assert (step_2 / "state" / item.relative_path).stat().st_size >= item.offset + item.length
        # a rank that could not confirm the commit itself says so rather than exiting quietly
        for rc, stderr in results:
            assert rc == 0 or ("async checkpoint save of step 2" in stderr and "was lost" in stderr), results
        return
    for rank, (rc, stderr) in enumerate(results):
        assert rc == 1 and "async checkpoint save of step 2" in stderr and "was lost" in stderr, (rank, rc, stderr[-2000:])


def test_strategy_state_is_saved_once_through_states(hardening):
    for r in hardening[1]:
        loaded, saved = r["strategy_state"]
        assert loaded == saved and saved["scaler"]["scale"] == 1024.0 and saved["micro_step"] == 7
        assert r["strategy_client"] == {"global_step": 4, "step": 4} and r["strategy_json"] == {"global_step": 4}
        assert "states.strategy.scaler.scale" in r["strategy_keys"] and "states.strategy.micro_step" in r["strategy_keys"]
        assert not any("scaler" in name for name in r["strategy_files"]), r["strategy_files"]


# ---------------------------------------------------------------------------- the direct shard reader


def test_whole_chunks_are_read_straight_into_place_and_the_rest_through_dcp(tmp_path, monkeypatch):
    """Contiguous whole chunks take the one-copy path; a transposed (non-contiguous) record and a
    byte entry go through DCP's reader; every value arrives exact. (Parts of a chunk, read when
    loading at another world size, are covered by the resharding tests.)"""
    import torch.distributed.checkpoint as dcp

    from fullshard.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    torch.manual_seed(0)
    saved = {"w": torch.randn(6, 5), "bf16": torch.randn(7).bfloat16(), "transposed": torch.randn(4, 3).t(),
             "empty": torch.zeros(0, 3), "step": 11}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    direct = []
    original = SafeFileSystemReader._read_whole_chunks

    def counting(self, file, items, planner):
        rest = original(self, file, items, planner)
        direct.extend(sorted(i.dest_index.fqn for i in items if i not in rest))
        return rest

    target = {"w": torch.empty(6, 5), "bf16": torch.empty(7, dtype=torch.bfloat16),
              "transposed": torch.empty(3, 4), "empty": torch.empty(0, 3), "step": 0}
    monkeypatch.setattr(SafeFileSystemReader, "_read_whole_chunks", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert direct == ["bf16", "w"]
    for key in ("w", "bf16", "transposed", "empty"):
        assert torch.equal(target[key], saved[key]), key
    assert target["step"] == 11
