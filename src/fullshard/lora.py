"""PEFT LoRA on sharded models: adapters on a meta-device base, adapter-only saves, merged export.

The base model of a LoRA run is the big part and is frozen; the adapters are small. So:
- `apply_lora` wraps a model whose base is still on the meta device (built by
  `init_empty_model`) and initialises the adapters on the CPU exactly as `get_peft_model` would on
  a loaded model (same RNG draws, same dtype casts), where plain PEFT would leave them on meta
  (seed 002: LLaMA-Factory refuses LoRA on meta for that reason).
- `lora_checkpoint_view` tells the loader that the base weights sit under PEFT's names
  (`base_model.model.` prefix, `.base_layer.` infix) and that the adapters are not in the
  checkpoint but keep the values `apply_lora` gave them.
- `save_adapter` gathers only the adapter tensors (one at a time) and writes PEFT's own format,
  which `PeftModel.from_pretrained` loads in one process.
- `export_merged` writes a plain Hugging Face directory with every adapter merged into its base
  weight, through the checkpoint package's export writer: one tensor gathered and merged at a time,
  so no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint.agree import broadcast_from_rank0, run_agreed
from .checkpoint.export import GatheredTensor, gather_full, staging_dir, export_hf
from .distributed import get_rank
from .engine import reshard_all

PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(config) -> "peft.LoraConfig":  # noqa: F821 - peft is imported lazily
    """A `peft.LoraConfig` from one or from a dict of its fields (`lora_alpha` may be given as `alpha`)."""
    from peft import LoraConfig

    if isinstance(config, LoraConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"lora must be a peft.LoraConfig or a dict of its fields, got {type(config).__name__}")
    values = dict(config)
    if "alpha" in values:
        values["lora_alpha"] = values.pop("alpha")
    if "dropout" in values:
        values["lora_dropout"] = values.pop("dropout")
    values.setdefault("task_type", "CAUSAL_LM")
    try:
        return LoraConfig(**values)
    except TypeError as err:
        raise ValueError(f"bad LoRA config {config!r}: {err}") from None


# --------------------------------------------------------------------------------- adapters on meta


def _adapter_parameters(layer, adapter_name: str) -> dict[str, nn.Parameter]:
    """The parameters of one adapter of a PEFT tuner layer, by their name inside the layer."""
    found = {}
    for attr in (*layer.adapter_layer_names, *layer.other_param_names):
        container = getattr(layer, attr, None)
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict)) and adapter_name in container:
            item = container[adapter_name]
            if isinstance(item, nn.Parameter):
                found[f"{attr}.{adapter_name}"] = item
            elif isinstance(item, nn.Module):
                found.update({f"{attr}.{adapter_name}.{n}": p for n, p in item.named_parameters()})
    return found


@contextlib.contextmanager
def _adapters_kept_off_meta(recorded: dict[int, dict[str, torch.Tensor]]):
    """While PEFT injects adapters, record the value each one has when PEFT moves it to its base
    layer's device; for a base on meta that move (and `_replace_module`'s) would drop the values.

    The value is taken after PEFT's own cast to the base layer's dtype, on the CPU, so restoring
    it later and casting to the parameter's final dtype repeats PEFT's arithmetic exactly.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def move(self, adapter_name, device=None):
        base = self.get_base_layer()
        weight = next(iter(base.parameters()), None)
        if device is not None or weight is None or not weight.is_meta:
            return original(self, adapter_name, device=device)
        original(self, adapter_name, device=torch.device("cpu"))
        values = recorded.setdefault(id(self), {})
        for name, param in _adapter_parameters(self, adapter_name).items():
            if not param.is_meta:
                values[name] = param.detach().clone()

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original


def apply_lora(model: nn.Module, config, adapter_name: str = "default", **peft_kwargs):
    """`peft.get_peft_model(model, config)` that also works when the base model is on meta.

    With the same torch seed the adapters equal those `get_peft_model` gives a loaded model: they
    are created on the CPU with the same random draws, and only the frozen base stays on meta, to
    be sharded and loaded by fullshard (`lora_checkpoint_view` tells the loader how). `config` is a
    `peft.LoraConfig` or a dict of its fields.
    """
    from peft import get_peft_model

    config = lora_config(config)
    recorded: dict[int, dict[str, torch.Tensor]] = {}
    with _adapters_kept_off_meta(recorded):
        peft_model = get_peft_model(model, config, adapter_name=adapter_name, **peft_kwargs)
    with torch.no_grad():
        for layer in peft_model.modules():
            for name, value in recorded.get(id(layer), {}).items():
                owner_path, _, attr = name.rpartition(".")
                owner = layer.get_submodule(owner_path)
                old = owner._parameters[attr]
                owner._parameters[attr] = type(old)(value.to(old.dtype), requires_grad=old.requires_grad)
    still_meta = [n for n, p in peft_model.named_parameters() if p.requires_grad and p.is_meta]
    if still_meta:
        raise RuntimeError(f"LoRA adapters {still_meta[:4]} were left on the meta device by peft; "
                           "this PEFT layer type is not supported on a meta base")
    return peft_model


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


@dataclass
class LoraCheckpointView:
    """How a PEFT model's tensors map onto the checkpoint of its base model, for `materialize_and_load`.

    `model` is the wrapped transformers model (its key conversions apply); `name(state_name)` is the
    checkpoint-side name of a PEFT state name, or None for adapter tensors, which the checkpoint
    does not hold and which keep the values they had before materialising.
    """

    model: nn.Module
    adapter_names: frozenset[str]

    def name(self, state_name: str) -> str | None:
        if state_name in self.adapter_names:
            return None
        return state_name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER + ".", ".")


def lora_checkpoint_view(peft_model) -> LoraCheckpointView:
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapters = set()
    for module_name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer):
            for adapter in module.active_adapters:
                adapters.update(f"{module_name}.{n}" for n in _adapter_parameters(module, adapter))
    return LoraCheckpointView(peft_model.get_base_model(), frozenset(adapters))


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
    keep = get_rank() == 0
    tensors = {}
    for key, tensor in selected.items():
        full = gather_full(tensor)
        if keep:
            tensors[key] = full.to("cpu").contiguous()
        del full
    config = peft_model.peft_config[adapter_name]
    staging = Path(broadcast_from_rank0(str(staging_dir(output_dir)) if keep else None))

    def write() -> None:
        staging.mkdir(parents=True)
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(peft_model.get_base_model().config, "_name_or_path", None)
        config.save_pretrained(str(staging))
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


# --------------------------------------------------------------------------------- merged export


def _merge_for(layer, adapters: list[str], base_weight: torch.Tensor):
    """A collective returning `base_weight` with the adapters merged, as PEFT's `Linear.merge` does:
    W + transpose(B @ A, fan_in_fan_out) * scaling, the delta cast to W's dtype."""
    from peft.utils.other import transpose

    def gather() -> torch.Tensor:
        merged = gather_full(base_weight).clone()
        for adapter in adapters:
            a = gather_full(layer.lora_A[adapter].weight)
            b = gather_full(layer.lora_B[adapter].weight)
            delta = transpose(b.float() @ a.float(), layer.fan_in_fan_out) * layer.scaling[adapter]
            merged += delta.to(merged.dtype)
        return merged

    return gather


def _merge_bias_for(layer, adapters: list[str], base_bias: torch.Tensor | None):
    def gather() -> torch.Tensor:
        merged = gather_full(base_bias).clone()
        for adapter in adapters:
            merged += (gather_full(layer.lora_B[adapter].bias) * layer.scaling[adapter]).to(merged.dtype)
        return merged

    return gather


def merged_state(peft_model) -> dict[str, torch.Tensor | GatheredTensor]:
    """The base model's state dict under its own names, every LoRA layer's weight merged lazily.

    Only plain LoRA on `nn.Linear`-like layers is merged here; DoRA and other variants are refused
    by name rather than exported wrong.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    problems = []
    for name, layer in layers.items():
        for adapter in layer.active_adapters:
            if adapter in layer.lora_embedding_A:
                problems.append(f"{name} (LoRA on an embedding)")
            elif adapter not in layer.lora_A:
                continue
            elif layer.use_dora.get(adapter) or adapter in getattr(layer, "lora_variant", {}):
                problems.append(f"{name} (DoRA or another LoRA variant)")
            elif not isinstance(layer.lora_A[adapter], nn.Linear) or not hasattr(layer, "fan_in_fan_out"):
                problems.append(f"{name} ({type(layer).__name__})")
    if problems:
        raise NotImplementedError(f"export_merged merges plain LoRA on linear layers only; cannot merge {problems}")
    state: dict[str, torch.Tensor | GatheredTensor] = {}
    for key, tensor in base.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner.endswith(BASE_LAYER) and owner[:-len(BASE_LAYER)] in layers:
            layer_name = owner[:-len(BASE_LAYER)]
            layer = layers[layer_name]
            adapters = [a for a in layer.active_adapters if a in layer.lora_A]
            if leaf == "weight":
                gather = _merge_for(layer, adapters, tensor)
            elif leaf == "bias" and any(layer.lora_B[a].bias is not None for a in adapters):
                gather = _merge_bias_for(layer, adapters, tensor)
            else:
                state[f"{layer_name}.{leaf}"] = tensor
                continue
            state[f"{layer_name}.{leaf}"] = GatheredTensor(tuple(tensor.shape), tensor.dtype, gather)
        elif not any(owner == n or owner.startswith(n + ".") for n in layers):
            state[key] = tensor
    return state


def export_merged(peft_model, output_dir: str | os.PathLike, tokenizer=None, dtype=None,
                  max_shard_size: int | str = "5GB") -> Path:
    """A plain Hugging Face directory of the base model with the LoRA adapters merged in; call on
    every rank. Loads with `AutoModelForCausalLM.from_pretrained` and gives the LoRA model's logits."""
    if not is_peft_model(peft_model):
        raise TypeError(f"export_merged needs a peft.PeftModel, got {type(peft_model).__name__}")
    reshard_all(peft_model)
    state = merged_state(peft_model)
    return export_hf(peft_model.get_base_model(), output_dir, tokenizer=tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size, tensors=state)


__all__ = ["LoraCheckpointView", "apply_lora", "export_merged", "is_peft_model", "lora_checkpoint_view",
           "lora_config", "merged_state", "save_adapter"]
