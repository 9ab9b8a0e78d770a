"""Several datasets mixed by weight: `data.path` as a list, `data.weights` their shares.

An epoch of the mixture has as many rows as the sources together; source i fills the share
w_i / sum(w) of them, with a fixed (seeded) choice of its rows, cycled when the share is more than
it holds. Its rows are spread evenly over the epoch, so any stretch of the mixture (even
unshuffled) follows the weights. The mixture is a pure function of the sources and the weights,
like the packed rows it is made of, so `StepBatches` shuffles and splits it per step as it does
one dataset, and a resumed run continues with exactly the batch the uninterrupted run would have
seen. Without weights the sources are concatenated: each row once, each source its own size.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..errors import ConfigError
from .rows import Rows

MIX_SEED = 0  # which rows of a down-sampled source an epoch takes: fixed, part of the data, not of the run


def mixture_paths(section) -> list[str] | None:
    """`data.path` when it is a list (a mixture), else None."""
    return list(section.path) if isinstance(section.path, (list, tuple)) else None


def check_mixture(section) -> None:
    """What the values alone can tell about a mixture, naming the keys."""
    paths = mixture_paths(section)
    if paths is None:
        if section.weights is not None:
            raise ConfigError(f"data.weights={section.weights} needs data.path to be a list of paths, one per weight")
        return
    if not paths:
        raise ConfigError("data.path=[] names no data: give one path, a list of paths, or leave it unset")
    if section.weights is not None and len(section.weights) != len(paths):
        raise ConfigError(f"data.weights has {len(section.weights)} entries for the {len(paths)} paths of data.path")
    if section.streaming:
        raise ConfigError("data.path is a list (a mixture), which data.streaming=true cannot read: "
                          "set data.streaming=false or name one path")


def mixture_counts(sizes: list[int], weights: list[float] | None) -> list[int]:
    """Rows each source gives one epoch of `sum(sizes)` rows: its share of the weights, rounded so
    the counts add up (largest remainders first); its own size without weights."""
    if weights is None:
        return list(sizes)
    total = sum(sizes)
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


class MixedRows(Rows):
    """The rows of several `Rows` as one, interleaved by weight; `take` reads only the rows asked for."""

    def __init__(self, parts: list[Rows], weights: list[float] | None = None):
        self.parts = parts
        self.counts = mixture_counts([len(p) for p in parts], weights)
        sources, rows, places = [], [], []
        for i, (part, count) in enumerate(zip(parts, self.counts)):
            if count and not len(part):
                raise ConfigError(f"source {i + 1} of data.path has no rows to give its share of data.weights")
            order = torch.randperm(len(part), generator=torch.Generator().manual_seed(MIX_SEED + i)).numpy()
            sources.append(np.full(count, i))
            rows.append(order[np.arange(count) % max(len(part), 1)] if count else np.zeros(0, np.int64))
            places.append((np.arange(count) + 0.5) / max(count, 1))
        spread = np.argsort(np.concatenate(places), kind="stable")  # each source's rows evenly over the epoch
        self.source = np.concatenate(sources)[spread]
        self.row = np.concatenate(rows)[spread]
        super().__init__(self.source, 0, len(self.source))

    def split(self, at: int) -> tuple["MixedRows", "MixedRows"]:
        first, second = copy.copy(self), copy.copy(self)
        first.stop = second.start = self.start + at
        return first, second

    def take(self, indices) -> dict[str, torch.Tensor]:
        indices = np.asarray([int(i) + self.start for i in indices], dtype=np.int64)
        out: dict[str, torch.Tensor] = {}
        for i, part in enumerate(self.parts):
            mine = np.nonzero(self.source[indices] == i)[0]
            if not len(mine):
                continue
            for column, values in part.take(self.row[indices[mine]].tolist()).items():
                if isinstance(values, list):  # a row's images: one dict per row
                    placed = out.setdefault(column, [{} for _ in indices])
                    for slot, value in zip(mine.tolist(), values):
                        placed[slot] = value
                    continue
                if column not in out:
                    out[column] = torch.empty((len(indices), *values.shape[1:]), dtype=values.dtype)
                out[column][torch.from_numpy(mine)] = values
        return out

    def describe(self, paths: list[str]) -> str:
        shares = ", ".join(
            f"{path} {count} (from its {len(part)})" for path, count, part in zip(paths, self.counts, self.parts)
        )
        return f"each epoch's {len(self)} rows: {shares}"
