"""Tokenize and pack once per node, cache on disk, memory-map everywhere.

The node's local rank 0 reads the records, tokenizes them with `datasets.map` (`num_proc`
processes), packs them into rows and writes one Arrow file under a temporary name that is renamed
into place when complete; the other ranks wait and then memory-map that file. No rank holds the
corpus as Python objects, and a second run with the same tokenizer, data and packing finds the
cache and tokenizes nothing. The cache key is computed on every rank from file sizes and
modification times, so it never requires reading the data. Image-text conversations (a
vision-language model's processor in place of the tokenizer, `vision.py`) are decoded and processed
here too, once per node: their image tensors go into the same files as their tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..distributed import get_local_rank
from ..errors import ConfigError
from ..log import warn_rank0
from .chat import chat_template_of
from .pack import COLUMNS, IMAGES, Packer
from .preference import PreferenceTokenize, VisionPreferenceTokenize
from .sources import Source, load_records, locate, resolve_source
from .tokenize import RecordError, Tokenize, layouts, optional_fields
from .vision import VisionTokenize, is_multimodal, processor_id

CACHE_VERSION = 4  # 2: a document's first token is no target; 3: info.json counts truncated records; 4: images
TOKENIZE_RUNS = {"count": 0}  # tokenizations done by this process (the once-per-node test counts them)
READ_BATCH = 1000  # documents per packing batch


def default_cache_dir() -> Path:
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "fullshard"


def tokenizer_id(tokenizer) -> str:
    """Identifies a tokenizer's behaviour: its whole serialised vocabulary and rules, template and EOS
    (a processor's: its tokenizer's, its chat template and its image processor's settings)."""
    if is_multimodal(tokenizer):
        return hashlib.sha256(repr((tokenizer_id(tokenizer.tokenizer), processor_id(tokenizer),
                                    getattr(tokenizer, "chat_template", None))).encode()).hexdigest()
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        from datasets.fingerprint import Hasher

        digest.update(Hasher.hash(tokenizer).encode())
    digest.update(repr((type(tokenizer).__name__, tokenizer.eos_token_id, tokenizer.pad_token_id,
                        getattr(tokenizer, "chat_template", None))).encode())
    return digest.hexdigest()


def cache_key(source: Source, tokenizer, section, exact: bool = True, rope=None) -> str:
    """Tokenizer + data + packing; `exact=False` identifies the data by file names and sizes only.
    Images are named by the records, so the data's files stand for them too."""
    recipe = {"version": CACHE_VERSION, "data": source.stamp(exact), "tokenizer": tokenizer_id(tokenizer),
              "format": section.format, "fields": [layouts(section), optional_fields(section)],
              "seq_len": section.seq_len, "overlong": section.overlong, "packing": section.packing,
              "chat_template": chat_template_of(tokenizer, section.chat_template) if section.format == "chat" else None}
    if section.format == "preference":
        recipe["chat_template"] = section.chat_template
    if vision_records(tokenizer, section):
        recipe["images"] = {"bad_images": getattr(section, "bad_images", "error"),
                            "rope": None if rope is None else rope.config.to_json_string()}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass
class Prepared:
    """A packed, memory-mapped dataset of rows and what the preparation counted."""

    dataset: object  # datasets.Dataset with COLUMNS, numpy format
    info: dict
    key: str


def vision_records(tokenizer, section) -> bool:
    """Whether records are read as image-text conversations: chat data and a processor that reads images."""
    return section.format == "chat" and is_multimodal(tokenizer)


def prepare(section, tokenizer, path: str | None, cache_dir: Path, rope=None) -> Prepared:
    """Packed rows for `path` (one of data.path / data.eval_path), built once per node. `tokenizer`
    may be a vision-language model's processor; `rope` is then its `vision.RopeIndex` (mRoPE models)."""
    import datasets

    source = resolve_source(path, tuple(f for layout in layouts(section) for f in layout), section.split)
    key = cache_key(source, tokenizer, section, rope=rope)
    target = cache_dir / key

    def build_once() -> None:
        if not (target / "info.json").exists():
            _build(source, tokenizer, section, cache_dir, target, rope)

    on_node_first_rank(build_once, f"preparing data.path={path!r}")
    info = json.loads((target / "info.json").read_text())
    report_overlong(info, section, source.path)
    if info["rows"] < 2:
        raise ConfigError(f"{source.path} holds {info['tokens']} tokens in {info['documents']} documents "
                          f"({info['dropped']} dropped as longer than data.seq_len), fewer than two sequences "
                          f"of data.seq_len={section.seq_len}")
    dataset = datasets.Dataset.from_file(str(target / "packed.arrow")).with_format("numpy")
    return Prepared(dataset, info, key)


def report_overlong(info: dict, section, path: str) -> None:
    """Say how many records (conversations, or documents without packing) did not fit
    data.seq_len and what became of them, on every run (the counts are kept with the cache);
    refuse data of which nothing would be left."""
    dropped, truncated = info["dropped"], info.get("truncated", 0)
    total = info["documents"] + dropped + info.get("broken", 0)  # every record read
    records = {"chat": "conversations", "preference": "pairs"}.get(section.format, "documents")
    rule = f"longer than data.seq_len={section.seq_len}"
    if dropped and not info["documents"]:
        raise ConfigError(f"{path}: all {dropped} {records} are {rule} and data.overlong=drop drops them; "
                          "raise data.seq_len or set data.overlong=truncate")
    if dropped:
        warn_rank0(f"{path}: {dropped} of {total} {records} dropped as {rule} (data.overlong=drop; "
                   "data.overlong=truncate keeps their first tokens)", once=False)
    if truncated:
        warn_rank0(f"{path}: {truncated} of {total} {records} truncated to their first {section.seq_len} "
                   f"tokens as {rule} (data.overlong=truncate)", once=False)
    if info.get("broken"):
        warn_rank0(f"{path}: {info['broken']} of {total} {records} dropped for a missing or unreadable image or "
                   "image tokens that do not match their images (data.bad_images=drop)", once=False)


def on_node_first_rank(fn, context: str):
    """`fn()` on each node's first rank while the others wait; if it failed anywhere, every rank
    raises the same `ConfigError` (bad data is one message, the same on every rank, not a rank's)."""
    result, failure = None, None
    if get_local_rank() == 0:
        try:
            result = fn()
        except ConfigError as err:
            failure = str(err)
        except Exception as err:  # noqa: BLE001 - any failure stops every rank, named
            failure = f"{context}: {type(err).__name__}: {err}"
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f), None)
    if first:
        raise ConfigError(first)
    return result


def _num_proc(section, rows: int) -> int | None:
    if section.num_proc is not None:
        return section.num_proc if section.num_proc > 1 else None
    # a fast tokenizer already encodes a batch on several threads, and a process pool costs more than
    # small data saves: half the cores, one per 20k records
    workers = min((os.cpu_count() or 1) // 2, rows // 20_000)
    return workers if workers > 1 else None


def _build(source: Source, tokenizer, section, cache_dir: Path, target: Path, rope=None) -> None:
    """Tokenize and pack into a temporary directory, then rename it to `target` (atomic on one filesystem)."""
    TOKENIZE_RUNS["count"] += 1
    records = load_records(source, cache_dir, layouts(section), optional=optional_fields(section))
    if vision_records(tokenizer, section):
        base = Path(source.path) if Path(source.path).is_dir() else Path(source.path).parent
        tokenize = VisionTokenize(tokenizer, section, base, rope)
    elif section.format == "preference" and is_multimodal(tokenizer):
        base = Path(source.path) if Path(source.path).is_dir() else Path(source.path).parent
        tokenize = VisionPreferenceTokenize(tokenizer, section, base, rope)
    elif section.format == "preference":
        tokenize = PreferenceTokenize(getattr(tokenizer, "tokenizer", tokenizer), section,
                                      margin="margin" in records.column_names)
    else:
        tokenize = Tokenize(getattr(tokenizer, "tokenizer", tokenizer), section)
    work = cache_dir / f"{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        try:
            tokens = records.map(tokenize, batched=True, with_indices=True,
                                 num_proc=_num_proc(section, len(records)), remove_columns=records.column_names,
                                 cache_file_name=str(work / "tokens.arrow"), new_fingerprint=target.name)
        except RecordError as err:
            raise ConfigError(f"{locate(source, err.row)} {err.reason}") from None
        info = _write_rows(tokens, section, getattr(tokenizer, "tokenizer", tokenizer), work / "packed.arrow",
                           getattr(tokenize, "columns", ()))
        info["path"] = source.path
        del tokens
        for leftover in work.glob("tokens*.arrow"):
            leftover.unlink()
        (work / "info.json").write_text(json.dumps(info))
        try:
            work.rename(target)
        except OSError:
            if not (target / "info.json").exists():  # not another node's identical copy: a real failure
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_rows(tokens, section, tokenizer, path: Path, extra_columns: tuple[str, ...] = ()) -> dict:
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packer = Packer(section.seq_len, pad, whole_documents=section.format in ("chat", "preference"),
                    packing=section.packing,
                    extra_columns=extra_columns, with_images=IMAGES in tokens.column_names)
    images = IMAGES in tokens.column_names
    features = Features({c: Sequence(Value("int32"), length=section.seq_len) for c in (*COLUMNS, *extra_columns)}
                        | ({IMAGES: Sequence(Value("binary"))} if images else {}))
    rows = total = truncated = broken = 0
    with ArrowWriter(path=str(path), features=features) as writer:
        for batch in tokens.with_format("arrow").iter(batch_size=READ_BATCH):
            ids, lengths = _flat(batch, "input_ids")
            labels = _flat(batch, "labels")[0] if "labels" in batch.column_names else None
            if "truncated" in batch.column_names:
                truncated += batch.column("truncated").combine_chunks().true_count
            if "broken" in batch.column_names:
                broken += batch.column("broken").combine_chunks().true_count
            extras = {c: _flat(batch, c)[0] for c in extra_columns}
            blobs = batch.column(IMAGES).to_pylist() if images else None
            total += len(ids)
            rows += _write(writer, packer.add_flat(ids, lengths, labels, extras, blobs), section.seq_len)
        rows += _write(writer, packer.finish(), section.seq_len)
        writer.finalize()
    # a record dropped for a broken image counts as broken, not as overlong
    return {"rows": rows, "tokens": total, "documents": packer.documents, "dropped": packer.dropped - int(broken),
            "truncated": int(truncated), "broken": int(broken)}


def _flat(batch, column: str):
    """An Arrow list column as (all values, per-row lengths), without Python objects."""
    values = batch.column(column).combine_chunks()
    return values.flatten().to_numpy(zero_copy_only=False), values.value_lengths().to_numpy()


def _write(writer, part: dict, seq_len: int) -> int:
    import pyarrow as pa

    if len(part["input_ids"]):
        columns = {c: pa.FixedSizeListArray.from_arrays(v.astype("int32").ravel(), seq_len)
                   for c, v in part.items() if c != IMAGES}
        if IMAGES in part:
            columns[IMAGES] = pa.array(part[IMAGES], pa.list_(pa.binary()))
        writer.write_table(pa.table(columns))
    return len(part["input_ids"])
