"""Expert parallelism for MoEs that keep one module per expert (a `ModuleList` their block loops over,
`fullshard.parallel.ep_lists`), against one process on the whole batch: ep 2 (experts further
sharded over 2 efsdp ranks) and ep 4 on 4 ranks, AdamW with global clipping, blocks that call every
expert or only those with tokens, a shared expert, experts no token reaches, activation
checkpointing, router jitter; each rank holding its own experts' names only; loading, saving,
resuming without ep and exporting; and plain FSDP (ep 1) on a block skipping experts without tokens,
whose ranks call different experts. One 4-rank group."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.compare import parity_problems, train_against_reference
from torch.distributed.tensor import DTensor

from fullshard import FSDP2Engine
from fullshard.errors import PlanError
from fullshard.parallel.ep import owned_experts
from fullshard.tensors import replicated
from fullshard.testing import build_model, make_batch, run_distributed

TOL = 1e-5
MAX_NORM = 0.1  # below every first grad norm here (about 1.2), so clipping acts on every step
EXPERTS = 8
LIST_FAMILIES = ["list_mixtral", "list_skip_idle", "list_shared"]


def route_to_expert_0_and_1(model):
    """Every router picks only experts 0 and 1: at ep 4 three ranks of four receive no row."""
    bias = torch.tensor([50.0, 50.0] + [0.0] * (EXPERTS - 2))
    for name, module in model.named_modules():
        if name.endswith("block_sparse_moe.gate"):
            module.register_forward_hook(lambda mod, args, out: out + bias)
    return model


def route_by_call_count(model):
    """A router that changes its mind from one call to the next (odd calls pick experts 0 and 1, even
    ones 6 and 7): a block whose two passes route differently."""
    calls = [0]

    def hook(module, args, out):
        calls[0] += 1
        return out + torch.tensor([50.0, 50.0] + [0.0] * (EXPERTS - 2)).roll(6 * (calls[0] % 2))

    for name, module in model.named_modules():
        if name.endswith("block_sparse_moe.gate"):
            module.register_forward_hook(hook)
    return model


def route_around_experts_6_and_7(model):
    """Expert 7 gets no token anywhere; expert 6 only the tokens of one id found in the first sequence
    of the batch alone, so, one sequence per rank, only on rank 0 (the router reads the batch's ids,
    which a forward pre-hook on the model keeps)."""
    batch = make_batch("list_skip_idle", seed=100)["input_ids"]  # train_against_reference's batch
    token = next(t for t in batch[0].tolist() if t not in batch[1:])
    ids = []

    def keep_ids(module, args, kwargs):
        ids[:] = [kwargs["input_ids"]]

    model.register_forward_pre_hook(keep_ids, with_kwargs=True)
    bias = torch.tensor([0.0] * (EXPERTS - 2) + [-50.0, -50.0])
    boost = torch.tensor([0.0] * (EXPERTS - 2) + [100.0, 0.0])

    def hook(module, args, out):
        return out + bias + (ids[0].reshape(-1, 1) == token) * boost

    for name, module in model.named_modules():
        if name.endswith("block_sparse_moe.gate"):
            module.register_forward_hook(hook)
    return model


def expert_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _held_experts(model, initial: dict) -> dict[str, tuple[int, int, bool]]:
    """Each expert parameter this rank holds: (elements held here, elements of the whole tensor,
    whether training moved it from `initial`)."""
    held = {}
    for name, param in model.named_parameters():
        if expert_of(name) is not None:
            local = param.to_local() if isinstance(param, DTensor) else param
            held[name] = (local.numel(), param.numel(), not torch.equal(replicated(param.detach()), initial[name]))
    return held


def _train(ep: int, name: str, **kwargs) -> dict:
    engine = FSDP2Engine({"mixed_precision": "fp32", "ep_size": ep, **kwargs.pop("engine", {})})
    initial = build_model(name).state_dict()  # what train_against_reference starts from
    return train_against_reference(name, engine.prepare_model, max_norm=MAX_NORM, **kwargs,
                                   inspect=lambda model: _held_experts(model, initial))


def _checkpoint_checks(root: str) -> dict:
    """Load transformers' own per-expert Mixtral checkpoint into the list model at ep 2 (this rank's
    experts only), train a step, save (DCP) and export; resume the save without ep and at ep 4 and
    continue; export offline; compare every tensor of each with the trained model's, gathered."""
    import transformers
    from harness.compare import full_state, step_on_slice

    from fullshard import from_pretrained
    from fullshard.checkpoint import CheckpointManager, export_checkpoint, export_hf
    from fullshard.checkpoint.export import own_rows
    from fullshard.testing.moe_lists import ListMoeForCausalLM

    root, rank, out = Path(root), dist.get_rank(), {}
    if rank == 0:
        build_model("ep_mixtral", seed=3).save_pretrained(root / "hf")  # transformers' fused Mixtral, written per expert
    dist.barrier()
    whole = ListMoeForCausalLM.from_pretrained(root / "hf")
    model = from_pretrained(str(root / "hf"), engine=FSDP2Engine({"ep_size": 2}), model_class=ListMoeForCausalLM)
    loaded = full_state(model)
    out["names"] = sorted(loaded)
    out["loaded_equal"] = _differ(loaded, dict(whole.named_parameters()), only_first=True)
    allowance = 0
    for key, tensor in whole.state_dict().items():
        size = tensor.numel() * tensor.element_size()
        allowance += size // (2 if expert_of(key) is not None else 4) + size // tensor.shape[0]
    out["bytes_read"], out["allowance"] = model.fullshard_load_report.bytes_read, allowance

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    batch = make_batch("list_mixtral", seed=5)

    step_on_slice(model, optimizer, batch)
    CheckpointManager(root / "ckpt").save(1, model, optimizer=optimizer)
    export_hf(model, root / "export")
    out["experts_gathered"] = sorted(k for k, t in model.state_dict().items()
                                     if expert_of(k) is not None and own_rows(t) is None)
    trained = full_state(model)
    trained = {k: v for part in _every_rank(trained) for k, v in part.items()}  # every expert, to compare any layout
    resumed = FSDP2Engine({}).prepare_model(build_model("list_mixtral", seed=9))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3, eps=1e-6)
    CheckpointManager(root / "ckpt").load(resumed, optimizer=resumed_optimizer)
    out["resumed_names"] = sorted(full_state(resumed))
    out["resumed_equal"] = _differ(trained, full_state(resumed), only_first=True)
    split = FSDP2Engine({"ep_size": 4}).prepare_model(build_model("list_mixtral", seed=9))
    split_optimizer = torch.optim.AdamW(split.parameters(), lr=1e-3, eps=1e-6)
    CheckpointManager(root / "ckpt").load(split, optimizer=split_optimizer)
    out["ep4_equal"] = _differ(full_state(split), trained, only_first=True)
    export_hf(split, root / "export_ep4")  # experts outside FSDP (efsdp 1): each written by its one holder
    out["next_losses"] = (step_on_slice(model, optimizer, batch), step_on_slice(resumed, resumed_optimizer, batch), step_on_slice(split, split_optimizer, batch))
    final = full_state(model)
    out["next_weight_diff"] = max((other[k] - v).abs().max().item() for other in (full_state(resumed), full_state(split))
                                  for k, v in final.items() if k in other)
    if rank == 0:
        export_checkpoint(root / "ckpt", root / "offline")  # one process, no group: the stored tensors are global
    dist.barrier()
    exported = ListMoeForCausalLM.from_pretrained(root / "export")
    out["export_equal"] = _differ(trained, dict(exported.named_parameters()), only_first=True)
    for export in ("offline", "export_ep4"):
        loaded = ListMoeForCausalLM.from_pretrained(root / export)
        out[f"{export}_equal"] = _differ(trained, dict(loaded.named_parameters()), only_first=True)
    if rank == 0:  # transformers' own Mixtral fuses the exported experts back and computes the same logits
        fused = transformers.MixtralForCausalLM.from_pretrained(root / "export").eval()
        with torch.no_grad():
            out["fused_logits_diff"] = (fused(**batch).logits - exported.eval()(**batch).logits).abs().max().item()
    return out


def _every_rank(value):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _differ(state: dict, reference: dict, only_first: bool = False) -> list[str]:
    """The names whose tensors differ, or are missing on one side (`only_first`: names of `state` only)."""
    names = state.keys() if only_first else state.keys() | reference.keys()
    return sorted(k for k in names if k not in state or k not in reference or not torch.equal(state[k], reference[k].detach()))


def _world_4_checks(root: str) -> dict:
    parity = {}
    for ep, families in ((2, LIST_FAMILIES), (4, LIST_FAMILIES[:2])):
        for name in families:
            parity[(ep, name)] = _train(ep, name)
        for name in LIST_FAMILIES[:2]:  # a block calling experts with no rows, and one skipping them
            parity[(ep, f"idle_{name}")] = _train(ep, name, prepare=route_to_expert_0_and_1, steps=2)
    parity[(2, "activation_checkpointing")] = _train(2, "list_shared", steps=2,
                                                     engine={"activation_checkpointing": True})
    parity[(4, "bf16")] = _train(4, "list_shared", steps=2, engine={"mixed_precision": "bf16"})
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # the whole batch's, as in one process
    parity[(2, "router_aux_loss")] = _train(2, "list_mixtral", steps=3, model_kwargs=aux)
    # router jitter draws noise per rank, so no run matches one process: ep 2 must match plain FSDP
    jitter = {ep: _train(ep, "list_jitter", steps=3)["loss"] for ep in (1, 2)}
    try:
        _train(2, "list_mixtral", prepare=route_by_call_count, steps=1)
        unstable = None
    except RuntimeError as error:
        unstable = str(error)
    return {"parity": parity, "plain": _plain_fsdp_checks(), "jitter": jitter, "unstable": unstable,
            "checkpoint": _checkpoint_checks(root)}


def _plain_fsdp_checks() -> dict:
    """FSDP without ep on a block that skips experts without tokens: natural routing, and routing
    where one expert gets no token anywhere and one only on rank 0, with and without checkpointing,
    and over an HSDP mesh (2 x 2: the calls agree over both dims)."""
    return {"skip_idle": _train(1, "list_skip_idle"),
            "routed": _train(1, "list_skip_idle", prepare=route_around_experts_6_and_7),
            "routed_checkpointed": _train(1, "list_skip_idle", prepare=route_around_experts_6_and_7, steps=3,
                                          engine={"activation_checkpointing": True}),
            "routed_hsdp": _train(1, "list_skip_idle", prepare=route_around_experts_6_and_7, steps=2,
                                  engine={"dp_replicate": 2})}


@pytest.fixture(scope="module")
def world_4(tmp_path_factory):
    return run_distributed(_world_4_checks, 4, str(tmp_path_factory.mktemp("ep_lists")))


def test_per_expert_lists_match_single_process(world_4):
    bad = parity_problems([r["parity"] for r in world_4], TOL, MAX_NORM, complete=False, skip=[(4, "bf16")])
    assert not bad, "\n".join(bad)


def test_plain_fsdp_on_blocks_skipping_idle_experts_matches_single_process(world_4):
    """Without ep the ranks' blocks call different experts; each rank still reduces the gradients of
    every expert some rank called (zero where it had no rows), so FSDP's reduce-scatters match and the
    run is one process's: an expert no token reached has no gradient and stays bit for bit, one reached
    only on rank 0 trains."""
    bad = parity_problems([r["plain"] for r in world_4], TOL, MAX_NORM)
    assert not bad, "\n".join(bad)
    for result in world_4:
        for name in ("routed", "routed_checkpointed", "routed_hsdp"):
            held = result["plain"][name]["inspect"]
            assert all(moved == (expert_of(n) != 7) for n, (_, _, moved) in held.items()), name


def test_each_rank_holds_only_its_experts(world_4):
    """The names missing on a rank (compared against the reference on another) are exactly the experts
    other ep ranks own; each held expert tensor is 1/efsdp here."""
    for rank, result in enumerate(world_4):
        for (ep, name), r in result["parity"].items():
            owned = owned_experts(EXPERTS, ep, rank % ep)
            assert r["missing"] and all(expert_of(n) not in owned for n in r["missing"]), (ep, name, r["missing"][:3])
            held = r["inspect"]
            assert {expert_of(n) for n in held} == set(owned), (ep, name, sorted(held)[:3])
            assert all(local * (4 // ep) == whole for local, whole, _ in held.values()), (ep, name)
            assert len(held) + len(r["missing"]) == 2 * 3 * EXPERTS  # layers x (w1, w2, w3) x experts


def test_experts_no_block_called_have_no_gradient(world_4):
    """A block that skips experts without tokens gives them no gradient in one process, so AdamW leaves
    them bit for bit (no weight decay); under ep too, though their owners ran other experts. A block
    calling every expert (even on no rows) gives zero gradients, which decay: those moved."""
    for result in world_4:
        for ep in (2, 4):
            for name, moves in (("idle_list_skip_idle", False), ("idle_list_mixtral", True)):
                held = result["parity"][(ep, name)]["inspect"]
                assert all(moved == (moves or expert_of(n) < 2) for n, (_, _, moved) in held.items()), (ep, name)


def test_bf16_experts_kept_whole_compute_in_bf16(world_4):
    """ep 4 (efsdp 1) in bf16: experts FSDP leaves alone are cast by their call; losses stay within bf16
    rounding of one fp32 process."""
    for result in world_4:
        r = result["parity"][(4, "bf16")]
        assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < 2e-2, (r["loss"], r["ref_loss"])


def test_router_jitter_routes_the_same_in_both_passes(world_4):
    for result in world_4:
        plain, split = result["jitter"][1], result["jitter"][2]
        assert max(abs(a - b) for a, b in zip(plain, split)) < TOL, (plain, split)


def test_routing_that_differs_between_the_passes_is_refused(world_4):
    for result in world_4:
        assert "the MoE block called its experts differently in its second pass" in (result["unstable"] or ""), result
        assert "its routing must be deterministic" in result["unstable"]


def test_per_expert_lists_load_save_resume_and_export(world_4):
    """transformers' per-expert Mixtral checkpoint loads into the list model at ep 2 reading about this
    rank's share; the DCP save resumes without ep bit for bit and continues like the run that saved it;
    the live export (each rank writing its own experts' rows) and the offline one load in the model's
    own class with equal weights, and in transformers' Mixtral with equal logits."""
    names = set()
    for rank, result in enumerate(world_4):
        r = result["checkpoint"]
        names.update(r["names"])
        assert {expert_of(n) for n in r["names"]} - {None} == set(owned_experts(EXPERTS, 2, rank % 2)), rank
        assert r["loaded_equal"] == [] == r["experts_gathered"], (r["loaded_equal"], r["experts_gathered"])
        assert r["bytes_read"] <= r["allowance"], (rank, r["bytes_read"], r["allowance"])
        assert r["resumed_equal"] == r["ep4_equal"] == r["export_equal"] == r["offline_equal"] == [], r
        assert r["export_ep4_equal"] == [], r
        assert max(r["next_losses"]) - min(r["next_losses"]) < TOL and r["next_weight_diff"] < TOL, r
    assert names == set(world_4[0]["checkpoint"]["resumed_names"])  # together the ranks compared every tensor
    assert world_4[0]["checkpoint"]["fused_logits_diff"] < TOL


def test_plan_and_memory_estimate_count_per_expert_lists():
    from fullshard.parallel.ep import check_expert_parallel, expert_owners
    from fullshard.plan import build_plan
    from fullshard.train.memory import estimate_memory

    model = build_model("list_mixtral")
    lines = expert_owners(model, 2)
    assert "experts 0-3 of 8" in lines[0] and "experts 4-7 of 8" in lines[1] and "of the 2 experts modules" in lines[0]
    plan = build_plan(model, "auto")
    whole, split = (estimate_memory(model, plan, 4, 1, 16, device_type="cpu", ep_size=ep) for ep in (1, 2))
    layer = {n: p.numel() * 4 for n, p in model.named_parameters() if n.startswith("model.layers.0.")}
    experts = sum(size for n, size in layer.items() if ".experts." in n)
    assert whole.largest_unit == sum(layer.values())
    assert split.largest_unit == max(sum(layer.values()) - experts, experts // 2)
    with pytest.raises(PlanError, match=r"block_sparse_moe.experts has num_experts=6, not divisible by ep_size"):
        check_expert_parallel(build_model("list_mixtral", num_local_experts=6), 4)
