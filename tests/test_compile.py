"""Compiled blocks train like eager ones, keep every name, and compose with checkpointing and
mixed precision; explicit prefetch changes nothing in the math."""

import pytest
import torch
from harness.compare import reference_gaps, train_against_reference
from torch._dynamo.utils import counters

from fullshard import FSDP2Engine, find_blocks
from fullshard.compile import compile_blocks, set_block_prefetch
from fullshard.testing import build_model, run_distributed

TOL = 1e-5
BF16_LOSS_TOL = 5e-2  # as test_engine's bf16 check: bf16 compute against the fp32 reference
MODEL = "llama"


def _compiled(model) -> bool:
    return all(model.get_submodule(b)._compiled_call_impl is not None for b in find_blocks(model))


def _names_and_compiled(model) -> tuple:
    return [n for n, _ in model.named_parameters()], list(model.state_dict()), _compiled(model)


def _compiled_checks() -> dict:
    torch.set_num_threads(1)
    out = {}
    compiled = FSDP2Engine({"mixed_precision": "fp32", "compile": True})
    r = train_against_reference(MODEL, compiled.prepare_model, steps=5, inspect=_names_and_compiled)
    out["fp32"] = (*reference_gaps(r), r["max_weight_diff"], r["loss"])
    out["names"], out["keys"], out["compiled"] = r["inspect"]
    out["graphs"] = counters["stats"]["unique_graphs"]
    with_ac = FSDP2Engine({"mixed_precision": "fp32", "compile": True, "activation_checkpointing": True})
    r = train_against_reference(MODEL, with_ac.prepare_model, steps=5)
    out["fp32+ac"] = (*reference_gaps(r), r["max_weight_diff"], r["loss"])
    bf16 = FSDP2Engine({"mixed_precision": "bf16", "compile": True, "activation_checkpointing": True})
    out["bf16+ac"] = reference_gaps(train_against_reference(MODEL, bf16.prepare_model, steps=5))

    def prefetched(model):
        model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(model)
        out["prefetch_units"] = set_block_prefetch(model, depth=2)
        return model

    r = train_against_reference(MODEL, prefetched, steps=5)
    out["prefetch"] = (*reference_gaps(r), r["max_weight_diff"], r["loss"])
    return out


def test_compiled_blocks_match_eager_at_world_2():
    out = run_distributed(_compiled_checks, 2)[0]
    for case in ("fp32", "fp32+ac", "prefetch"):
        loss, norm, weight, losses = out[case]
        assert loss <= TOL and norm <= TOL and weight <= TOL, (case, loss, norm, weight)
        assert losses[-1] < losses[0], (case, losses)
    eager = build_model(MODEL)
    assert out["names"] == [n for n, _ in eager.named_parameters()], "compiling renamed a parameter"
    assert out["keys"] == list(eager.state_dict()), "compiling changed a state-dict key"
    assert out["compiled"] and out["graphs"] > 0, "the blocks were not compiled"
    loss, _ = out["bf16+ac"]
    assert 0 < loss < BF16_LOSS_TOL, ("bf16 compiled with checkpointing against the fp32 reference", loss)
    assert out["prefetch_units"] == 2


def test_compile_blocks_is_in_place_and_prefetch_depth_is_checked():
    model = build_model(MODEL)
    assert compile_blocks(model) == ["model.layers.0", "model.layers.1"]
    assert _compiled(model) and isinstance(model.model.layers[0], type(build_model(MODEL).model.layers[0]))
    with pytest.raises(ValueError, match="prefetch depth must be >= 1, got 0"):
        set_block_prefetch(model, depth=0)
