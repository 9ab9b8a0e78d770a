"""fullshard: train Hugging Face models across many devices with PyTorch FSDP2."""

from .checkpoint import CheckpointManager, export_checkpoint, export_hf, load_ckpt, save_ckpt, save_model
from .distributed import ParallelDims, build_mesh, get_rank, get_world_size, init_distributed, is_main_process
from .engine import EngineConfig, FSDP2Engine, apply_activation_checkpointing, apply_fsdp2, reshard_all
from .loading import CheckpointError, from_pretrained, init_empty_model, materialize_and_load, meta_init
from .lora import apply_lora, export_merged, save_adapter
from .optim import ShardedGradScaler, clip_grad_norm, create_optimizer, create_scheduler, global_grad_norm
from .plan import PlanError, ShardingPlan, UnitSpec, auto_plan, build_plan, find_blocks, get_transformer_layer_cls
from .strategy import FSDPStrategy

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "export_checkpoint",
    "export_hf",
    "load_ckpt",
    "save_ckpt",
    "save_model",
    "CheckpointError",
    "from_pretrained",
    "init_empty_model",
    "materialize_and_load",
    "meta_init",
    "EngineConfig",
    "FSDPStrategy",
    "ShardedGradScaler",
    "clip_grad_norm",
    "create_optimizer",
    "create_scheduler",
    "global_grad_norm",
    "FSDP2Engine",
    "ParallelDims",
    "PlanError",
    "ShardingPlan",
    "UnitSpec",
    "apply_activation_checkpointing",
    "apply_lora",
    "export_merged",
    "save_adapter",
    "apply_fsdp2",
    "auto_plan",
    "build_mesh",
    "build_plan",
    "find_blocks",
    "get_rank",
    "get_transformer_layer_cls",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "reshard_all",
]
