"""Small FSDP2 helpers that every layer above uses: the ground floor, importing nothing above `plan`.

They live here rather than in `engine` so that loading, checkpoints, the optimizer and LoRA can
use them without importing the engine (which would close an import circle through loading).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError
from .plan.blocks import find_blocks


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def model_class_name(model: nn.Module) -> str:
    """The class the user built (`LlamaForCausalLM`), not the `FSDPLlamaForCausalLM` that
    `fully_shard` swaps in: what an exported config must name for `from_pretrained`."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state.

    After a `no_grad` forward the root unit stays unsharded; an optimizer built then would hold
    the unsharded tensors and silently never update the real parameters.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def needs_weight_in_backward(module: nn.Module) -> bool:
    """False for a plain `nn.Embedding`: its backward reads only the indices and the incoming
    gradient, so a unit made of embeddings alone need not be all-gathered again for backward
    (`FSDPModule.set_unshard_in_backward(False)`: one all-gather of the table less per step)."""
    plain_embedding = isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
    split = getattr(module, "_distribute_module_applied", False)  # a TP style's DTensor dispatch: left as is
    return not (plain_embedding and module.max_norm is None and not module.sparse and not split)


# the names a transformers block takes its KV (or state) cache by, old and new
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")

# `activation_checkpointing`'s values: `full` recomputes every block, `selective` keeps the outputs
# of the costly ops (torchtitan's per-op policy), `every_n` recomputes every n-th block whole
AC_MODES = ("none", "full", "selective", "every_n")


def ac_mode(value) -> str:
    """The checkpointing mode a config value names; the booleans are `full` and `none`."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(value, bool) or value is None:
        return "full" if value else "none"
    if value in AC_MODES:
        return value
    raise ConfigError(f"activation_checkpointing must be one of {', '.join(AC_MODES)} "
                      "(or true / false), "
                      f"got {value!r}")


def checkpointed_blocks(model: nn.Module, mode, every: int = 2) -> list[str]:
    """The blocks `mode` recomputes: all of them, none, or every `every`-th (the `every`-th, the
    2 x `every`-th, ...: torchtitan's `ac_freq` counting)."""
    mode = ac_mode(mode)
    names = find_blocks(model) if mode != "none" else []
    return names[every - 1::every] if mode == "every_n" else names


def apply_activation_checkpointing(model: nn.Module, mode="full", every: int = 2) -> list[str]:
    """Recompute the blocks `mode` names in backward (non-reentrant checkpointing); returns them.

    The block's `forward` is wrapped in place, not the module, so parameter names and state-dict
    keys stay exactly those of the checkpoint on disk. `selective` keeps the outputs that are
    dear to recompute (`selective_context`) and recomputes the rest.
    """
    modules = dict(model.named_modules())
    names = checkpointed_blocks(model, mode, every)
    context_fn = selective_context if ac_mode(mode) == "selective" else None
    for name in names:
        block = modules[name]
        if getattr(block, "_fullshard_checkpointed", False):
            continue
        block.forward = checkpointed(block.forward, context_fn)
        block._fullshard_checkpointed = True
    return names


def _matmuls() -> set:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}


def _kept_ops() -> set:
    """Ops whose outputs selective checkpointing always keeps: attention (every SDPA kernel) and the
    per-tensor max a float8 cast takes its scale from (torchtitan's list, less its collectives:
    FSDP's reduce-scatter runs outside the blocks here)."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten.max.default}


def selective_context():
    """torchtitan's per-op policy for one block call: keep the output of every other matmul (the
    1st, 3rd, ...) and of attention, recompute everything else (norms, activations, the other
    matmuls). The count starts afresh each call and runs apart in forward and recompute, so the
    recompute makes the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, kept = _matmuls(), _kept_ops()
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed(forward, context_fn=None):
    """`forward` recomputed in backward, and run without a cache whenever a backward may follow.

    A model whose config says `use_cache` hands every block a cache even in training; the block
    writes its keys into it, and the recompute writes them a second time (keys twice the mask's
    length: a crash on any padded batch; under a per-op policy, a recompute that issues other ops
    than the forward did). transformers' own checkpointing drops the cache the same way. Without
    gradients nothing is recomputed, so generation keeps its cache. The cache is found by name,
    passed by keyword or by position. `context_fn`: torch's selective checkpointing contexts.
    """
    positional = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    off = {name: None for name in CACHE_ARGUMENTS} | {"use_cache": False}
    off_at = {index: off[name] for index, name in enumerate(positional) if name in off}
    options = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            args = tuple(off_at[index] if index in off_at else arg for index, arg in enumerate(args))
            kwargs = {key: off[key] if key in off else value for key, value in kwargs.items()}
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


def fsdp_units(model: nn.Module) -> dict[tuple[str, ...], list[nn.Parameter]]:
    """What `fully_shard` actually built: each unit's module names and the parameters it manages.

    Read back from FSDP's own state rather than from the plan, so tests can prove the plan was
    applied as printed.
    """
    names = {id(m): n for n, m in model.named_modules()}
    units: dict[tuple[str, ...], list[nn.Parameter]] = {}
    seen_groups: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit left with no parameters of its own (e.g. a root whose children took all)
            units[(names[id(module)],)] = []
            continue
        if id(group) in seen_groups:
            continue
        seen_groups.add(id(group))
        units[tuple(names[id(m)] for m in group.modules)] = [p.sharded_param for p in group.fsdp_params]
    return units


def keep_output_capturing(model: nn.Module) -> None:
    """Let transformers record hidden states inside sharded sub-models. It keys what each model records
    by the model's class name, and `fully_shard` swaps the class (`FSDPCLIPVisionModel`): a vision
    tower made a unit would return no `hidden_states`, which Llava's image features are taken from."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule) and isinstance(module, PreTrainedModel):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
