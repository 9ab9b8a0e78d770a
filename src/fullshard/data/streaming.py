"""Streaming: data read and tokenized on the fly, for data larger than the disk cache.

Each node's first rank reads the records in order (`datasets` streaming), tokenizes them in small
batches, packs them into rows and hands every step's global batch to the node's other ranks, which
keep only their share. The data position is the stream's own state (`IterableDataset.state_dict`)
plus the packer's carry and the rows read but not yet trained on; it is saved in every checkpoint,
so a resumed run, on any world size, trains on exactly the next rows the uninterrupted run would
have. Rows are not shuffled (a shuffle buffer cannot be checkpointed exactly); shuffle the files.
Records dropped or truncated as longer than `data.seq_len` are said when the first one is met and
counted at the end of every pass, as the cached path says them every run (`prepare.report_overlong`).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import get_local_rank, get_rank, get_world_size
from ..errors import ConfigError
from ..log import warn_rank0
from .pack import COLUMNS, Packer
from .prepare import TOKENIZE_RUNS, cache_key, on_node_first_rank, report_overlong
from .rows import Rows, batch_hash, eval_batches, split_micro_batches
from .sources import load_records, locate, quiet_datasets, resolve_source, source_read_error
from .tokenize import RecordError, Tokenize, layouts, optional_fields

TOKENIZE_BATCH = 32  # records tokenized together; also bounds the rows a checkpoint carries


class StreamReader:
    """Packed rows from a streamed source, in order, epoch after epoch, with a resumable position."""

    def __init__(self, section, tokenizer, path: str | None, cache_dir):
        TOKENIZE_RUNS["count"] += 1
        self.source = resolve_source(path, tuple(f for lay in layouts(section) for f in lay), section.split)
        self.layouts = layouts(section)
        self.dataset = load_records(self.source, cache_dir, self.layouts, streaming=True,
                                    optional=optional_fields(section))
        self.start_state = self.dataset.state_dict()
        self.tokenize = Tokenize(tokenizer, section)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.packer = Packer(section.seq_len, pad, whole_documents=section.format == "chat", packing=section.packing)
        self.pending = {c: np.zeros((0, section.seq_len), np.int64) for c in COLUMNS}
        self.epoch, self.record, self._records = 0, 0, None
        self.section = section
        self.overlong = {"documents": 0, "dropped": 0, "truncated": 0}  # this pass's counts

    def _next_records(self) -> list[dict]:
        """Up to TOKENIZE_BATCH records; an empty list at the end of an epoch."""
        if self._records is None:
            self.dataset.set_epoch(self.epoch)
            self._records = iter(self.dataset)
        batch = []
        try:
            with quiet_datasets():
                for record in self._records:
                    batch.append(record)
                    if len(batch) == TOKENIZE_BATCH:
                        break
        except Exception as err:  # noqa: BLE001 - a file that fails mid-stream, named by file and line
            raise source_read_error(self.source, err, self.layouts) from None
        return batch

    def _read_more(self) -> None:
        records = self._next_records()
        if not records:
            if self.record == 0:
                raise ConfigError(f"{self.source.path} holds no records")
            report_overlong(self.overlong, self.section, f"{self.source.path} (pass {self.epoch + 1})")
            self.overlong = dict.fromkeys(self.overlong, 0)
            self.epoch, self.record, self._records = self.epoch + 1, 0, None
            self.dataset.load_state_dict(self.start_state)
            return
        columns = {k: [r.get(k) for r in records] for k in dict.fromkeys(k for r in records for k in r)}
        try:
            out = self.tokenize(columns, list(range(self.record, self.record + len(records))))
        except RecordError as err:
            raise ConfigError(f"{locate(self.source, err.row)} {err.reason}") from None
        self.record += len(records)
        documents, dropped = self.packer.documents, self.packer.dropped
        rows = self.packer.add(out["input_ids"], out.get("labels"))
        self._count_overlong(self.packer.documents - documents, self.packer.dropped - dropped,
                             sum(out.get("truncated", [])))
        self.pending = {c: np.concatenate([self.pending[c], rows[c]]) for c in COLUMNS}

    def _count_overlong(self, documents: int, dropped: int, truncated: int) -> None:
        before = self.overlong["dropped"] + self.overlong["truncated"]
        self.overlong = {"documents": self.overlong["documents"] + documents,
                         "dropped": self.overlong["dropped"] + dropped,
                         "truncated": self.overlong["truncated"] + truncated}
        if before == 0 and dropped + truncated and self.epoch == 0:
            done = "dropped" if dropped else "truncated to their first tokens"
            warn_rank0(f"{self.source.path}: records longer than data.seq_len={self.section.seq_len} are {done} "
                       f"(data.overlong={self.section.overlong}); the first by record {self.record}, counted at the "
                       "end of each pass over the data")

    def next_rows(self, count: int, partial: bool = False) -> dict[str, np.ndarray]:
        """The next `count` rows (wrapping into the next epoch), or with `partial` at most one epoch's."""
        epochs_seen = self.epoch
        while len(self.pending["input_ids"]) < count:
            self._read_more()
            if partial and self.epoch > epochs_seen:
                break
            if self.epoch > epochs_seen + 1:
                raise ConfigError(f"{self.source.path} holds fewer than {count} rows of data.seq_len tokens")
        taken = {c: v[:count] for c, v in self.pending.items()}
        self.pending = {c: v[count:] for c, v in self.pending.items()}
        return taken

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "epoch": self.epoch, "record": self.record,
                "packer": self.packer.state_dict(), "pending": {c: v.tolist() for c, v in self.pending.items()},
                "overlong": dict(self.overlong)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.record, self._records = state["epoch"], state["record"], None
        self.dataset.load_state_dict(state["dataset"])
        self.packer.load_state_dict(state["packer"])
        self.overlong = dict(state.get("overlong", self.overlong))
        seq_len = self.packer.seq_len
        self.pending = {c: np.asarray(v, np.int64).reshape(-1, seq_len) for c, v in state["pending"].items()}


def _node_group():
    """The process group of this node's ranks and its first rank (torchrun numbers a node's ranks together)."""
    world = get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not dist.is_initialized() or world == 1 or local == world:
        return None, 0
    group, _ = dist.new_subgroups(group_size=local)
    return group, get_rank() - get_local_rank()


class StreamBatches:
    """The micro-batches of each step, read from the stream on the node's first rank and shared."""

    def __init__(self, reader: StreamReader | None, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int):
        self.reader, self.global_batch_size = reader, global_batch_size
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.group, self.src = _node_group()
        self.next_step, self.last, self.state = 0, None, {}

    def share(self, make) -> dict:
        """`make()` on the node's first rank, its result (or its error) on every rank of the node."""
        box = [None]
        if self.reader is not None:
            try:
                box = [{"value": make(), "state": self.reader.state_dict()}]
            except ConfigError as err:
                box = [{"error": str(err)}]
            except Exception as err:  # noqa: BLE001 - the node's other ranks wait in the broadcast: tell them
                box = [{"error": f"reading the data stream: {type(err).__name__}: {err}"}]
        if dist.is_initialized() and get_world_size() > 1:
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        if "error" in box[0]:
            raise ConfigError(box[0]["error"])
        self.state = box[0]["state"]
        return box[0]["value"]

    def micro_batches(self, step: int) -> list[dict]:
        if step != self.next_step:
            raise ConfigError(f"a streamed run reads steps in order: step {step} asked, {self.next_step} is next")
        rows = self.share(lambda: self.reader.next_rows(self.global_batch_size))
        self.last = {c: torch.from_numpy(v) for c, v in rows.items()}
        self.next_step += 1
        return split_micro_batches(self.last, self.dp_rank, self.dp_size, self.micro_batch_size)

    def step_hash(self, step: int) -> str:
        return batch_hash(self.last)

    def state_dict(self) -> dict:
        return {"stream": self.state}

    def load_state_dict(self, data_state: dict) -> None:
        if "stream" not in data_state:
            raise ConfigError("the checkpoint holds no stream position (it was not a data.streaming run)")
        if self.reader is not None:
            self.reader.load_state_dict(data_state["stream"])
        self.next_step, self.state = int(data_state["position"]), data_state["stream"]


class StreamData:
    """A run's data when `data.streaming` is set: the same interface as `PackedData`."""

    def __init__(self, section, tokenizer, cache_dir):
        self.section, self.tokenizer, self.cache_dir = section, tokenizer, cache_dir
        fields = tuple(f for lay in layouts(section) for f in lay)
        self.key = cache_key(resolve_source(section.path, fields, section.split), tokenizer, section, exact=False)

    def fingerprint(self) -> str:
        return hashlib.sha1(f"stream {self.key}".encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"sequences streamed from {self.section.path or 'the built-in corpus'}"

    def _reader(self, path):
        """The stream's reader on the node's first rank (None elsewhere); a failure to open it fails every rank."""
        return on_node_first_rank(lambda: StreamReader(self.section, self.tokenizer, path, self.cache_dir),
                                  f"opening data {path!r} for streaming")

    def step_batches(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                     seed: int = 0, shuffle: bool = False) -> StreamBatches:
        return StreamBatches(self._reader(self.section.path), global_batch_size, micro_batch_size, dp_rank, dp_size)

    def eval_batches(self, micro_batch_size: int, dp_rank: int, dp_size: int, num_rows: int) -> list[dict]:
        """The first `num_rows` eval rows of `data.eval_path` (streamed); none without one."""
        if not self.section.eval_path:
            return []
        count = num_rows
        sharer = StreamBatches(self._reader(self.section.eval_path), count, micro_batch_size, dp_rank, dp_size)
        rows = sharer.share(lambda: sharer.reader.next_rows(count, partial=True))
        import datasets

        table = datasets.Dataset.from_dict({c: v.astype(np.int32) for c, v in rows.items()}).with_format("numpy")
        return eval_batches(Rows(table), micro_batch_size, dp_rank, dp_size, count)
