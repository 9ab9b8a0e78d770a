"""The towers of a vision-language model, found from its structure, and freezing them.

A transformers VLM builds each tower from one of its config's sub-configs: the language model
from `text_config`, the vision encoder from `vision_config` (whatever the attribute is called:
`visual`, `vision_tower`, `vision_model`, `image_tower`...), an Omni model's audio encoder from
`audio_config`. So the towers are the outermost modules whose own `config` is one of the model's
sub-configs, each of the modality its sub-config names; the projector is whatever else the module
holding the language tower owns (`multi_modal_projector`, `connector`, `mlp1`...), or, where that is
nothing, the mergers the vision tower runs after its blocks. No family table: a new VLM whose towers
are built from its sub-configs is found the same way. An audio tower is one part, its convolutions
and its projection into the language model's width included (`projector` is the vision side's).

`freeze` takes the words `vision`, `audio`, `projector`, `language` (the language tower with its
head) or glob patterns over parameter names (`*` one name segment, `**` any), and sets
`requires_grad` before sharding, so frozen parts get no gradients and no optimizer state. The default
("auto") freezes a VLM's encoder towers, vision and audio, and trains the projector and language
model: what LLaMA-Factory's `freeze_vision_tower: true` does (its Qwen2.5-Omni vision keys hold the
audio tower), ms-swift's `freeze_vit` and NeMo AutoModel's Omni recipes (`freeze_audio_tower: true`);
fullshard's data has no audio, so an audio tower would see none anyway. `freeze=[]` trains everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import ConfigError

WORDS = ("vision", "audio", "projector", "language")


@dataclass
class Towers:
    """Module names of each part; empty lists for a model that is not a VLM."""

    vision: list[str] = field(default_factory=list)
    audio: list[str] = field(default_factory=list)
    projector: list[str] = field(default_factory=list)
    language: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.vision)

    def of(self, word: str) -> list[str]:
        return getattr(self, word)

    @property
    def encoders(self) -> list[str]:
        """The towers that encode a modality for the language model: vision and audio."""
        return self.vision + self.audio


def _sub_configs(config) -> dict[str, object]:
    return {key: getattr(config, key) for key in getattr(config, "sub_configs", None) or {}
            if getattr(config, key, None) is not None}


def _is_within(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_towers(model: nn.Module) -> Towers:
    """The vision towers, projector modules and language tower of `model` (see the module docstring)."""
    subs = _sub_configs(getattr(model, "config", None))
    text = subs.get("text_config")
    if not subs or text is None:
        return Towers()
    owners: dict[str, str] = {}  # outermost module -> the sub-config key it was built from
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or any(_is_within(name, o) for o in owners):
            continue
        key = next((k for k, c in subs.items() if c is config), None)
        if key is not None and name and _has_parameters(module):
            owners[name] = key
    language = [n for n, k in owners.items() if k == "text_config"]
    if len(language) != 1:
        return Towers()
    parent = language[0].rpartition(".")[0]
    holder = model.get_submodule(parent) if parent else model
    children = {f"{parent}.{n}" if parent else n: m for n, m in holder.named_children()}
    # the modality a tower encodes is the one its sub-config names (`vision_config`, `audio_config`);
    # one built from another (a perceiver's, a Q-Former's) is part of what connects the towers
    vision = [n for n, k in owners.items() if "vision" in k and n in children]
    audio = [n for n, k in owners.items() if "audio" in k and n in children]
    if not vision:
        return Towers()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    projector = [n for n, m in children.items() if n not in vision + audio and n != language[0] and _has_parameters(m)
                 and not any(p is getattr(embedding, "weight", None) for p in m.parameters())]
    if not projector:  # the projector lives in the vision tower (Qwen's `visual.merger`)
        projector = [p for t in vision for p in _mergers(model, t)]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    heads = [n for n, m in model.named_modules() if head is not None and m is head and not _is_within(n, parent or n)]
    return Towers(vision=vision, audio=audio, projector=projector, language=language + heads)


def block_list(model: nn.Module, tower: str) -> str | None:
    """The list of modules of one class holding a tower's blocks: one whose class the model declares a
    block (`_no_split_modules`) if any, else the one holding the most parameters."""
    declared = set(getattr(model, "_no_split_modules", None) or [])
    lists = {f"{tower}.{name}": m for name, m in model.get_submodule(tower).named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1 and _has_parameters(m)}
    if not lists:
        return None
    # through the class's bases: fully_shard's FSDP<Block> subclass is still the declared block
    named = [n for n, m in lists.items() if any(c.__name__ in declared for c in type(m[0]).__mro__)]
    return max(named or lists, key=lambda n: sum(p.numel() for p in lists[n].parameters()))


def _mergers(model: nn.Module, tower: str) -> list[str]:
    """A vision tower's merger(s) into the language model's width: its children registered after its
    blocks that are not norms (Qwen's `merger`, Qwen3-VL's `deepstack_merger_list`), and wherever they
    are registered, lists of a merger's class (Qwen3-Omni's deepstack `merger_list`, before its blocks)."""
    blocks = block_list(model, tower)
    if blocks is None:
        return []
    module = model.get_submodule(tower)
    children = dict(module.named_children())
    holder = blocks[len(tower) + 1:].split(".")[0]
    after = list(children)[list(children).index(holder) + 1:]
    mergers = [name for name in after if _has_parameters(children[name])
               and "norm" not in type(children[name]).__name__.lower()]
    kinds = {type(children[name]) for name in mergers}
    lists = [name for name, child in children.items() if name not in mergers and isinstance(child, nn.ModuleList)
             and len(child) and all(type(m) in kinds for m in child)]
    return [f"{tower}.{name}" for name in children if name in mergers or name in lists]


def glob_regex(pattern: str) -> re.Pattern:
    """`*` matches one name segment (no dots), `**` any number of segments."""
    out = []
    for part in re.split(r"(\*\*|\*)", pattern):
        out.append(".*" if part == "**" else "[^.]+" if part == "*" else re.escape(part))
    return re.compile("".join(out) + r"\Z")


def freeze_targets(model: nn.Module, spec) -> list[str]:
    """The parameter names `spec` freezes (see the module docstring); a word or pattern that names
    nothing of this model is a `ConfigError` naming it."""
    if spec is None or spec == "auto":
        towers = find_towers(model)
        spec = ["vision"] + ["audio"] * bool(towers.audio) if towers else []
    if isinstance(spec, str):
        spec = [spec] if spec not in ("none", "") else []
    towers = find_towers(model)
    names = [n for n, _ in model.named_parameters()]
    frozen: list[str] = []
    for entry in spec:
        if not isinstance(entry, str):
            raise ConfigError(f"freeze: entries are words {list(WORDS)} or module patterns, got {entry!r}")
        if entry in WORDS:
            roots = towers.of(entry)
            inner = (
                [] if entry == "projector" else [p for p in towers.projector if any(_is_within(p, r) for r in roots)]
            )
            if not roots:
                what = "vision tower" if not towers else f"{entry} tower" if entry == "audio" else entry
                raise ConfigError(f"freeze: {entry!r} names no part of {type(model).__name__} "
                                  f"(it has no {what} found from its sub-configs)")
            matched = [n for n in names if any(_is_within(n, r) for r in roots)
                       and not any(_is_within(n, p) for p in inner)]
        else:
            regex = glob_regex(entry)
            matched = [n for n in names if regex.match(n) or any(regex.match(n[:i]) for i in _dots(n))]
            if not matched:
                raise ConfigError(f"freeze: {entry!r} is none of the words {list(WORDS)} and, as a pattern, "
                                  f"matches no module or parameter of {type(model).__name__}")
        frozen += matched
    return list(dict.fromkeys(frozen))


def _dots(name: str) -> list[int]:
    return [i for i, c in enumerate(name) if c == "."]


def freeze(model: nn.Module, spec="auto") -> list[str]:
    """Set `requires_grad=False` on what `spec` names (before sharding); returns those names."""
    frozen = freeze_targets(model, spec)
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen
