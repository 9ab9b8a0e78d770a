"""PEFT LoRA under FSDP2: adapters in their own units, trained exactly as in one process."""

import torch
from peft import LoraConfig, get_peft_model

from fullshard import FSDP2Engine
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.testing.compare import data_slice, full_state, train_against_reference
from fullshard.engine import fsdp_units

TOL = 1e-5
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def add_lora(model):
    torch.manual_seed(7)  # the same adapter init in the reference and the sharded copy
    return get_peft_model(model, LoraConfig(**LORA))


def _after_training(model):
    """Adapter gradients of one more step, base weights, and the units fully_shard built."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model(**data_slice(make_batch("llama", seed=100), rank, world)).loss.backward()
    grad_norms = {n: p.grad.full_tensor().norm().item() for n, p in model.named_parameters() if p.requires_grad}
    base = build_model("llama").state_dict()
    frozen = full_state(model)
    prefix = "base_model.model."
    base_diff = max((frozen[n] - base[n[len(prefix):].replace(".base_layer", "")]).abs().max().item()
                    for n, p in model.named_parameters() if not p.requires_grad)
    units = fsdp_units(model)
    mixed_units = [k for k, params in units.items() if len({p.requires_grad for p in params}) > 1]
    return {"grad_norms": grad_norms, "base_diff": base_diff, "mixed_units": mixed_units}


def _lora_checks():
    engine = FSDP2Engine({"mixed_precision": "fp32"})
    return train_against_reference("llama", engine.prepare_model, prepare=add_lora, inspect=_after_training,
                                   check_tie=False)


def test_lora_matches_single_process_and_trains_every_adapter():
    for r in run_distributed(_lora_checks, 2):
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"]))
        assert loss < TOL and r["max_weight_diff"] < TOL, (loss, r["max_weight_diff"], r["worst_weight"])
        assert r["loss"][-1] < r["loss"][0]
        info = r["inspect"]
        adapters = [n for n in info["grad_norms"] if "lora_" in n]
        assert len(adapters) == 2 * 3 * 2, adapters  # A and B, 3 targets, 2 layers
        assert all(info["grad_norms"][n] > 0 for n in adapters), info["grad_norms"]
        assert info["base_diff"] == 0.0, "frozen base weights must not move"
        assert info["mixed_units"] == [], "no unit holds both frozen and trainable parameters"
