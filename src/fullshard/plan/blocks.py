"""Which modules are a model's repeated blocks, its final norm and its head: what the auto plan
shards one unit each, found from the model's structure rather than a family table.

Blocks are those the model declares (`_no_split_modules`, transformers' `GradientCheckpointingLayer`),
else the largest `ModuleList` of identical modules; only the outermost when blocks nest (an MoE
sparse block inside a decoder layer); a VLM's vision blocks come from each tower's block list.
"""

from __future__ import annotations

from torch import nn

from .towers import _is_within, block_list, find_towers

BLOCK_CONTAINER_PATHS = ("layers", "model.layers", "h", "transformer.h", "blocks", "model.blocks", "encoder.layer")


def get_transformer_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of the repeated blocks (see `find_blocks` for how they are found)."""
    modules = dict(model.named_modules())
    return {type(modules[name]) for name in find_blocks(model)}


def _declared_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Block classes the model names itself, by the first source that names any.

    Order: the model's `_no_split_modules`, then transformers' `GradientCheckpointingLayer`
    subclasses, then the class of the children of a `layers` / `model.layers` / `h` / `blocks`
    ModuleList.
    """
    present = {type(m) for m in model.modules()}
    by_name = {cls.__name__: cls for cls in present}
    no_split = getattr(model, "_no_split_modules", None) or []
    classes = {by_name[n] for n in no_split if n in by_name}
    if classes:
        return classes
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        classes = {cls for cls in present if issubclass(cls, GradientCheckpointingLayer)}
    except ImportError:
        classes = set()
    if classes:
        return classes
    container = _block_container(model)
    return {type(m) for m in container} if container is not None else set()


def get_transformer_layer_cls(model: nn.Module) -> type[nn.Module] | None:
    """The block class to wrap (LLaMA-Factory's single answer): the one with the most instances."""
    blocks = find_blocks(model)
    if not blocks:
        return None
    modules = dict(model.named_modules())
    counts: dict[type, int] = {}
    for name in blocks:
        counts[type(modules[name])] = counts.get(type(modules[name]), 0) + 1
    return max(counts, key=counts.get)


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the outermost block modules, in model order.

    Blocks the model declares (`_declared_block_classes`) win; a model that declares none
    (XLNet, XLM, Reformer, CPM-Ant) gets its repeated blocks found from its structure
    (`_repeated_block_lists`).
    """
    classes = tuple(_declared_block_classes(model))
    if not classes:
        lists = _repeated_block_lists(model)
        return [f"{name}.{index}" for name in lists for index in range(len(model.get_submodule(name)))]
    blocks: list[str] = []
    for name, module in model.named_modules():
        if name and isinstance(module, classes) and not any(_is_within(name, b) for b in blocks):
            blocks.append(name)
    return _with_tower_blocks(model, blocks)


def _with_tower_blocks(model: nn.Module, blocks: list[str]) -> list[str]:
    """A VLM's encoder towers (vision, audio) and projector get their blocks from their structure (the
    largest list of identical modules in each), not from the classes the model declares: those name an
    attention module (Idefics3, SmolVLM, Ovis2) or nothing of the tower (GOT-OCR2), leaving whole towers in the root."""
    towers = find_towers(model)
    if not towers:
        return blocks
    side = towers.encoders + towers.projector
    kept = [b for b in blocks if not any(_is_within(b, t) for t in side)]
    for tower in towers.encoders:
        name = block_list(model, tower)
        kept += [] if name is None else [f"{name}.{i}" for i in range(len(model.get_submodule(name)))]
    for tower in towers.projector:
        if any(_is_within(tower, v) for v in towers.vision):  # a merger inside the vision tower: its own unit(s)
            continue
        module = model.get_submodule(tower)
        kept += [f"{tower}.{name}.{i}" for name in _repeated_block_lists(module)
                 for i in range(len(module.get_submodule(name)))]
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(kept, key=order.__getitem__)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeated_block_lists(model: nn.Module) -> list[str]:
    """The ModuleList of identical blocks holding the most parameters, with its parallel siblings.

    Parallel siblings are lists beside it of the same length that hold at least a quarter of its
    parameters: XLM keeps each layer's attention and feed-forward in two such lists, and both
    deserve a unit per layer (its per-layer norms, far smaller, stay in the root).
    """
    lists = {
        name: module for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1
        and len({type(m) for m in module}) == 1 and parameter_count(module) > 0
    }
    if not lists:
        return []
    largest = max(lists, key=lambda n: parameter_count(lists[n]))
    parent, size = largest.rpartition(".")[0], parameter_count(lists[largest])
    return [
        name for name, module in lists.items()
        if name == largest or (name.rpartition(".")[0] == parent and len(module) == len(lists[largest])
                               and 4 * parameter_count(module) >= size)
    ]


def _block_container(model: nn.Module) -> nn.ModuleList | None:
    for path in BLOCK_CONTAINER_PATHS:
        module = _get_submodule(model, path)
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return module
    return None


def _get_submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def module_name_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def find_final_norm(model: nn.Module, blocks: list[str]) -> str | None:
    """The norm applied after the last block, found the way the model defines it: a norm held by
    the module that holds the block list, registered after that list (LFM2's `embedding_norm`,
    whatever its name), else the only one it holds (OPT registers its final norm before its layers).

    A norm is a module whose class says it is one (`LayerNorm`, `LlamaRMSNorm`, ...) and that has
    parameters. The last block that trains decides, not the last one registered: BLT registers a
    frozen side model (`model.patcher`, with a norm of its own) after its decoder.
    """
    if not blocks:
        return None
    trainable = [b for b in blocks if any(p.requires_grad for p in model.get_submodule(b).parameters())]
    last = (trainable or blocks)[-1]
    container = last.rpartition(".")[0]  # "model.layers.3" -> "model.layers"
    parent, _, list_name = container.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    children = [name for name, _ in holder.named_children()]
    norms = [name for name, module in holder.named_children() if _is_norm(module) and parameter_count(module)]
    after = [n for n in norms if list_name in children and children.index(n) > children.index(list_name)]
    chosen = after[0] if after else norms[0] if len(norms) == 1 else None
    return None if chosen is None else f"{parent}.{chosen}" if parent else chosen


def _is_norm(module: nn.Module) -> bool:
    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, norm_types) or "norm" in type(module).__name__.lower()


def head_modules(model: nn.Module, head: str | None, blocks: list[str]) -> list[str]:
    """The output head and the task model's own modules that run with it: those registered after
    its base model (ModernBERT-decoder's prediction head `lm_head`, with its dense layer and norm,
    runs between the final norm and the `decoder` projection; BERT's `cls` holds its transform)."""
    base = getattr(model, "base_model", None)
    children = dict(model.named_children())
    base_name = next((name for name, module in children.items() if module is base), None)
    names = list(children)
    extra = [] if base_name is None else [
        name for name in names[names.index(base_name) + 1:]
        if parameter_count(children[name]) and not any(_is_within(b, name) for b in blocks)]
    found = extra + ([head] if head is not None else [])
    return [n for n in dict.fromkeys(found) if not any(_is_within(n, other) and n != other for other in found)]


