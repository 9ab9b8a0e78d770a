"""The trainer's data: the `data:` section turned into the rows of every step and the eval batches.

The work is done by `fullshard.data` (sources, tokenization once per node, packing, streaming);
this module picks the pieces for a run: packed and cached, or streamed, with a held-out split or a
separate `eval_path`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..data.builtin import builtin_corpus, byte_tokenizer, write_caption_set
from ..data.mix import MixedRows, mixture_paths
from ..data.prepare import default_cache_dir, on_node_first_rank, prepare
from ..data.rows import Rows, StepBatches, eval_batches
from ..data.sources import load_records, resolve_source
from ..data.tokenize import layouts
from ..data.vision import is_multimodal
from ..errors import ConfigError
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
                for part in [tensor[k] for k in sorted(tensor)] if isinstance(tensor, dict) else [tensor]:
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


def load_data(section: DataSection, tokenizer, rope=None):
    """The run's data: `PackedData`, or a `StreamData` when `data.streaming` is set. With a
    vision-language model's processor for `tokenizer`, chat records may carry images (`rope`: the
    model's `data.vision.RopeIndex` for mRoPE models); without data.path it trains on the built-in
    pictures of coloured shapes."""
    if is_multimodal(tokenizer):
        if section.streaming:
            raise ConfigError("data.streaming=true reads text only: a vision-language model's data is prepared "
                              "once per node (set data.streaming=false)")
        if section.path is None:
            section = dataclasses.replace(section, path=str(builtin_caption_set(cache_dir_of(section))), format="chat")
    if section.streaming:
        from ..data.streaming import StreamData

        return StreamData(section, tokenizer, cache_dir_of(section))
    cache_dir = cache_dir_of(section)
    paths = mixture_paths(section)
    parts = [Rows(prepare(section, tokenizer, path, cache_dir, rope).dataset) for path in paths or [section.path]]
    if section.eval_path:
        trains, held_out = parts, Rows(prepare(section, tokenizer, section.eval_path, cache_dir, rope).dataset)
    else:  # each source's own last eval_fraction
        trains, evals = zip(
            *(rows.split(len(rows) - held_out_count(len(rows), section.eval_fraction)) for rows in parts)
        )
        held_out = evals[0] if paths is None else MixedRows(list(evals))
    if paths is None:
        return PackedData(trains[0], held_out)
    train = MixedRows(list(trains), section.weights)
    log_rank0(f"data mixture: {train.describe(paths)}")
    return PackedData(train, held_out)


def builtin_caption_set(cache_dir: Path) -> Path:
    """The built-in image-caption data (`data.builtin.write_caption_set`), written once per node into
    the data cache under a temporary name and renamed into place (nodes may share the disk)."""
    import shutil
    import uuid

    target = cache_dir / "builtin-shapes-v1"

    def write() -> None:
        if (target / "captions.jsonl").exists():
            return
        work = cache_dir / f"{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            write_caption_set(work)
            try:
                work.rename(target)
            except OSError:
                if not (target / "captions.jsonl").exists():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)

    on_node_first_rank(write, "writing the built-in image-caption data")
    return target / "captions.jsonl"


def held_out_count(rows: int, fraction: float) -> int:
    """Rows held out for evaluation: the fraction, at least one when it is not 0."""
    return max(1, round(rows * fraction)) if fraction > 0 else 0


def read_texts(section: DataSection) -> list[str]:
    """The documents of a text-format section in reading order, as Python strings: for looking at
    small data (a run never calls it; it reads the cached, packed tokens)."""
    source = resolve_source(section.path, (section.text_field,), section.split)
    return list(load_records(source, cache_dir_of(section), layouts(section))[section.text_field])
