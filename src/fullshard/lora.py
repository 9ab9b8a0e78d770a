"""PEFT LoRA on sharded models: adapters on a meta-device base, loaded under PEFT's names.

The base model of a LoRA run is the big part and is frozen; the adapters are small. So:
- `apply_lora` wraps a model whose base is still on the meta device (built by
  `init_empty_model`) and initialises the adapters on the CPU exactly as `get_peft_model` would on
  a loaded model (same RNG draws, same dtype casts), where plain PEFT would leave them on meta
  (LLaMA-Factory refuses LoRA on meta for that reason).
- `lora_checkpoint_view` tells the loader that the base weights sit under PEFT's names
  (`base_model.model.` prefix, `.base_layer.` infix) and that the adapters are not in the
  checkpoint but keep the values `apply_lora` gave them.
- the adapter save and the merged export are `fullshard.hf.lora`'s (importable from here too).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .errors import ConfigError
from .hf.lora import (  # the adapter save and merged export: their old home is this module
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_LAYER,
    PEFT_PREFIX,
    adapter_file_names,
    base_name,
    export_merged,
    is_peft_model,
    merge_recipe,
    save_adapter,
    write_adapter_config,
)
from .hf.recipe import merge_lora


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
        raise ConfigError(f"bad LoRA config {config!r}: {err}") from None


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


@contextlib.contextmanager
def _quiet_peft_wrapping():
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model, which
    printed the same FutureWarning once per rank on every LoRA run; it is about PEFT, not the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


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
    with _adapters_kept_off_meta(recorded), _quiet_peft_wrapping():
        try:
            peft_model = get_peft_model(model, config, adapter_name=adapter_name, **peft_kwargs)
        except ValueError as err:  # peft has no default modules for this type (most VLMs)
            if config.target_modules is not None or "target_modules" not in str(err):
                raise
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ConfigError(f"lora.target_modules: PEFT has no default modules to adapt for {model_type!r}; "
                              "name them, e.g. lora.target_modules=[q_proj,v_proj]") from None
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
        return base_name(state_name)


def lora_checkpoint_view(peft_model) -> LoraCheckpointView:
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapters = set()
    for module_name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer):
            for adapter in module.active_adapters:
                adapters.update(f"{module_name}.{n}" for n in _adapter_parameters(module, adapter))
    return LoraCheckpointView(peft_model.get_base_model(), frozenset(adapters))


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_LAYER", "PEFT_PREFIX", "LoraCheckpointView", "adapter_file_names",
           "apply_lora", "base_name", "export_merged", "is_peft_model", "lora_checkpoint_view", "lora_config",
           "merge_lora", "merge_recipe", "save_adapter", "write_adapter_config"]
