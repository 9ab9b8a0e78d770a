"""float8 training through torchao (`torchao.float8`): the decoder's linear layers compute in float8.

The blocks' `nn.Linear` layers become torchao `Float8Linear`s before sharding (torchtitan's order):
their weights stay in the model's dtype (the masters, gradients, optimizer state, checkpoints and
exports never see float8: a float8 run resumes without float8 and vice versa), and each matmul
casts its inputs to float8 with a scale per tensor (`tensorwise`) or per row (`rowwise`, more
accurate, slower). Kept in high precision, each said once: the output head and the embeddings
(outside the blocks), MoE routers (their top-k is sensitive to rounding), LoRA's adapters, layers
whose dimensions float8 GEMMs cannot take (multiples of 16), and what `fsdp.float8_skip` names.

With `tensorwise`, FSDP all-gathers the weights already cast to float8 (half the bytes of bf16:
torchao's `enable_fsdp_float8_all_gather`), and their scales are computed for the whole model in
one all-reduce after every optimizer step (`precompute_float8_dynamic_scale_for_fsdp`, registered
on optimizers `fullshard.optim.create_optimizer` builds; call `precompute_scales` after your own
optimizer's step otherwise). torchao refuses the float8 all-gather for `rowwise`, which gathers in
the compute dtype. The same weight path is taken at every world size, so one process and many
compute the same float8 values.

torchao is imported only when a model is converted: a refusal before launch does not load its
native libraries (which print warnings where they do not match the machine).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from .errors import ConfigError
from .log import log_rank0
from .towers import glob_regex

RECIPES = ("none", "tensorwise", "rowwise")
GEMM_MULTIPLE = 16  # float8 GEMMs (`torch._scaled_mm`) take dimensions that divide by 16


def check_float8_config(recipe: str, skip, tp_size: int = 1) -> None:
    """The float8 settings checked from the values alone (no torchao import): one line each."""
    if recipe not in RECIPES:
        raise ConfigError(f"float8 must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if not isinstance(skip, (list, tuple)) or not all(isinstance(g, str) for g in skip):
        raise ConfigError(f"float8_skip must be a list of module-name globs, got {skip!r}")
    if recipe == "none":
        return
    if tp_size > 1:
        raise ConfigError("float8 with tp_size > 1 is not supported yet (torchao's float8 TP styles "
                          "are not wired to transformers' TP plans): set float8=none or tp_size=1")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"float8={recipe} needs torchao: pip install 'fullshard[float8]'")


def check_float8_device(device: torch.device) -> None:
    """float8 matmuls need an SM 8.9+ GPU (Ada, Hopper, Blackwell) or the CPU (torch's reference
    kernels: correct, not fast)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"float8 needs a GPU of compute capability 8.9 or newer (H100, L40S, B200); "
                          f"{name} is {'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def float8_choices(model: nn.Module, skip=()) -> tuple[list[str], dict[str, str]]:
    """(the Linear layers float8 converts, {layer kept in high precision: why}): only plain
    `nn.Linear`s inside the model's blocks are candidates; the head and embeddings sit outside."""
    from .plan import find_blocks

    patterns = [glob_regex(g) for g in skip]
    modules = dict(model.named_modules())
    converted, kept = [], {}
    for block in find_blocks(model):
        for local, module in modules[block].named_modules():
            if type(module) is not nn.Linear:
                continue
            name = f"{block}.{local}" if local else block
            parent = modules.get(name.rpartition(".")[0])
            if any(p.fullmatch(name) for p in patterns):
                kept[name] = "fsdp.float8_skip"
            elif "lora_" in name:
                kept[name] = "a LoRA adapter"
            elif ".experts." in f".{local}.":
                kept[name] = "a MoE expert"
            elif parent is not None and hasattr(parent, "experts") and local.rpartition(".")[2] in ROUTERS:
                kept[name] = "a MoE router"
            elif module.in_features % GEMM_MULTIPLE or module.out_features % GEMM_MULTIPLE:
                kept[name] = (f"{module.in_features} x {module.out_features}: not multiples of "
                              f"{GEMM_MULTIPLE}")
            else:
                converted.append(name)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    names = {id(m): n for n, m in modules.items()}
    if head is not None and id(head) in names:
        kept.setdefault(names[id(head)], "the output head")
    return converted, kept


ROUTERS = ("gate", "router")  # a MoE block's router Linear, beside its `experts`


def linear_config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return Float8LinearConfig.from_recipe_name(recipe)


def convert_to_float8(model: nn.Module, recipe: str, skip=()) -> list[str]:
    """Turn the chosen Linear layers of `model` (on meta or real, before sharding) into torchao's
    `Float8Linear`; returns their names. The layers kept in high precision are said once."""
    if recipe == "none":
        return []
    converted, kept = float8_choices(model, skip)
    if not converted:
        raise ConfigError(f"float8={recipe}: no Linear layer of the model's blocks can compute in float8 "
                          f"({len(kept)} kept: {', '.join(sorted(set(kept.values())))})")
    from torchao.float8 import convert_to_float8_training

    chosen = set(converted)
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name in chosen,
                               config=linear_config(recipe))
    said = "; ".join(f"{name} ({why})" for name, why in kept.items()) or "none"
    log_rank0(f"float8 {recipe}: {len(converted)} Linear layers in float8; kept in high precision: {said}",
              once=True)
    for name in converted:  # marked on the layers: a pipeline rank's module shares them with its stages
        model.get_submodule(name)._fullshard_float8 = recipe
    return converted


def float8_modules(model: nn.Module) -> list[str]:
    """Names of the modules computing in float8 (torchao's `Float8Linear`)."""
    if importlib.util.find_spec("torchao") is None:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def precompute_scales(model: nn.Module) -> None:
    """tensorwise: every float8-gathered weight's scale for the next all-gather, in one all-reduce
    for the whole model (torchao's recommendation, after each optimizer step); otherwise nothing."""
    if not gathers_float8(model):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def gathers_float8(model: nn.Module) -> bool:
    """Whether any layer of `model` was converted with the tensorwise recipe (float8 all-gather)."""
    return any(getattr(m, "_fullshard_float8", None) == "tensorwise" for m in model.modules())


def register_scale_precompute(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Precompute the tensorwise float8 scales after every step of `optimizer` (a no-op otherwise)."""
    if gathers_float8(model):
        optimizer.register_step_post_hook(lambda *_: precompute_scales(model))
