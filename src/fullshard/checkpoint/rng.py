"""Per-rank random-number-generator state: captured at save, restored or re-derived at resume.

RNG state cannot be resharded: rank 3 of a 4-rank run has no counterpart in a 2-rank run. A
same-size resume restores every rank's exact state (so the continuation is bit-exact); a
different-size resume seeds each rank from (base seed, step, rank), which is reproducible and
keeps ranks decorrelated, and says so.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ..log import warn_rank, warn_rank0


def capture_rng_state() -> dict:
    """Every generator a training step may draw from, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
        "initial_seed": torch.initial_seed(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            torch.cuda.set_rng_state(saved[0])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (numpy only takes 32 bits)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(base_seed: int, step: int, rank: int) -> int:
    """A seed per (run, step, rank) that no two ranks share."""
    return (base_seed * 1_000_003 + step * 7919 + rank) % (2**63 - 1)


def rederive_rng_state(base_seed: int, step: int, rank: int, saved_world: int, world: int,
                       reason: str | None = None) -> int:
    """Seed this rank from (base seed, step, rank) and say why: by default, that the checkpoint
    was saved on another number of ranks (rank 0 says it once, for every rank); `reason` names a
    cause of this rank's own (its RNG file missing), which this rank says."""
    seed = derived_seed(base_seed, step, rank)
    seed_everything(seed)
    if reason is None:  # every rank re-derives: rank 0 says it for all
        warn_rank0(f"checkpoint was saved on {saved_world} ranks and is resumed on {world}: per-rank RNG states "
                   f"cannot be resharded, so every rank re-seeded python/numpy/torch RNGs with derived_seed(base_seed="
                   f"{base_seed}, step={step}, rank)")
    else:  # this rank alone: it says so itself
        warn_rank(f"{reason}, so this rank re-seeded python/numpy/torch RNGs with "
                  f"derived_seed(base_seed={base_seed}, step={step}, rank={rank}) = {seed}")
    return seed
