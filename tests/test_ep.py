"""Expert parallelism against one process on the whole batch: every MoE family transformers builds small,
ep 2 (experts further sharded over 2 efsdp ranks) and ep 4, AdamW with global clipping, experts that get
no token, each rank's share of the experts, compiled blocks, and bad input refused on every rank: one 4-rank
group; then the command's runs at ep 2 on 4 ranks, resumed on 2 without ep, against the group's ep 1 trainer run."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.compare import parity_problems, train_against_reference
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fullshard import FSDP2Engine
from fullshard.errors import ConfigError, PlanError
from fullshard.lora import apply_lora
from fullshard.parallel.ep import find_experts, owned_experts
from fullshard.testing import build_model, reported_by_every_rank, run_distributed
from fullshard.testing.zoo import MOE_ZOO

TOL = 1e-5
MAX_NORM = 0.1  # below every first grad norm here (0.16 with LoRA, 1 to 2 in full), so clipping acts on every step
FAMILIES = sorted(MOE_ZOO)
EP4_FAMILIES = ["ep_mixtral", "ep_gpt_oss", "ep_deepseek_v3"]  # fused with and without biases, shared experts


def route_to_expert_0_and_1(model):
    """Every router picks only experts 0 and 1: at ep 4 three ranks of four receive no token."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda mod, args, out: (out[0], out[1], out[2].clamp(max=1)))
    return model


def _expert_shares(model) -> dict[str, tuple[int, int, range, tuple, bool]]:
    """Each experts tensor's (elements this rank holds, elements of the whole tensor, experts its rows are,
    its mesh's dim names, whether its experts module is an FSDP unit)."""
    modules = dict(model.named_modules())
    shares = {}
    for entry in find_experts(model):
        for p in entry.params:
            param = getattr(modules[entry.name], p)
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            shares[f"{entry.name}.{p}"] = (param.to_local().numel(), param.numel(), range(offset[0], offset[0] + shape[0]),
                                           param.device_mesh.mesh_dim_names, isinstance(modules[entry.name], FSDPModule))
    return shares


def _train(engine, name, **kwargs):
    return train_against_reference(name, engine.prepare_model, max_norm=MAX_NORM, inspect=_expert_shares, **kwargs)


def _refused(make) -> str | None:
    try:
        make()
    except (ConfigError, PlanError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _checkpoint_checks(root: str, ep: int) -> dict:
    """Load a per-expert HF checkpoint at `ep` (only this rank's experts read), train, save (DCP) and
    export; resume the save at ep 1, export it offline in this one process, load the exports in
    transformers."""
    import transformers
    from harness.compare import full_state, step_on_slice

    from fullshard import from_pretrained
    from fullshard.checkpoint import CheckpointManager, export_checkpoint, export_hf
    from fullshard.checkpoint.export import own_rows
    from fullshard.testing import make_batch

    root, name, rank, out = Path(root) / f"ep{ep}", "ep_mixtral", dist.get_rank(), {}
    if rank == 0:
        build_model(name, seed=3).save_pretrained(root / "hf")  # transformers writes experts one per key
    dist.barrier()
    reference = transformers.MixtralForCausalLM.from_pretrained(root / "hf")
    model = from_pretrained(str(root / "hf"), engine=FSDP2Engine({"ep_size": ep}))
    out["loaded_equal"] = _equal(full_state(model), dict(reference.named_parameters()))
    experts = {f"{e.name}.{p}" for e in find_experts(model) for p in e.params}
    allowance = 0
    for key, tensor in model.state_dict().items():
        size = tensor.numel() * tensor.element_size()
        allowance += size // (ep if key in experts else 4) + size // tensor.shape[0]
    out["bytes_read"], out["allowance"] = model.fullshard_load_report.bytes_read, allowance

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    batch = make_batch(name, seed=5)

    step_on_slice(model, optimizer, batch)
    CheckpointManager(root / "ckpt").save(1, model, optimizer=optimizer)
    export_hf(model, root / "export")
    out["experts_gathered"] = sorted(k for k, t in model.state_dict().items() if k in experts and own_rows(t) is None)
    resumed = FSDP2Engine({}).prepare_model(build_model(name, seed=9))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3, eps=1e-6)
    CheckpointManager(root / "ckpt").load(resumed, optimizer=resumed_optimizer)
    trained = full_state(model)
    out["resumed_equal"] = _equal(full_state(resumed), trained)
    out["next_losses"] = (step_on_slice(model, optimizer, batch), step_on_slice(resumed, resumed_optimizer, batch))
    out["next_weight_diff"] = max((full_state(model)[k] - v).abs().max().item() for k, v in full_state(resumed).items())
    if rank == 0:
        export_checkpoint(root / "ckpt", root / "offline")  # one process, no group: the stored tensors are global
        offline = transformers.MixtralForCausalLM.from_pretrained(root / "offline")
        out["offline_equal"] = _equal(trained, dict(offline.named_parameters()))
        exported = transformers.MixtralForCausalLM.from_pretrained(root / "export")
        out["export_equal"] = _equal(trained, dict(exported.named_parameters()))
    return out


def _trainer_args(root: Path) -> list[str]:
    return [f"--model.name_or_path={root}/moe", f"--data.path={root}/doc.txt", "--data.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=8", "--train.steps=4", "--train.log_every=1",
            "--train.plot=false", "--train.max_norm=0.5", "--checkpoint.every=2"]


def _trainer_reference(root: str) -> dict:
    """The trainer on a local tiny Mixtral, 4 steps at ep 1 (the run the ep runs must equal); then
    what `fullshard train --nproc 4 --fsdp.ep_size=2` runs on each of its ranks, in this group."""
    from fullshard.data.builtin import byte_tokenizer

    root = Path(root)
    if dist.get_rank() == 0:
        build_model("ep_mixtral", vocab_size=257, max_position_embeddings=32).save_pretrained(root / "moe")
        byte_tokenizer().save_pretrained(root / "moe")
        (root / "doc.txt").write_text("".join(f"w{(i * 7919) % 613} " for i in range(2000)))
    dist.barrier()
    reference = _train_as_command(root, [f"--train.output_dir={root}/ep1"])
    _train_as_command(root, ["--nproc=4", "--fsdp.ep_size=2", f"--train.output_dir={root}/cli_ep2"])
    return reference


def _train_as_command(root: Path, extra: list[str]) -> dict:
    """`fullshard train <_trainer_args> <extra>` on this rank: the command's parsing and batch checks, then train()."""
    from fullshard.cli import parse_train_args
    from fullshard.train import load_config, train

    args = parse_train_args([*_trainer_args(root), *extra])
    config = load_config(args.config_path, args.overrides)
    config.accumulation_steps(dist.get_world_size())
    return train(config)


def _resumed_without_ep(root: str) -> dict:
    """The ep 2 run's step-2 checkpoint continued on 2 ranks without ep (as `--nproc 2` would)."""
    root = Path(root)
    return _train_as_command(root, ["--nproc=2", f"--checkpoint.resume={root}/cli_ep2/checkpoints/step_2",
                                    f"--train.output_dir={root}/cli_resumed"])


def _equal(state: dict, reference: dict) -> list[str]:
    """The names whose tensors differ (or are missing on one side)."""
    return sorted(k for k in state.keys() | reference.keys()
                  if k not in state or k not in reference or not torch.equal(state[k], reference[k].detach()))


def _world_4_checks(root: str):
    results = {}
    for ep, families in ((2, FAMILIES), (4, EP4_FAMILIES)):
        engine = FSDP2Engine({"mixed_precision": "fp32", "ep_size": ep})
        for name in families:
            results[(ep, name)] = _train(engine, name)
        results[(ep, "idle_experts")] = _train(engine, "ep_qwen3_moe", prepare=route_to_expert_0_and_1, steps=2)
    engine = FSDP2Engine({"mixed_precision": "fp32", "ep_size": 2})
    results[(2, "router_aux_loss")] = _train(engine, "ep_mixtral", steps=3,
                                             model_kwargs=dict(output_router_logits=True, router_aux_loss_coef=0.1))
    results[(2, "lora_on_attention")] = _train(engine, "ep_qwen3_moe", steps=2, check_tie=False, prepare=lambda m: apply_lora(
        m, {"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    checkpointing = FSDP2Engine({"mixed_precision": "fp32", "ep_size": 2, "activation_checkpointing": True})
    results[(2, "activation_checkpointing")] = _train(checkpointing, "ep_qwen3_moe", steps=2)
    compiled = {(ep, name): train_against_reference(name, FSDP2Engine({"mixed_precision": "fp32", "ep_size": ep,
                                                                       "compile": True}).prepare_model,
                                                    steps=2, max_norm=MAX_NORM)
                for ep, name in ((2, "ep_qwen3_moe"), (4, "list_mixtral"))}
    errors = {
        "ep_not_dividing": _refused(lambda: FSDP2Engine({"ep_size": 3})),
        "experts_not_dividing": _refused(
            lambda: FSDP2Engine({"ep_size": 4}).prepare_model(build_model("ep_mixtral", num_local_experts=6))),
        "dense_model": _refused(lambda: FSDP2Engine({"ep_size": 2}).prepare_model(build_model("llama"))),
        "with_tp": _refused(lambda: FSDP2Engine({"ep_size": 2, "tp_size": 2})),
    }
    bf16 = FSDP2Engine({"mixed_precision": "bf16", "ep_size": 4})
    results[(4, "bf16")] = _train(bf16, "ep_qwen3_moe", steps=2)
    return {"parity": results, "compiled": compiled, "errors": errors, "trainer": _trainer_reference(root),
            "checkpoint": {ep: _checkpoint_checks(root, ep) for ep in (2, 4)}, "root": root}


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    return run_distributed(_world_4_checks, 4, str(tmp_path_factory.mktemp("ep")))


def test_ep_matches_single_process_for_every_moe_family(world_4):
    bad = parity_problems([r["parity"] for r in world_4], TOL, MAX_NORM, skip=[(4, "bf16")])
    assert not bad, "\n".join(bad)


def test_compiled_blocks_compose_with_ep(world_4):
    """Compiled blocks run the dispatch eagerly (it reads split sizes on the host), the rest compiled:
    fused experts at ep 2 and a per-expert list at ep 4 equal one eager process."""
    bad = parity_problems([r["compiled"] for r in world_4], TOL, MAX_NORM, complete=False)
    assert not bad, "\n".join(bad)


def test_each_rank_holds_its_experts_share(world_4):
    """ep 2 on 4 ranks: a quarter of each experts tensor (the 4 experts of its ep rank, halved again by
    efsdp 2, its own FSDP unit); ep 4: its 2 whole experts of 8, which no other rank holds, so FSDP
    leaves them alone (no unit gathers a second copy of them or reduce-scatters their gradient). The
    rows held lie inside the experts its ep rank owns."""
    for rank, result in enumerate(world_4):
        for (ep, name), r in result["parity"].items():
            shares = r["inspect"]
            assert shares, (ep, name)
            owned = owned_experts(8, ep, rank % ep)
            for param, (local, whole, rows, mesh_dims, own_unit) in shares.items():
                assert local * 4 == whole, (ep, name, param, local, whole)
                assert len(rows) == 8 // 4 and rows.start in owned and rows[-1] in owned, (ep, name, param, rows)
                assert (mesh_dims, own_unit) == ((("efsdp", "ep"), True) if ep == 2 else (("ep",), False)), \
                    (ep, name, param, mesh_dims, own_unit)


def test_bf16_experts_kept_whole_compute_in_bf16(world_4):
    """ep 4 (efsdp 1) in bf16: the experts FSDP leaves alone are cast to bf16 by the dispatch; losses
    stay within bf16 rounding of one fp32 process."""
    for result in world_4:
        r = result["parity"][(4, "bf16")]
        assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < 2e-2, (r["loss"], r["ref_loss"])


def test_bad_ep_input_refused_on_every_rank(world_4):
    expected = {
        "ep_not_dividing": "ConfigError: ep_size=3 does not divide the data-parallel shard size dp_shard=4",
        "experts_not_dividing": "num_experts=6, not divisible by ep_size",
        "dense_model": "ep_size=2 but LlamaForCausalLM has no MoE experts to split",
        "with_tp": "ConfigError: ep_size=2 does not compose with tp=2 yet",
    }
    for result in world_4:
        for key, text in expected.items():
            message = result["errors"][key]
            assert message is not None and text in message, (key, message)
            if key not in ("ep_not_dividing", "with_tp"):  # those raised by every rank alone, before any collective
                assert reported_by_every_rank(message, 4), message


def test_ep_loads_saves_resumes_and_exports_global_experts(world_4):
    """Per-expert HF weights load into fused experts at ep 2 reading about this rank's share; the DCP
    save resumes at ep 1 bit for bit and continues like the run that saved it; both the live export
    (no rank gathering all experts) and the offline one (one process) load in transformers unchanged."""
    for rank, result in enumerate(world_4):
        for ep, r in result["checkpoint"].items():
            assert r["loaded_equal"] == [], (ep, r["loaded_equal"])
            assert r["bytes_read"] <= r["allowance"], (ep, rank, r["bytes_read"], r["allowance"])
            assert r["experts_gathered"] == [], (ep, r["experts_gathered"])  # each rank wrote its own experts' rows
            assert r["resumed_equal"] == [], (ep, r["resumed_equal"])
            assert abs(r["next_losses"][0] - r["next_losses"][1]) < TOL and r["next_weight_diff"] < TOL, (ep, r)
    for ep, r in world_4[0]["checkpoint"].items():
        assert r["offline_equal"] == [] and r["export_equal"] == [], ep


def test_cli_at_ep_2_trains_the_ep_1_losses_resumes_on_2_ranks_without_ep_and_exports(world_4):
    """`fullshard train --nproc 4 --fsdp.ep_size=2` trains the losses of the ep 1 run; its step-2
    checkpoint, resumed by `--nproc 2` without ep, continues with them; its export (written at ep 2,
    no rank gathering all experts) loads in transformers with the logits of the ep 1 run's export.
    Both runs go through the command's rank side (`_train_as_command`): the ep 2 run in the 4-rank
    group, the resumed one in a 2-rank group (test_cli launches the command itself)."""
    import transformers

    from fullshard.train.metrics import read_metrics

    root, whole = Path(world_4[0]["root"]), world_4[0]["trainer"]["losses"]
    run_distributed(_resumed_without_ep, 2, str(root))
    losses = {}
    for run in ("cli_ep2", "cli_resumed"):
        losses[run] = {r["step"] - 1: r["loss"] for r in read_metrics(root / run / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(losses["cli_ep2"]) == sorted(whole) == [0, 1, 2, 3] and sorted(losses["cli_resumed"]) == [2, 3]
    for run, trained in losses.items():
        assert max(abs(loss - whole[step]) for step, loss in trained.items()) < TOL, (run, trained, whole)
    assert whole[3] < whole[0]
    ids = torch.arange(3, 35).view(2, 16)
    logits = {run: transformers.MixtralForCausalLM.from_pretrained(root / run / "hf")(ids).logits
              for run in ("ep1", "cli_ep2")}
    assert (logits["ep1"] - logits["cli_ep2"]).abs().max() < 1e-4


def test_plan_shows_owners_and_memory_estimate_gathers_only_own_experts():
    from fullshard.parallel.ep import expert_owners
    from fullshard.plan import build_plan
    from fullshard.train.memory import estimate_memory

    model = build_model("ep_qwen3_moe")
    lines = expert_owners(model, 2)
    assert "experts 0-3 of 8" in lines[0] and "experts 4-7 of 8" in lines[1], lines
    plan = build_plan(model, "auto")
    whole, split, kept = (estimate_memory(model, plan, 4, 1, 16, device_type="cpu", ep_size=ep) for ep in (1, 2, 4))
    layer = {n: p.numel() * 4 for n, p in model.named_parameters() if n.startswith("model.layers.0.")}
    experts = sum(size for n, size in layer.items() if ".mlp.experts." in n)
    assert whole.largest_unit == sum(layer.values())
    assert split.largest_unit == max(sum(layer.values()) - experts, experts // 2)
    assert kept.largest_unit == sum(layer.values()) - experts  # ep 4 of 4 ranks: experts never gathered
    assert split.parameters == whole.parameters == kept.parameters  # an expert's shard is 1/4 of it either way


def test_per_expert_module_list_moe_accepted_and_checked_by_name():
    """Per-expert ModuleList MoEs are split too (`tests/test_ep_lists.py`); their expert count is checked."""
    from torch import nn

    from fullshard.parallel.ep import check_expert_parallel

    class RemoteCodeMoE(nn.Module):  # a block that loops over its experts itself, as remote-code MoEs do
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    model = nn.Sequential(RemoteCodeMoE())
    assert check_expert_parallel(model, 2) == []  # no fused experts module; the list is ep_lists' to split
    with pytest.raises(PlanError, match=r"0.experts has num_experts=4, not divisible by ep_size"):
        check_expert_parallel(model, 3)


def test_lora_on_expert_tensors_refused_by_name():
    from fullshard.parallel.ep import check_expert_parallel

    model = apply_lora(build_model("ep_qwen3_moe"), {"r": 2, "target_modules": [],
                                                     "target_parameters": ["mlp.experts.gate_up_proj"]})
    with pytest.raises(PlanError, match="layers.0.mlp.experts.base_layer carries LoRA adapters"):
        check_expert_parallel(model, 2)
