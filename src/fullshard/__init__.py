"""fullshard: train Hugging Face models across many devices with PyTorch FSDP2.

Every public name is importable from here, e.g. `from fullshard import FSDP2Engine`. They are
resolved on first use, so importing one submodule (`fullshard.dtypes`) loads only what that
submodule needs, never the layers above it.
"""

from __future__ import annotations

import importlib

from . import _moved

__version__ = "0.1.0"
_moved.install()  # old module paths (fullshard.weights, fullshard.checkpoint.export, ...) keep importing

_EXPORTS = {
    **dict.fromkeys(["CheckpointManager"], "checkpoint"),
    **dict.fromkeys(["FSDPStrategy", "load_ckpt", "save_ckpt", "save_model"], "faces.lightrft"),
    **dict.fromkeys(["checkpoint_hf_weights", "export_checkpoint", "export_hf", "export_merged", "hf_weight_buckets",
                     "hf_weights", "save_adapter"], "hf"),
    **dict.fromkeys(["ParallelDims", "build_mesh", "get_rank", "get_world_size", "init_distributed", "is_main_process"],
                    "distributed"),
    **dict.fromkeys(["EngineConfig", "FSDP2Engine"], "engine"),
    **dict.fromkeys(["apply_fsdp2"], "faces.transformers"),
    **dict.fromkeys(["CheckpointError", "ConfigError", "FullshardError", "LoadError", "PlanError", "WeightSyncError"],
                    "errors"),
    **dict.fromkeys(["apply_activation_checkpointing", "reshard_all"], "fsdp"),
    **dict.fromkeys(["init_empty_model", "materialize_and_load", "meta_init"], "loading"),
    **dict.fromkeys(["apply_lora"], "lora"),
    **dict.fromkeys(["token_logprobs"], "objectives"),
    **dict.fromkeys(["ShardedGradScaler", "clip_grad_norm", "clip_grad_norm_", "create_optimizer", "create_scheduler",
                     "global_grad_norm"], "optim"),
    **dict.fromkeys(["ShardingPlan", "UnitSpec", "auto_plan", "build_plan", "find_blocks", "get_transformer_layer_cls"],
                    "plan"),
    **dict.fromkeys(["from_pretrained"], "pretrained"),
    **dict.fromkeys(["generate"], "generation"),
    **dict.fromkeys(["SyncReport", "WeightSync", "weight_loader"], "weight_sync"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
