"""Checkpoints resume exactly (same and other world sizes), survive a rank killed mid-save, rotate
safely, reject bad input on every rank, and export to directories plain transformers loads."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from fullshard import FSDP2Engine
from fullshard.checkpoint import CheckpointManager, export_checkpoint, export_hf, load_ckpt, save_ckpt
from fullshard.checkpoint import layout
from fullshard.distributed import get_rank
from fullshard.testing import reported_by_every_rank, run_distributed
from fullshard.testing.compare import full_state, full_tensor
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

    # async: training right after save() must not leak into the checkpoint
    async_manager = CheckpointManager(tmp / "async", async_save=True)
    async_manager.save(K, model, optimizer, scheduler)
    _train(model, optimizer, scheduler, 1)
    async_manager.wait()
    fresh, fresh_opt, fresh_sched = _setup(seed=5)
    async_manager.load(fresh, fresh_opt, fresh_sched)
    reloaded = _full_train_state(fresh, fresh_opt)
    out["async_equal"] = sorted(k for k in saved if not torch.equal(saved[k], reloaded[k]))
    out["async_keys_match"] = set(saved) == set(reloaded)

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
    import warnings

    tmp = Path(tmp)
    model, optimizer, scheduler = _setup(seed=321)
    manager = CheckpointManager(tmp / "resume")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = manager.load(model, optimizer, scheduler)
    saved = torch.load(tmp / "saved_state.pt", weights_only=True)
    loaded = _full_train_state(model, optimizer)
    losses = _train(model, optimizer, scheduler, 2)
    return _pack({"extra": extra, "info": manager.last_load_info, "keys_match": set(saved) == set(loaded),
                  "different": sorted(k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k])),
                  "warned": any("re-seeded" in str(w.message) for w in caught), "losses": losses})


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
        assert r["warned"] == (rank == 0)
        assert r["extra"]["data_position"] == K * 4
        assert all(torch.isfinite(torch.tensor(r["losses"])))


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
