"""What a checkpoint offers against what the model, optimizer and states expect, before any read.

Two kinds of absence, told apart so that a resume is refused only when it would be wrong:
- required state: model weights (unless `strict=False`), a shape that differs, an optimizer
  saved without one, a parameter whose saved optimizer state is only partly there. These are one
  error naming the keys.
- legitimately absent state: a parameter with no optimizer state at all, because it had no
  gradient before the save (an MoE expert no token reached, a module not yet in the loss, one
  frozen until now). A fresh optimizer holds no state for it either, so it is left without any
  and its first step starts the state as the uninterrupted run's would. And optional state: a
  Stateful the checkpoint does not carry (a strategy's counters in a plain manager checkpoint),
  or keys of one, keep their current values, with a warning naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..errors import CheckpointError
from ..tensors import held_elsewhere


@dataclass
class Fit:
    """The outcome of `fit_to_index`: what to load, and what stays as it is."""

    model_state: dict
    fresh_params: list[str] = field(default_factory=list)  # no optimizer state saved: none restored
    absent_states: dict[str, list[str]] = field(default_factory=dict)  # Stateful name -> its keys not saved
    unsaved_states: list[str] = field(default_factory=list)  # Statefuls with nothing saved: not loaded

    def drop_fresh_params(self, optim_state: dict) -> None:
        """Remove from the state to read the optimizer state `get_state_dict` made up for parameters
        that had none when saved (it runs a zero-gradient step on a fresh optimizer), in either form:
        nested by parameter (`state`), or flattened to `state.<name>.<key>`."""
        if "state" in optim_state:
            for fqn in self.fresh_params:
                optim_state["state"].pop(fqn, None)
            return
        prefixes = tuple(f"state.{fqn}." for fqn in self.fresh_params)
        for key in [k for k in optim_state if prefixes and k.startswith(prefixes)]:
            del optim_state[key]


def fit_to_index(checkpoint: Path, metadata, state: dict, strict: bool, model=None) -> Fit:
    """Compare `state` ({"model": ..., "optim"?: ..., "states"?: ...}) with the checkpoint's DCP
    index by key and shape; raise one `CheckpointError` naming every required key that differs.
    Weights other ranks hold (pipeline stages, ep experts) are in the checkpoint and expected there."""
    index = metadata.state_dict_metadata
    model_state = state["model"]
    saved_model_keys = {k[len("model."):] for k in index if k.startswith("model.")}
    missing, unexpected, _ = weights_apart(metadata, model_state, model)
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint: {few(missing, limit=3)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {few(unexpected, limit=3)}")
    if not strict:
        model_state = {k: v for k, v in model_state.items() if k in saved_model_keys}
    has_optim = any(k.startswith("optim.") for k in index)
    if "optim" in state and not has_optim:
        problems.append("no optimizer state in the checkpoint (saved without an optimizer): pass load_optimizer=False")
    flat, paths = flatten_state_dict({**state, "model": model_state})
    absent, mismatched = [], []
    optim_absent: dict[str, list[str]] = {}
    states_absent: dict[str, list[str]] = {}
    for key, value in flat.items():
        saved = index.get(key)
        path = paths[key]
        if saved is None and has_optim and (param := _optim_state_param(path)):
            optim_absent.setdefault(param, []).append(key)
        elif saved is None and path[0] == "states":
            states_absent.setdefault(path[1], []).append(key)
        elif saved is None and path[0] == "optim" and has_optim:
            absent.append(key)
        elif isinstance(value, torch.Tensor) and saved is not None and hasattr(saved, "size"):
            if tuple(value.shape) != tuple(saved.size):
                mismatched.append(f"{key}: checkpoint {tuple(saved.size)} vs model {tuple(value.shape)}")
    saved_prefixes = _prefixes(index)
    fresh = []
    for fqn, keys in optim_absent.items():
        if f"optim.state.{fqn}" in saved_prefixes:
            absent += keys  # part of this parameter's state was saved: the rest must be too
        else:
            fresh.append(fqn)
    if absent:
        problems.append(f"not in the checkpoint: {few(absent, limit=3)}")
    if mismatched:
        problems.append(f"shape mismatch: {few(mismatched, limit=3)}")
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} does not fit this model: " + "; ".join(problems))
    unsaved = [name for name in states_absent if f"states.{name}" not in saved_prefixes]
    return Fit(model_state, sorted(fresh), states_absent, unsaved)


def weights_apart(metadata, model_state: dict, model=None) -> tuple[list[str], list[str], list[str]]:
    """The model's weights and the checkpoint's apart, each sorted: those missing from the
    checkpoint, those only in it (other ranks' parts of a split model aside), those of another shape."""
    index = metadata.state_dict_metadata
    saved = {k[len("model."):]: v for k, v in index.items() if k.startswith("model.")}
    missing = sorted(k for k in model_state if k not in saved)
    unexpected = sorted(k for k in set(saved) - set(model_state) if not held_elsewhere(model, k))
    reshaped = sorted(k for k, v in model_state.items() if k in saved and hasattr(saved[k], "size")
                      and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(saved[k].size))
    return missing, unexpected, reshaped


def _optim_state_param(path: tuple) -> str | None:
    """The parameter an optimizer state entry belongs to, nested (`optim`, `state`, name, key) or
    flattened (`optim`, `state.<name>.<key>`; the key is one word in AdamW, Adam and SGD), else None."""
    if path[:2] == ("optim", "state"):
        return path[2]
    if len(path) == 2 and path[0] == "optim" and path[1].startswith("state."):
        return path[1][len("state."):].rsplit(".", 1)[0]
    return None


def _prefixes(index) -> set[str]:
    """Every dotted prefix of the saved keys: whether anything was saved under a name, in one lookup."""
    found = set()
    for key in index:
        parts = key.split(".")
        found.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return found


def few(items: list[str], limit: int = 8) -> str:
    """The first `limit` items, and how many there are in all when that is more."""
    shown = ", ".join(items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")
