"""The trainer's data: the `data:` section turned into the rows of every step and the eval batches.

The work is done by `fullshard.data` (sources, tokenization once per node, packing, streaming);
this module picks the pieces for a run: packed and cached, or streamed, with a held-out split or a
separate `eval_path`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..data.builtin import builtin_corpus, byte_tokenizer
from ..data.mix import MixedRows, mixture_paths
from ..data.prepare import default_cache_dir, prepare
from ..data.rows import Rows, StepBatches, eval_batches
from ..data.sources import load_records, resolve_source
from ..data.tokenize import layouts
from ..log import log_rank0
from .config import DataSection

__all__ = ["PackedData", "StepBatches", "builtin_corpus", "byte_tokenizer", "eval_batches", "load_data", "read_texts"]


@dataclass
class PackedData:
    """Packed rows cut into a training part and an eval part (held out, or read from `eval_path`)."""

    train: Rows
    eval: Rows

    def fingerprint(self) -> str:
        """Identifies the data a checkpoint was trained on, so a resume on other data is refused: the
        row counts and the first and last training rows (content, so copied files still match)."""
        digest = hashlib.sha1(repr((len(self.train), len(self.eval))).encode())
        for value in self.train.take([*range(min(8, len(self.train))), len(self.train) - 1]).values():
            for tensor in value if isinstance(value, list) else [value]:  # images: a dict per row
                for part in tensor.values() if isinstance(tensor, dict) else [tensor]:
                    digest.update(part.numpy().tobytes())
        return digest.hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.train)} training sequences"

    def step_batches(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                     seed: int, shuffle: bool) -> StepBatches:
        return StepBatches(self.train, global_batch_size, micro_batch_size, dp_rank, dp_size, seed, shuffle)

    def eval_batches(self, micro_batch_size: int, dp_rank: int, dp_size: int, num_rows: int) -> list[dict]:
        return eval_batches(self.eval, micro_batch_size, dp_rank, dp_size, num_rows)


def cache_dir_of(section: DataSection) -> Path:
    return Path(section.cache_dir).expanduser() if section.cache_dir else default_cache_dir()


def load_data(section: DataSection, tokenizer):
    """The run's data: `PackedData`, or a `StreamData` when `data.streaming` is set."""
    if section.streaming:
        from ..data.streaming import StreamData

        return StreamData(section, tokenizer, cache_dir_of(section))
    cache_dir = cache_dir_of(section)
    paths = mixture_paths(section)
    parts = [Rows(prepare(section, tokenizer, path, cache_dir).dataset) for path in paths or [section.path]]
    if section.eval_path:
        trains, held_out = parts, Rows(prepare(section, tokenizer, section.eval_path, cache_dir).dataset)
    else:  # each source's own last eval_fraction
        trains, evals = zip(*(rows.split(len(rows) - held_out_count(len(rows), section.eval_fraction)) for rows in parts))
        held_out = evals[0] if paths is None else MixedRows(list(evals))
    if paths is None:
        return PackedData(trains[0], held_out)
    train = MixedRows(list(trains), section.weights)
    log_rank0(f"data mixture: {train.describe(paths)}")
    return PackedData(train, held_out)


def held_out_count(rows: int, fraction: float) -> int:
    """Rows held out for evaluation: the fraction, at least one when it is not 0."""
    return max(1, round(rows * fraction)) if fraction > 0 else 0


def read_texts(section: DataSection) -> list[str]:
    """The documents of a text-format section in reading order, as Python strings: for looking at
    small data (a run never calls it; it reads the cached, packed tokens)."""
    source = resolve_source(section.path, (section.text_field,), section.split)
    return list(load_records(source, cache_dir_of(section), layouts(section))[section.text_field])
