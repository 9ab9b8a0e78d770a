"""LLaMA-Factory's FSDP2 plugin config forms, read as `EngineConfig` values.

LLaMA-Factory builds its engine as `FSDP2Engine(dist_config, bf16=...)`, where `dist_config` is
its `PluginConfig` (a dict holding the plugin's `name`) or an `FSDP2Params` dataclass. This face
turns any of them into plain keys of `EngineConfig`; `EngineConfig.from_any` (`fullshard.engine`)
calls it, so the engine reads these forms with no logic of its own. It sits in the engine's layer,
below the other faces, because the engine reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass

from ..log import warn_rank0

# the keys of LLaMA-Factory's FSDP2 plugin (its `dist_config` / `FSDP2Params`) fullshard accepts and ignores
LLAMAFACTORY_ONLY_KEYS = {"name": "its distributed plugin's name"}


def dist_config_values(config) -> dict:
    """The keys a config sets, whatever form it came in: None, a mapping (a dict, LLaMA-Factory's
    `PluginConfig`), or a dataclass instance (its `FSDP2Params`, an `EngineConfig`)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if is_dataclass(config) and not isinstance(config, type):
        return asdict(config)
    raise TypeError(f"dist_config must be a dict, a dataclass or an EngineConfig, got {type(config).__name__}")


def engine_values(config, **overrides) -> dict:
    """`config`'s keys with `overrides`, in `EngineConfig`'s terms: `bf16=` (LLaMA-Factory's spelling
    of the precision) read as `mixed_precision`, its plugin-only keys named once in a warning and
    dropped. Keys neither form knows are left for `EngineConfig` to refuse."""
    values = dist_config_values(config)
    values.update(overrides)
    if "bf16" in values:
        wanted = "bf16" if values.pop("bf16") else "fp32"
        if values.setdefault("mixed_precision", wanted) != wanted:
            raise ValueError(f"bf16 asks for {wanted} but mixed_precision={values['mixed_precision']!r}: "
                             "set one of them")
    unused = sorted(k for k in values if k in LLAMAFACTORY_ONLY_KEYS)
    if unused:
        why = ", ".join(LLAMAFACTORY_ONLY_KEYS[k] for k in unused)
        warn_rank0(f"dist_config keys {unused} are LLaMA-Factory's ({why}); fullshard does not use them")
    return {k: v for k, v in values.items() if k not in LLAMAFACTORY_ONLY_KEYS}


__all__ = ["LLAMAFACTORY_ONLY_KEYS", "dist_config_values", "engine_values"]
