"""The weights-out family's one rule (`fullshard.hf.api`): the old names are the same calls, and a
`lora=` or source the call cannot honour is one clear error before anything is written. Pure unit
tests: no process group, no model of any size (the calls themselves are tested in test_checkpoint,
test_lora and test_weights under their old names)."""

import pytest
import torch

import fullshard
from fullshard.errors import CheckpointError, ConfigError
from fullshard.hf import api, lora, offline


def test_old_names_are_the_same_calls():
    assert fullshard.export_merged is lora.export_merged is api.export_merged
    assert fullshard.save_adapter is lora.save_adapter is api.save_adapter
    assert fullshard.export_checkpoint is offline.export_checkpoint is api.export_checkpoint
    assert fullshard.checkpoint_hf_weights is offline.checkpoint_hf_weights
    assert fullshard.export_hf is api.export_hf and fullshard.hf_weights is api.hf_weights


def test_a_source_or_lora_the_call_cannot_honour_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="lora must be one of"):
        fullshard.export_hf(torch.nn.Linear(2, 2), tmp_path / "out", lora="merged")
    with pytest.raises(ConfigError, match="needs a peft.PeftModel, got Linear"):
        fullshard.export_hf(torch.nn.Linear(2, 2), tmp_path / "out", lora="merge")
    with pytest.raises(ConfigError, match="lora='adapter' and tokenizer= are for a live model"):
        fullshard.export_hf(tmp_path / "ckpt", tmp_path / "out", lora="adapter")
    with pytest.raises(CheckpointError, match="a checkpoint's weights come merged"):
        next(fullshard.hf_weights(str(tmp_path / "ckpt"), lora="adapter"))
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_path_goes_to_the_offline_export(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(offline, "export_checkpoint", lambda *a, **k: calls.append((a, k)) or tmp_path)
    assert fullshard.export_hf(tmp_path / "ckpt", tmp_path / "out", dtype="bf16") == tmp_path
    assert calls == [((tmp_path / "ckpt", tmp_path / "out"), {"dtype": "bf16", "max_shard_size": "5GB"})]
