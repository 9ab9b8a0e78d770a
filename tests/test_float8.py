"""float8 training (torchao) on CPU/gloo: both recipes track the bf16 run while differing from it,
world 2 computes what world 1 does, the chosen layers are converted, and checkpoints and exports
stay in the model's dtype (a float8 checkpoint resumes without float8 and vice versa)."""

import subprocess
import sys

import pytest
import torch
from harness.cli import commands_in_group

from fullshard.testing import build_model, run_distributed

STEPS = 10
BF16_TRACK = 0.02  # float8 against bf16: per-step loss within 2% (measured: about 0.1%)
RECIPES = ("tensorwise", "rowwise")


COMPOSED = {"selective checkpointing": {"activation_checkpointing": "selective"},
            "full checkpointing + activation offload": {"activation_checkpointing": "full",
                                                        "activation_offload": True},
            "activation offload": {"activation_offload": True},
            "compiled (aot_eager)": {"compile": "aot_eager"},
            "HSDP 2 x 1": {"dp_replicate": 2, "dp_shard": 1},
            "offload_params": {"offload_params": True, "pin_memory": False}}


def _train(config: dict, steps: int, mesh=None, halves: bool = False, lora: bool = False):
    """`steps` AdamW steps on the llama of the zoo; each rank its half of every batch, or (`halves`,
    one rank) both halves in turn as accumulated micro-batches: the rows each forward sees are the
    same either way, and so are float8's per-tensor activation scales."""
    import torch.distributed as dist
    from harness.compare import data_slice, full_state

    from fullshard import FSDP2Engine
    from fullshard.lora import apply_lora
    from fullshard.optim import create_optimizer
    from fullshard.testing.zoo import make_batch

    model = build_model("llama")
    if lora:
        model = apply_lora(model, {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    model = FSDP2Engine(config, device_mesh=mesh).prepare_model(model)
    optimizer = create_optimizer(model, lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        batch = make_batch("llama", batch_size=4, seq_len=16, seed=step)
        ranks = range(2) if halves else [dist.get_rank()]
        parts = [data_slice(batch, r, 2) for r in ranks]
        total = torch.zeros(())
        for part in parts:
            loss = model(**part).loss / len(parts)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if not halves:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(float(total))
    return {"loss": losses, "weights": full_state(model)}, model, optimizer


def _gaps(a: dict, b: dict) -> tuple[float, float]:
    """(largest loss difference, largest weight difference)."""
    return (max(abs(x - y) for x, y in zip(a["loss"], b["loss"])),
            max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]))


def _group(tmp: str) -> dict:
    import torch.distributed as dist
    from harness.compare import full_state
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import FSDP2Engine
    from fullshard.checkpoint import CheckpointManager, export_hf
    from fullshard.float8 import float8_modules
    from fullshard.optim import create_optimizer

    one_rank = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ranks", "alone"))["alone"]
    out = {"world_gap": {}, "bf16_track": {}}
    for recipe in RECIPES:  # fp32 compute: float8 is the only rounding, so world sizes agree closely
        config = {"mixed_precision": "fp32", "float8": recipe}
        two, model, _ = _train(config, 3)
        one, _, _ = _train(config, 3, mesh=one_rank, halves=True)
        plain, _, _ = _train({"mixed_precision": "fp32"}, 3)
        out["world_gap"][recipe] = (_gaps(two, one), _gaps(two, plain))
        out[f"converted {recipe}"] = float8_modules(model)
    for recipe in RECIPES:  # each composed setting against the same recipe without it
        base = _train({"mixed_precision": "bf16", "float8": recipe}, 3)[0]["loss"]
        for name, extra in COMPOSED.items():
            losses = _train({"mixed_precision": "bf16", "float8": recipe, **extra}, 3)[0]["loss"]
            out.setdefault("composed", {})[(recipe, name)] = (base, losses)
        out.setdefault("composed", {})[(recipe, "lora")] = (base, _train(
            {"mixed_precision": "bf16", "float8": recipe, "freeze": []}, 3, lora=True)[0]["loss"])
    bf16 = _train({"mixed_precision": "bf16"}, STEPS)[0]["loss"]
    for recipe in RECIPES:
        float8 = _train({"mixed_precision": "bf16", "float8": recipe}, STEPS)[0]["loss"]
        out["bf16_track"][recipe] = (bf16, float8)
    # a float8 checkpoint into a model without float8, and back; the export in the model's dtype
    trained, model, optimizer = _train({"mixed_precision": "bf16", "float8": "tensorwise"}, 2)
    manager = CheckpointManager(f"{tmp}/ckpt")
    manager.save(2, model, optimizer)
    out["optimizer_dtypes"] = sorted({str(v.dtype) for s in optimizer.state.values() for v in s.values()
                                      if torch.is_tensor(v) and v.dim() > 0})
    for name, config in (("plain", {"mixed_precision": "bf16"}),
                         ("float8", {"mixed_precision": "bf16", "float8": "rowwise"})):
        resumed = FSDP2Engine(config).prepare_model(build_model("llama", seed=1))
        resumed_optimizer = create_optimizer(resumed, lr=1e-3)
        manager.load(resumed, resumed_optimizer)
        state = full_state(resumed)
        out[f"resume {name}"] = max((state[k] - trained["weights"][k]).abs().max().item() for k in state)
    export_hf(model, f"{tmp}/hf")
    dist.barrier()
    out["weights"] = {k: v for k, v in trained["weights"].items()}
    out["command"] = commands_in_group(tmp, [COMMAND + [f"--train.output_dir={tmp}/out"]])[0]
    return out


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("float8")
    return tmp, run_distributed(_group, 2, str(tmp))


def test_world_2_float8_computes_what_world_1_does(group):
    _, ranks = group
    for recipe, (world_gap, against_plain) in ranks[0]["world_gap"].items():
        # the float8 all-gather dequantizes to what one process casts; float8 itself moves the loss
        assert max(world_gap) < 1e-6 and against_plain[0] > 1e-4, (recipe, world_gap, against_plain)


def test_float8_composes_with_checkpointing_offload_compile_hsdp_and_lora(group):
    _, ranks = group
    composed = ranks[0]["composed"]
    assert len(composed) == 2 * (len(COMPOSED) + 1)
    for (recipe, name), (base, losses) in composed.items():
        if name == "lora":  # the adapters train in high precision beside the float8 base
            assert all(abs(a - b) < 0.05 for a, b in zip(base, losses)) and losses != base, (recipe, losses)
        else:  # the same float8 math: only summation order may differ
            assert max(abs(a - b) for a, b in zip(base, losses)) < 1e-5, (recipe, name, base, losses)


# `fullshard train` at pp 2 with float8 tensorwise and selective checkpointing, in the group above
# (`harness.cli.commands_in_group`: the command's checks before launch, then its ranks' side)
COMMAND = ["train", "--model.name_or_path=micro-llama", "--nproc=2", "--fsdp.pp_size=2", "--fsdp.float8=tensorwise",
           "--fsdp.activation_checkpointing=selective", "--fsdp.mixed_precision=bf16", "--data.seq_len=32",
           "--train.steps=3", "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.log_every=1",
           "--train.plot=false"]


def test_float8_trains_through_the_command_with_pipeline_stages(group):
    """`fullshard train` at pp 2 with float8 tensorwise and selective checkpointing: the trainer's
    optimizer precomputes the scales, the export is an ordinary HF directory in fp32."""
    from transformers import AutoModelForCausalLM

    from fullshard.train.metrics import read_metrics

    tmp, ranks = group
    done = ranks[0]["command"]
    assert done["code"] == 0 and done["launched"], done["output"][-3000:]
    assert "Linear layers in float8" in done["output"]
    losses = [r["loss"] for r in read_metrics(tmp / "out" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), losses
    exported = AutoModelForCausalLM.from_pretrained(tmp / "out" / "hf")
    assert {t.dtype for t in exported.state_dict().values()} == {torch.float32}


def test_float8_tracks_bf16_while_differing_from_it(group):
    _, ranks = group
    for recipe, (bf16, float8) in ranks[0]["bf16_track"].items():
        relative = [abs(a - b) / abs(a) for a, b in zip(bf16, float8)]
        assert len(relative) == STEPS and max(relative) < BF16_TRACK, (recipe, relative)
        assert max(relative) > 1e-5, (recipe, relative)  # float8 is really in the compute path


def test_converted_modules_are_the_blocks_linears():
    from transformers import MixtralConfig

    from fullshard.float8 import float8_choices
    from fullshard.testing.moe_lists import ListMoeForCausalLM  # a 4.x Mixtral: Linear router and experts

    llama = build_model("llama")
    converted, kept = float8_choices(llama)
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert converted == [f"model.layers.{i}.{p}" for i in range(2) for p in projections]
    assert kept == {"lm_head": "the output head"}
    converted, kept = float8_choices(llama, skip=["model.layers.1.mlp.*"])
    assert len(converted) == 11 and kept["model.layers.1.mlp.up_proj"] == "fsdp.float8_skip"
    moe = ListMoeForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                           num_local_experts=16))
    converted, kept = float8_choices(moe)
    assert converted and all(".experts." not in n and not n.endswith(".gate") for n in converted), converted
    assert {why for why in kept.values()} >= {"a MoE router", "a MoE expert"}, kept
    odd = build_model("llama", hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
    assert float8_choices(odd)[1]["model.layers.0.self_attn.q_proj"] == "40 x 40: not multiples of 16"


def test_group_converted_every_decoder_linear(group):
    _, ranks = group
    for recipe in RECIPES:
        assert len(ranks[0][f"converted {recipe}"]) == 14 and "lm_head" not in ranks[0][f"converted {recipe}"]


def test_checkpoints_and_exports_stay_in_the_model_dtype(group):
    tmp, ranks = group
    assert ranks[0]["optimizer_dtypes"] == ["torch.float32"]
    assert ranks[0]["resume plain"] == 0.0 and ranks[0]["resume float8"] == 0.0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp / "hf")
    reference = build_model("llama")
    reference.load_state_dict(ranks[0]["weights"])
    for name, tensor in exported.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, ranks[0]["weights"][name]), name
    ids = torch.randint(0, exported.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


def test_a_refusal_before_launch_does_not_import_torchao():
    code = ("import sys\nfrom fullshard.train.config import load_config\n"
            "from fullshard.errors import ConfigError\n"
            "for bad in (['--fsdp.float8=e4m3'], ['--fsdp.float8=tensorwise', '--fsdp.tp_size=2']):\n"
            "    try:\n        load_config(None, bad)\n    except ConfigError as err:\n        print(err)\n"
            "print('torchao' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "False" and len(lines) == 3, done.stdout + done.stderr
    assert lines[0].startswith("fsdp.float8 must be one of none, tensorwise, rowwise"), lines
    assert lines[1].startswith("fsdp.float8 with tp_size > 1"), lines


def test_the_plan_gathers_tensorwise_weights_in_float8():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.plan.memory import estimate_run

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                             num_attention_heads=16, vocab_size=1024))
    gathered = {recipe: estimate_run(model, {"mixed_precision": "bf16", "float8": recipe, "plan": "auto"}, 8, 1,
                                     2048).stages[0].estimate for recipe in ("none", "tensorwise", "rowwise")}
    assert gathered["rowwise"].gathered == gathered["none"].gathered  # gathered in bf16, cast per matmul
    # the two largest units are two layers: their Linear weights at a byte each, not two
    layer = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    assert gathered["none"].gathered - gathered["tensorwise"].gathered == pytest.approx(2 * layer, rel=0.01)
