"""Every error fullshard raises on purpose, in one place, so callers (and the CLI) can tell them apart.

Each names the thing that is wrong: the key, the shape, the file, the plan entry. They share a
base class so the command line can print any of them as one line and a traceback only for bugs.
"""

from __future__ import annotations


class FullshardError(Exception):
    """Base of every error fullshard raises for bad input (never for its own bugs)."""


class ConfigError(FullshardError, ValueError):
    """A config value that cannot work; the message names the key."""


class PlanError(FullshardError, ValueError):
    """A sharding plan that cannot be applied to this model; the message names the entry."""


class LoadError(FullshardError, RuntimeError):
    """Pretrained weights that cannot be read into this model; the message names the keys and files."""


class HubUnreachableError(LoadError):
    """A Hub id that is in no local cache while the Hub cannot be reached (offline mode, no network)."""


class CheckpointError(FullshardError, RuntimeError):
    """A training checkpoint that cannot be saved, found or resumed; the message names the path."""


class WeightSyncError(FullshardError, RuntimeError):
    """Weights that could not reach an inference engine (`fullshard.WeightSync`): the message names the
    tensor or the engine."""
