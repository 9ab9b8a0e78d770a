"""Activation checkpointing modes and activation offload against the run without them: the same
losses, grad norms and weights exactly; peak memory (FSDPMemTracker) ordered none > selective,
every_n > full; the memory estimate of each within 0-10% above the measured peak."""

import pytest
from harness.compare import largest_gap, train_on_padded_batches

from fullshard import FSDP2Engine
from fullshard.errors import ConfigError
from fullshard.testing import build_model, run_distributed

MODES = ("none", "full", "selective", "every_n")
CELLS = {"none": "dp 2", "full": "activation checkpointing", "selective": "selective checkpointing",
         "every_n": "every 2nd block checkpointed", "offload": "activation offload"}


def _runs() -> dict:
    from harness.memory_matrix import measure_cell

    from fullshard.fsdp import checkpointed_blocks

    def make(mode, offload, name="llama"):
        engine = FSDP2Engine({"mixed_precision": "fp32", "activation_checkpointing": mode,
                              "activation_offload": offload})
        return engine.prepare_model(build_model(name))

    runs = {(mode, offload): train_on_padded_batches("llama", lambda: make(mode, offload))
            for mode in MODES for offload in (False, True)}
    qwen = {mode: train_on_padded_batches("qwen2", lambda: make(mode, False, "qwen2"))  # biased projections
            for mode in ("none", "selective")}
    model = build_model("llama", num_hidden_layers=4)
    return {
        "gaps": {key: largest_gap(runs[("none", False)], run) for key, run in runs.items()},
        "qwen_gap": largest_gap(qwen["none"], qwen["selective"]),
        "blocks": {mode: checkpointed_blocks(model, mode, every=2) for mode in MODES},
        "cells": {mode: measure_cell(cell) for mode, cell in CELLS.items()},
    }


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_runs, 2)


def test_every_mode_and_offload_train_exactly_as_without(runs):
    for rank in runs:
        assert len(rank["gaps"]) == 8 and all(gap == 0.0 for gap in rank["gaps"].values()), rank["gaps"]
        assert rank["qwen_gap"] == 0.0


def test_each_mode_checkpoints_its_blocks(runs):
    blocks = runs[0]["blocks"]
    assert blocks["none"] == [] and blocks["full"] == blocks["selective"] == [f"model.layers.{i}" for i in range(4)]
    assert blocks["every_n"] == ["model.layers.1", "model.layers.3"]


def test_selective_and_every_n_hold_less_than_none_more_than_full(runs):
    peak = {mode: max(rank["cells"][mode]["peak"] for rank in runs) for mode in CELLS}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    assert peak["full"] < peak["every_n"] < peak["none"], peak
    assert peak["offload"] == peak["none"], peak  # on a host with no accelerator nothing moves
    for mode in CELLS:
        ratio = max(rank["cells"][mode]["estimate"] for rank in runs) / peak[mode]
        assert 1.0 <= ratio <= 1.10, (mode, ratio)


@pytest.mark.parametrize("value, mode", [(True, "full"), (False, "none"), ("none", "none"), ("true", "full"),
                                         ("selective", "selective"), ("every_n", "every_n")])
def test_config_values(value, mode):
    from fullshard.engine import EngineConfig

    assert EngineConfig(activation_checkpointing=value).activation_checkpointing == mode


def test_an_unknown_mode_is_one_line():
    from fullshard.train.config import load_config

    assert load_config(None, ["--fsdp.activation_checkpointing=none"]).fsdp.activation_checkpointing == "none"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--fsdp.activation_checkpointing=sometimes"])
    assert "\n" not in str(err.value) and "fsdp.activation_checkpointing" in str(err.value), err.value
    assert "selective" in str(err.value)
    with pytest.raises(ConfigError, match="ac_every"):
        load_config(None, ["--fsdp.ac_every=0"])


def test_the_plan_counts_offloaded_activations_on_the_host():
    """On a GPU the offloaded layers' saved tensors leave the device for the host; on a CPU nothing moves."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.plan.memory import estimate_run

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                             num_attention_heads=16, vocab_size=32000))
    runs = {(mode, offload, device): estimate_run(model, {"activation_checkpointing": mode,
                                                          "activation_offload": offload}, 8, 4, 4096,
                                                  device_type=device).stages[0].estimate
            for mode in ("none", "full") for offload in (False, True) for device in ("cuda", "cpu")}
    for mode in ("none", "full"):
        plain, offloaded = runs[(mode, False, "cuda")], runs[(mode, True, "cuda")]
        assert offloaded.host_activations > 0 and offloaded.total < plain.total, mode
        assert plain.activations - offloaded.activations < offloaded.host_activations
        assert runs[(mode, True, "cpu")].total == runs[(mode, False, "cpu")].total
    assert runs[("none", True, "cuda")].host_activations > 10 * runs[("full", True, "cuda")].host_activations
