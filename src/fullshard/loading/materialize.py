"""Models on the meta device: building them, giving them storage, and checking what storage holds.

A model's tensors fall in three classes, each needing its own care:
- parameters: built on meta (no memory, no init compute), filled from the checkpoint;
- persistent buffers: in the state dict, so filled from the checkpoint like parameters;
- non-persistent buffers (rotary `inv_freq`, BERT `position_ids`): not in any checkpoint, yet
  `to_empty` replaces them with garbage like everything else. They are snapshotted before
  materialising and put back after, or, when the model was built entirely on meta, recomputed
  by the model's own `_init_weights`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..tensors import local_tensor


@contextlib.contextmanager
def meta_init():
    """Build parameters on the meta device and keep buffers real (computed by their module's code).

    Like accelerate's `init_empty_weights(include_buffers=False)`: a parameter is moved to meta as
    soon as it is registered, while buffers such as `inv_freq` keep the values their constructor
    computed. The meta parameters are marked initialised while the model is built, so transformers'
    `_init_weights` skips them (init ops on meta still cost a Python decomposition each) and only
    initialises the buffers.
    """
    original = nn.Module.register_parameter
    created: list[nn.Parameter] = []

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = on_meta(param)
            meta._is_hf_initialized = True  # transformers' init functions skip it: no init compute on meta
            module._parameters[name] = meta
            created.append(meta)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        for param in created:  # a later `_init_weights` (strict=False, missing keys) must not skip them
            param.__dict__.pop("_is_hf_initialized", None)


def on_meta(param: nn.Parameter) -> nn.Parameter:
    """`param` moved to meta, of its own class and with its attributes. A subclass (bitsandbytes'
    `Params4bit`) takes its public attributes as constructor arguments; private ones, such as the
    `_is_hf_initialized` transformers sets while loading, are copied after."""
    cls, attributes = type(param), dict(param.__dict__)
    public = {} if cls is nn.Parameter else {k: v for k, v in attributes.items() if not k.startswith("_")}
    meta = cls(param.to("meta"), requires_grad=param.requires_grad, **public)
    meta.__dict__.update(attributes)
    return meta


def init_empty_model(config, model_class=None, dtype: torch.dtype | None = None, trust_remote_code: bool = False):
    """A transformers model built from `config` under `meta_init`: meta parameters, real buffers.

    `model_class` defaults to the first of `config.architectures` that transformers knows, then
    to `AutoModelForImageTextToText` for a VLM config, then to `AutoModelForCausalLM`.
    """
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if model_class is None and trust_remote_code:
        # the repository's own class, found through its config's auto_map: only the auto class knows it
        from transformers import AutoModelForCausalLM

        model_class, kwargs["trust_remote_code"] = AutoModelForCausalLM, True
    elif model_class is None:
        model_class = _model_class_for(config)
    with meta_init():
        if hasattr(model_class, "_from_config") and "trust_remote_code" not in kwargs:
            model = model_class._from_config(config, **kwargs)
        else:
            model = model_class.from_config(config, **kwargs)
    name = getattr(config, "_name_or_path", None)
    if name:
        model.config._name_or_path = name
    return model


def _model_class_for(config):
    """The class the checkpoint was saved from when transformers has it, else the causal-LM auto class."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if type(config) in transformers.AutoModelForImageTextToText._model_mapping and getattr(config, "sub_configs", None):
        return transformers.AutoModelForImageTextToText  # a VLM config: its image-text-to-text class
    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    raise ValueError(
        f"no model class for config {type(config).__name__}: architectures={getattr(config, 'architectures', None)} "
        "names no transformers class and it is not a causal LM; pass model_class"
    )


def tie_declared_weights(model: nn.Module) -> list[str]:
    """Tie the weights the model's config declares tied but that were built apart on meta; returns
    the tied names that were apart.

    accelerate's `init_empty_weights` re-creates every parameter it sees registered, the tied one
    included, so a model built under it (LLaMA-Factory's meta init) comes out untied: planned that
    way, its head would be sharded as a second tensor that no checkpoint fills. Only ends that are
    both on meta are tied: a loaded model untied by hand keeps the weights it holds.
    """
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if expand is None or not hasattr(model, "tie_weights"):
        return []
    try:
        declared = expand(all_submodels=True)
        tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
    except (AttributeError, KeyError, TypeError):  # a custom class with its own idea of ties
        return []
    apart = [target for target, source in declared.items()
             if target in tensors and source in tensors and tensors[target] is not tensors[source]
             and tensors[target].is_meta and tensors[source].is_meta]
    if apart:
        model.tie_weights()
    return apart


@dataclass
class BufferSnapshot:
    """Every buffer's dtype and, when it was real, its value, taken before `to_empty`."""

    values: dict[str, torch.Tensor | None] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    non_persistent: set[str] = field(default_factory=set)


def named_buffer_slots(model: nn.Module):
    """(name, owning module, attribute, persistent) for every buffer name, ties included."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is not None:
                name = f"{module_name}.{attr}" if module_name else attr
                yield name, module, attr, attr not in module._non_persistent_buffers_set


def snapshot_buffers(model: nn.Module) -> BufferSnapshot:
    snap = BufferSnapshot()
    for name, module, attr, persistent in named_buffer_slots(model):
        buf = module._buffers[attr]
        snap.values[name] = None if buf.is_meta else buf.detach().clone()
        snap.dtypes[name] = buf.dtype
        if not persistent:
            snap.non_persistent.add(name)
    return snap


def materialize(model: nn.Module, device: torch.device | str, snapshot: BufferSnapshot, fill: bool) -> list[str]:
    """Give every tensor storage on `device`, put real buffers back, recompute meta ones.

    `fill` poisons the fresh storage (NaN, or the smallest integer) so `find_unfilled` can prove
    later that the loader wrote every element. Returns the non-persistent buffers that had to be
    recomputed by `_init_weights` because they were on meta.
    """
    model.to_empty(device=device)
    if fill:
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                _poison(tensor)
    recompute: dict[int, nn.Module] = {}
    recomputed = []
    for name, module, attr, _ in named_buffer_slots(model):
        value = snapshot.values.get(name)
        if value is not None:
            module._buffers[attr] = value.to(device)
            continue
        if module._buffers[attr].dtype != snapshot.dtypes[name]:
            module._buffers[attr] = torch.empty_like(module._buffers[attr], dtype=snapshot.dtypes[name])
            if fill:
                _poison(module._buffers[attr])
        if name in snapshot.non_persistent:
            recompute[id(module)] = module
            recomputed.append(name)
    if recompute:
        init = getattr(model, "_init_weights", None)
        if init is None:
            raise RuntimeError(
                f"non-persistent buffers {recomputed} were built on meta and {type(model).__name__} has no "
                "_init_weights to recompute them; build the model under fullshard.loading.meta_init()"
            )
        with torch.no_grad():
            for module in recompute.values():
                init(module)
    return recomputed


def _poison(tensor: torch.Tensor) -> None:
    local = local_tensor(tensor)
    if local.is_floating_point() or local.is_complex():
        local.fill_(float("nan"))
    elif local.dtype != torch.bool:
        local.fill_(torch.iinfo(local.dtype).min)


def find_unfilled(model: nn.Module, skip: set[str] = frozenset()) -> list[str]:
    """Names of tensors whose local storage still holds the poison `materialize(fill=True)` wrote."""
    bad = []
    seen = set()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if name in skip or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = local_tensor(tensor)
        if local.is_floating_point() or local.is_complex():
            if torch.isnan(local).any():
                bad.append(name)
        elif local.dtype != torch.bool and local.numel() and (local == torch.iinfo(local.dtype).min).any():
            bad.append(name)
    return bad


def broken_ties(model: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return [names for names in groups if len({id(params[n]) for n in names}) > 1]
