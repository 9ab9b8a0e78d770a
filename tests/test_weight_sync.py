"""WeightSync: 2 trainer ranks (FSDP) push to 2 engine processes holding plain transformers models.

One spawned trainer group and two engine processes run three rendezvous in turn: two pushes with
training between them (each engine equals the export bitwise, same logits, version 2 follows
version 1; the second in buckets smaller than most tensors), a receiver that rejects a name (the
named error on every side, nothing of it applied), and an engine killed between pushes (the next
push raises on every trainer rank).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fullshard.testing import build_model, make_batch, run_distributed

NAME = "llama"
HOST = "127.0.0.1"
TIMEOUT_KILL = 5


def _train_step(strategy, model, optimizer, seed: int) -> None:
    batch = make_batch(NAME, batch_size=2, seed=seed)
    rank = torch.distributed.get_rank()
    rows = {k: v[rank:rank + 1] for k, v in batch.items()}
    strategy.backward(model(**rows).loss, model, optimizer)
    strategy.optimizer_step(optimizer, model)


def _trainer(ports: list[int], out: str) -> dict:
    from fullshard import FSDPStrategy, export_hf
    from fullshard.errors import WeightSyncError
    from fullshard.weight_sync import WeightSync

    out = Path(out)
    strategy = FSDPStrategy(train_batch_size=2, micro_train_batch_size=1, bf16=False)
    model = strategy.prepare_model(build_model(NAME), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-2)
    result = {}

    sync = WeightSync.trainer(HOST, ports[0], num_engines=2, timeout_s=60)
    reports = [sync.push(model)]
    export_hf(model, out / "export1")
    _train_step(strategy, model, optimizer, seed=1)
    reports.append(sync.push(model, bucket_bytes=4096))  # many buckets: both bucket buffers, and the one for larger tensors
    export_hf(model, out / "export2")
    result["reports"] = [vars(r) for r in reports]

    _train_step(strategy, model, optimizer, seed=2)  # what the rejected push carries differs from export2
    rejecting = WeightSync.trainer(HOST, ports[1], num_engines=2, timeout_s=60)
    try:
        rejecting.push(model)
        result["reject"] = None
    except WeightSyncError as err:
        result["reject"] = str(err)

    dying = WeightSync.trainer(HOST, ports[2], num_engines=2, timeout_s=TIMEOUT_KILL)
    dying.push(model)
    try:
        dying.push(model)  # engine 1 exited after the first
        result["kill"] = None
    except WeightSyncError as err:
        result["kill"] = str(err)
    return result


def _engine(engine_rank: int, ports: list[int], out: str) -> None:
    from fullshard.errors import WeightSyncError
    from fullshard.weight_sync import WeightSync, weight_loader

    torch.set_num_threads(1)
    out = Path(out)
    model = build_model(NAME, seed=100 + engine_rank).eval()  # other weights than the trainer's
    loader = weight_loader(model)
    batch = make_batch(NAME, batch_size=2, seed=7)
    record = {}

    sync = WeightSync.engine(HOST, ports[0], engine_rank, num_engines=2, timeout_s=60)
    for version in (1, 2):
        report = sync.pull(loader)
        record[f"report{version}"] = vars(report)
        save_file({k: v.clone() for k, v in model.state_dict().items()}, out / f"engine{engine_rank}_v{version}.safetensors")
        with torch.no_grad():
            torch.save(model(batch["input_ids"]).logits, out / f"engine{engine_rank}_v{version}_logits.pt")

    def renaming(weights):  # engine 1's loader: a model whose final norm has another name
        return loader((n.replace("model.norm.", "model.final_norm.") if engine_rank == 1 else n, t) for n, t in weights)

    rejecting = WeightSync.engine(HOST, ports[1], engine_rank, num_engines=2, timeout_s=60)
    try:
        rejecting.pull(renaming)
    except WeightSyncError as err:
        record["reject"] = str(err)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, out / f"engine{engine_rank}_reject.safetensors")

    dying = WeightSync.engine(HOST, ports[2], engine_rank, num_engines=2, timeout_s=TIMEOUT_KILL)
    dying.pull(loader)
    if engine_rank == 1:
        (out / "engine1.json").write_text(json.dumps(record))
        os._exit(0)  # dies between pushes, the store and group connections dropped with it
    try:
        dying.pull(loader)
    except WeightSyncError as err:
        record["kill"] = str(err)
    (out / f"engine{engine_rank}.json").write_text(json.dumps(record))


def _engine_main(engine_rank: int, ports: list[int], out: str) -> None:
    os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    try:
        _engine(engine_rank, ports, out)
    except BaseException as err:  # the test reads it
        Path(out, f"engine{engine_rank}.error").write_text(f"{type(err).__name__}: {err}")
        raise


def test_weight_sync_to_two_engines(tmp_path):
    from transformers import AutoModelForCausalLM

    from fullshard.distributed import find_free_port

    ports = [find_free_port() for _ in range(3)]
    context = multiprocessing.get_context("spawn")
    engines = [context.Process(target=_engine_main, args=(e, ports, str(tmp_path)), daemon=True) for e in range(2)]
    for process in engines:
        process.start()
    try:
        results = run_distributed(_trainer, 2, ports, str(tmp_path), timeout=400)
    finally:
        for process in engines:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.error")}
    assert not errors, errors
    records = [json.loads((tmp_path / f"engine{e}.json").read_text()) for e in range(2)]
    batch = make_batch(NAME, batch_size=2, seed=7)

    for version in (1, 2):
        exported = load_file(tmp_path / f"export{version}" / "model.safetensors")
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(tmp_path / f"export{version}")(batch["input_ids"]).logits
        for e in range(2):
            state = load_file(tmp_path / f"engine{e}_v{version}.safetensors")
            assert state.keys() == exported.keys()
            assert all(torch.equal(state[k], exported[k]) for k in exported), f"engine {e} differs from export {version}"
            torch.testing.assert_close(torch.load(tmp_path / f"engine{e}_v{version}_logits.pt"), logits, rtol=0, atol=1e-6)
            report = records[e][f"report{version}"]
            assert report["version"] == version and report["tensors"] == len(exported)
            assert report["bytes"] == sum(t.numel() * t.element_size() for t in exported.values())
        for rank in range(2):
            sent = results[rank]["reports"][version - 1]
            assert (sent["version"], sent["tensors"], sent["bytes"]) == (version, len(exported), records[0][f"report{version}"]["bytes"])
    assert not torch.equal(load_file(tmp_path / "export1" / "model.safetensors")["model.norm.weight"],
                           load_file(tmp_path / "export2" / "model.safetensors")["model.norm.weight"])

    # a rejected name: the named error on both trainer ranks and both engines; the rejecting engine kept v2
    for message in [results[0]["reject"], results[1]["reject"], records[0]["reject"], records[1]["reject"]]:
        assert message is not None and "engine 1" in message and "model.final_norm.weight" in message, message
    kept = load_file(tmp_path / "engine1_reject.safetensors")
    v2 = load_file(tmp_path / "engine1_v2.safetensors")
    assert all(torch.equal(kept[k], v2[k]) for k in v2), "a rejected push changed the engine's weights"

    # a dead engine: the next push raises on every trainer rank (and the live engine's pull raises too)
    for rank in range(2):
        assert results[rank]["kill"] is not None and "engines [1]" in results[rank]["kill"], results[rank]["kill"]
    assert "push 2" in records[0]["kill"], records[0]["kill"]


def test_a_corrupted_bucket_names_the_tensor():
    from fullshard.errors import WeightSyncError
    from fullshard.weight_sync import checksums, pack_bucket, unpack_bucket

    pairs = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.int64)),
             ("c.weight", torch.randn(7, dtype=torch.bfloat16))]
    kept = torch.full((1000,), 7, dtype=torch.uint8)  # a buffer kept from an earlier bucket, dirty
    header, payload = pack_bucket(pairs, torch.device("cpu"), kept)
    assert payload.data_ptr() == kept.data_ptr()
    sent = checksums(payload, header).tolist()
    unpacked = unpack_bucket(header, payload.clone(), sent)
    assert [n for n, _ in unpacked] == [n for n, _ in pairs]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(unpacked, pairs))
    lone = [("d.weight", torch.randn(4, 8))]  # one tensor: sent from where it lies
    lone_header, lone_payload = pack_bucket(lone, torch.device("cpu"), kept)
    assert lone_payload.data_ptr() == lone[0][1].data_ptr()
    lone_sums = checksums(lone_payload, lone_header).tolist()
    assert torch.equal(unpack_bucket(lone_header, lone_payload, lone_sums)[0][1], lone[0][1])
    flat = torch.zeros(256, dtype=torch.uint8)  # tensors laid out in one buffer (a bucket hf_weights put together)
    together = [("e", flat[32:64].view(torch.float32)), ("f", flat[80:86].view(torch.bfloat16)),
                ("g", flat[96:160].view(torch.int64))]
    together_header, together_payload = pack_bucket(together, torch.device("cpu"), kept)
    assert together_payload.data_ptr() == flat.data_ptr() + 32 and together_header["offsets"] == [0, 48, 64]
    for corrupt, name in [(pairs[1], "b.bias"), (together[1], "f")]:
        h, p = (header, payload) if corrupt is pairs[1] else (together_header, together_payload)
        good = checksums(p, h).tolist()
        offset = h["offsets"][h["names"].index(name)]
        p[offset + 1] ^= 1
        with pytest.raises(WeightSyncError, match=f"checksum mismatch for '{name}'"):
            unpack_bucket(h, p, good)


def test_weight_loader_refuses_by_name_before_copying():
    from fullshard.errors import WeightSyncError
    from fullshard.weight_sync import weight_loader

    model = build_model(NAME)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load = weight_loader(model)
    good = ("model.norm.weight", torch.zeros(32))
    for bad, match in [(("model.nope", torch.zeros(1)), "'model.nope' is not a parameter"),
                       (("lm_head.weight", torch.zeros(3, 3)), "'lm_head.weight': received \\(3, 3\\)"),
                       (("model.norm.weight", torch.zeros(32, dtype=torch.float16)), "torch.float16")]:
        with pytest.raises(WeightSyncError, match=match):
            load([good, bad])
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert load([good]) == {"model.norm.weight"}
    assert torch.equal(model.model.norm.weight, torch.zeros(32))


def test_one_process_trainer_without_a_process_group():
    """A plain model in one process with no process group pushes to an engine (here a thread)."""
    import threading

    import fullshard
    from fullshard.distributed import find_free_port

    model, engine_model, port, pulled = build_model(NAME), build_model(NAME, seed=3), find_free_port(), []
    thread = threading.Thread(target=lambda: pulled.append(
        fullshard.WeightSync.engine(HOST, port, engine_rank=0, num_engines=1).pull(fullshard.weight_loader(engine_model))))
    thread.start()
    report = fullshard.WeightSync.trainer(HOST, port, num_engines=1).push(model, bucket_bytes=4096)
    thread.join(timeout=60)
    assert pulled and pulled[0].tensors == report.tensors == len(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), engine_model.state_dict().values()))
