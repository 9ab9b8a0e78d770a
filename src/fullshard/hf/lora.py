"""LoRA in the Hugging Face layout: adapter-only saves in PEFT's format and the merged export.

A LoRA run's base model is the big part and is frozen; the adapters are small. So:
- `save_adapter` gathers only the adapter tensors (one at a time) and writes PEFT's own format,
  which `PeftModel.from_pretrained` loads in one process.
- `export_merged` writes a plain Hugging Face directory with every adapter merged into its base
  weight, through the export's region writer (`hf.export`): one tensor gathered and merged at a
  time, so no rank ever holds the whole model.
- `merge_recipe` is the export recipe of a PEFT model (the base model's Hub names, the LoRA terms
  to merge), which checkpoints record for the offline export and the weight stream.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..distributed import broadcast_from_rank0, get_rank, get_world_size, run_agreed
from ..errors import CheckpointError
from ..fsdp import reshard_all
from ..tensors import holds_part
from .export import first_holder, gather_full, staging_dir, write_export
from .recipe import ExportRecipe, alias_names, hub_recipe

PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


# --------------------------------------------------------------------------------- adapter-only save


def save_adapter(peft_model, output_dir: str | os.PathLike, adapter_name: str = "default") -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` as `PeftModel.save_pretrained` does;
    call on every rank.

    Only the adapter tensors are gathered (one at a time; every rank takes part, rank 0 keeps and
    writes them); the frozen base is never touched. The directory appears complete or not at all.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    if not is_peft_model(peft_model):
        raise TypeError(f"save_adapter needs a peft.PeftModel, got {type(peft_model).__name__}")
    output_dir = Path(output_dir)
    reshard_all(peft_model)
    sharded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k or k.endswith("bias")}
    selected = get_peft_model_state_dict(peft_model, state_dict=sharded, adapter_name=adapter_name,
                                         save_embedding_layers=False)
    staged = holds_part(peft_model)  # pipeline stages: each holds its own layers' adapters
    keep = get_rank() == 0
    tensors = {}
    for key, tensor in selected.items():
        full = gather_full(tensor)
        if keep or (staged and first_holder(tensor)):
            tensors[key] = full.to("cpu").contiguous()
        del full
    if staged:  # every stage's first rank hands its adapters (small) to rank 0
        parts = [None] * get_world_size() if keep else None
        dist.gather_object(tensors, parts, dst=0)
        tensors = {key: value for part in parts or [] for key, value in part.items()}
    staging = Path(broadcast_from_rank0(str(staging_dir(output_dir)) if keep else None))

    def write() -> None:
        staging.mkdir(parents=True)
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_adapter_config(peft_model, staging, adapter_name)
        output_dir.mkdir(parents=True, exist_ok=True)
        for item in staging.iterdir():
            os.replace(item, output_dir / item.name)
        shutil.rmtree(staging, ignore_errors=True)

    try:
        run_agreed(write, on_rank=0)
    finally:
        if keep:
            shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def write_adapter_config(peft_model, directory: Path, adapter_name: str = "default") -> None:
    """PEFT's `adapter_config.json` for `adapter_name`, naming the base model it was trained on."""
    config = peft_model.peft_config[adapter_name]
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(peft_model.get_base_model().config, "_name_or_path", None)
    config.save_pretrained(str(directory))


def adapter_file_names(state_keys, adapter_name: str = "default") -> dict[str, str]:
    """Adapter state key -> its name in `adapter_model.safetensors` (PEFT drops the adapter name)."""
    marks = (f".lora_A.{adapter_name}.", f".lora_B.{adapter_name}.")
    return {k.replace(f".{adapter_name}", ""): k for k in state_keys if any(m in k for m in marks)}


# --------------------------------------------------------------------------------- merged export


def base_name(state_name: str) -> str:
    """The base model's name of a PEFT state name (`base_model.model.x.base_layer.weight` -> `x.weight`)."""
    return state_name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER + ".", ".")


def _unmergeable(peft_model, layers: dict) -> list[str]:
    """Why each layer's adapters cannot be merged into plain weights (empty when all can)."""
    from peft.utils import ModulesToSaveWrapper

    problems = [f"{base_name(name)} (modules_to_save copy)" for name, m in peft_model.named_modules()
                if isinstance(m, ModulesToSaveWrapper)]
    for name, layer in layers.items():
        name = base_name(name)
        for adapter in layer.active_adapters:
            if adapter in layer.lora_embedding_A:
                problems.append(f"{name} (LoRA on an embedding)")
            elif adapter not in layer.lora_A:
                continue
            elif layer.use_dora.get(adapter) or adapter in getattr(layer, "lora_variant", {}):
                problems.append(f"{name} (DoRA or another LoRA variant)")
            elif not isinstance(layer.lora_A[adapter], nn.Linear) or not hasattr(layer, "fan_in_fan_out"):
                problems.append(f"{name} ({type(layer).__name__})")
    return problems


def _lora_layers(peft_model) -> tuple[dict[str, dict], list[str]]:
    """Each LoRA layer by name: its active adapters' scaling and `lora_B` leaves, and whether it
    transposes (`fan_in_fan_out`); and what cannot be merged. A model split over ranks (pipeline
    stages) knows only its own layers, so there every rank's are gathered (a collective)."""
    from peft.tuners.lora import LoraLayer

    modules = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    layers = {name: {"fan_in_fan_out": bool(getattr(layer, "fan_in_fan_out", False)),
                     "adapters": {a: (layer.scaling[a], [n for n, _ in layer.lora_B[a].named_parameters()])
                                  for a in layer.active_adapters if a in layer.lora_A}}
              for name, layer in modules.items()}
    problems = _unmergeable(peft_model, modules)
    if holds_part(peft_model):
        gathered: list = [None] * get_world_size()
        dist.all_gather_object(gathered, (layers, problems))
        layers = {name: layer for part, _ in gathered for name, layer in part.items()}
        problems = sorted({problem for _, part in gathered for problem in part})
    return layers, problems


def merge_recipe(peft_model, state_keys: dict) -> ExportRecipe:
    """How to write the merged model from the PEFT model's state (`state_keys`: state key -> tensor
    or shape, live or in a checkpoint): `names` maps each output name (the base model's, in the
    Hub's layout, tied aliases left out) to its state key, `views` a Hub tensor's region of it, and
    `merges` gives the LoRA terms `[A key or None, B key, scaling]` to add to an output tensor.
    Plain LoRA on linear layers only: anything else is refused by name with a CheckpointError."""
    layers, problems = _lora_layers(peft_model)
    if problems:
        raise CheckpointError(f"cannot export LoRA merged into the base weights: only plain LoRA on linear layers "
                              f"merges, not {', '.join(problems)}")
    aliases = {base_name(n) for n in alias_names(peft_model.get_base_model())}
    names, merges = {}, {}
    for key in state_keys:
        owner, _, leaf = key.rpartition(".")
        layer_name = owner[:-len(BASE_LAYER)] if owner.endswith(BASE_LAYER) else None
        if layer_name not in layers:
            if not any(owner == n or owner.startswith(n + ".") for n in layers) and base_name(key) not in aliases:
                names[base_name(key)] = key  # not part of a LoRA layer: as it is
            continue
        layer, out = layers[layer_name], base_name(key)
        names[out] = key
        terms = [[f"{layer_name}.lora_A.{a}.weight" if leaf == "weight" else None,
                  f"{layer_name}.lora_B.{a}.{leaf}", scaling]
                 for a, (scaling, b_leaves) in layer["adapters"].items() if leaf == "weight" or leaf in b_leaves]
        if terms:
            merges[out] = {"terms": terms, "fan_in_fan_out": layer["fan_in_fan_out"]}
    adapter = peft_model.active_adapter
    shapes = {k: tuple(getattr(v, "shape", v)) for k, v in state_keys.items()}
    recipe = hub_recipe(peft_model.get_base_model(), names, merges, shapes)
    recipe.adapter = {"name": adapter, "files": adapter_file_names(state_keys, adapter)}
    return recipe


def export_merged(peft_model, output_dir: str | os.PathLike, tokenizer=None, dtype=None,
                  max_shard_size: int | str = "5GB") -> Path:
    """A plain Hugging Face directory of the base model with the LoRA adapters merged in; call on
    every rank. Loads with `AutoModelForCausalLM.from_pretrained` and gives the LoRA model's logits."""
    if not is_peft_model(peft_model):
        raise TypeError(f"export_merged needs a peft.PeftModel, got {type(peft_model).__name__}")
    reshard_all(peft_model)
    state = peft_model.state_dict()
    return write_export(peft_model.get_base_model(), output_dir, state, merge_recipe(peft_model, state),
                        tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size)


__all__ = ["adapter_file_names", "base_name", "export_merged", "is_peft_model", "merge_recipe", "save_adapter",
           "write_adapter_config"]
