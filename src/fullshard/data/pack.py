"""Token streams to fixed-length rows of input ids, labels and position ids.

Text is packed as one stream cut every `seq_len` tokens (documents joined by EOS, none wasted);
conversations are packed whole, in order, into a row until the next one does not fit, and the
row's tail is padding with label -100 (a conversation is never split from its context). Without
packing, every row holds one document (text or conversation) and its padding. Position ids
restart at every document, at the padding and at every row start, so a packed document is
positioned as if it were alone and attention keeps documents apart by reading their starts from
the position ids (`fullshard.packed_attention`). The first token of a document is no target: it
would be predicted from the end of the document before it, which it never sees alone.

Documents with images (`fullshard.data.vision`) bring per-token columns (token types, an mRoPE
model's three rope rows, each row of them starting at 0 in every document) packed beside the ids,
and their image tensors as one blob each: a row's `images` are its documents' blobs in order.
"""

from __future__ import annotations

import itertools

import numpy as np

from .chat import IGNORE_INDEX

COLUMNS = ("input_ids", "labels", "position_ids")
ROPE_COLUMNS = ("rope_t", "rope_h", "rope_w")  # an mRoPE document's temporal, height and width positions
IMAGES = "images"
# a per-token column at whose changes a new sequence starts inside one document: the two completions
# of a preference pair, packed as one document so that a pair is never split (`data.preference`)
SPLIT_COLUMN = "pair_role"


def positions(starts: np.ndarray) -> np.ndarray:
    """Position ids that restart at every True in `starts` (`starts[..., 0]` must be True)."""
    index = np.arange(starts.shape[-1])
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return index - last_start


class Packer:
    """Turns documents (token ids, optional labels) into rows, carrying what does not fill a row
    to the next call. Its carry is part of a streaming run's data position (`state_dict`)."""

    def __init__(self, seq_len: int, pad_id: int, whole_documents: bool, packing: bool = True,
                 extra_columns: tuple[str, ...] = (), with_images: bool = False):
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.whole = whole_documents or not packing
        self.ids = np.zeros(0, np.int64)
        self.labels = np.zeros(0, np.int64)
        self.starts = np.zeros(0, bool)
        self.extras = {c: np.zeros(0, np.int64) for c in extra_columns}  # per-token columns besides ids and labels
        self.with_images, self.images = with_images, []  # the image blobs of the carried documents
        self.documents = self.dropped = 0

    def add(self, ids: list[list[int]], labels: list[list[int]] | None = None) -> dict[str, np.ndarray]:
        """Append documents; return the rows completed (arrays of shape (k, seq_len))."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
        tags = None if labels is None else np.fromiter(itertools.chain.from_iterable(labels), np.int64, len(flat))
        return self.add_flat(flat, lengths, tags)

    def add_flat(self, ids: np.ndarray, lengths: np.ndarray, labels: np.ndarray | None = None,
                 extras: dict[str, np.ndarray] | None = None,
                 images: list[bytes] | None = None) -> dict[str, np.ndarray]:
        """`add` for documents given as one array of tokens and their lengths (an Arrow list column's
        layout); `extras`: flat per-token columns laid out like `ids`, `images`: one blob per document."""
        ids = ids.astype(np.int64, copy=False)
        labels = ids if labels is None else labels.astype(np.int64, copy=False)
        extras = {c: extras[c].astype(np.int64, copy=False) for c in self.extras} if self.extras else {}
        if images is not None:
            images = [blob for blob, n in zip(images, lengths.tolist()) if n > 0]
        self.dropped += int((lengths == 0).sum())
        lengths = lengths[lengths > 0]
        self.documents += len(lengths)
        starts = np.zeros(len(ids), bool)
        starts[np.cumsum(lengths) - lengths] = True
        if SPLIT_COLUMN in extras:
            starts[1:] |= extras[SPLIT_COLUMN][1:] != extras[SPLIT_COLUMN][:-1]
        labels = np.where(starts, IGNORE_INDEX, labels)
        if not self.whole:
            if extras or images:
                raise ValueError("documents with images or extra columns are packed whole")
            self.ids = np.concatenate([self.ids, ids])
            self.labels = np.concatenate([self.labels, labels])
            self.starts = np.concatenate([self.starts, starts])
            return self._take(len(self.ids) // self.seq_len * self.seq_len)
        rows = []
        for index, (begin, length) in enumerate(zip((np.cumsum(lengths) - lengths).tolist(), lengths.tolist())):
            if len(self.ids) and (len(self.ids) + length > self.seq_len or not self.packing):
                rows.append(self._pad_and_take())
            end = begin + length
            self.ids = np.concatenate([self.ids, ids[begin:end]])
            self.labels = np.concatenate([self.labels, labels[begin:end]])
            self.starts = np.concatenate([self.starts, starts[begin:end]])
            for column, values in extras.items():
                self.extras[column] = np.concatenate([self.extras[column], values[begin:end]])
            if images is not None:
                self.images.append(images[index])
        return _stack(rows, self.seq_len)

    def _pad_and_take(self) -> dict[str, np.ndarray]:
        pad = self.seq_len - len(self.ids)
        if pad:
            self.ids = np.concatenate([self.ids, np.full(pad, self.pad_id)])
            self.labels = np.concatenate([self.labels, np.full(pad, IGNORE_INDEX)])
            self.starts = np.concatenate([self.starts, np.eye(1, pad, dtype=bool)[0]])
            for column in self.extras:  # rope rows of the padding are filled in by `_take`
                self.extras[column] = np.concatenate(
                    [self.extras[column], np.full(pad, -1 if column in ROPE_COLUMNS else 0)]
                )
        return self._take(self.seq_len)

    def _take(self, n: int) -> dict[str, np.ndarray]:
        shape = (n // self.seq_len, self.seq_len)
        starts = self.starts[:n].reshape(shape).copy()
        starts[:, 0] = True
        rows = {"input_ids": self.ids[:n].reshape(shape), "labels": self.labels[:n].reshape(shape),
                "position_ids": positions(starts)}
        for column, values in self.extras.items():
            values = values[:n].reshape(shape)
            # the padding, a document of its own, is positioned like text in every rope row
            rows[column] = np.where(values < 0, rows["position_ids"], values) if column in ROPE_COLUMNS else values
            self.extras[column] = self.extras[column][n:]
        if self.with_images:
            rows[IMAGES] = [self.images]  # whole documents: a row holds every carried document
            self.images = []
        self.ids, self.labels, self.starts = self.ids[n:], self.labels[n:], self.starts[n:]
        return rows

    def finish(self) -> dict[str, np.ndarray]:
        """The last rows at the end of the data: a part-filled row of whole documents is padded;
        the tail of a text stream shorter than a row is dropped."""
        if self.whole and len(self.ids):
            return _stack([self._pad_and_take()], self.seq_len)
        return _stack([], self.seq_len)

    def state_dict(self) -> dict:
        return {"ids": self.ids.tolist(), "labels": self.labels.tolist(), "starts": self.starts.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.ids = np.asarray(state["ids"], np.int64)
        self.labels = np.asarray(state["labels"], np.int64)
        self.starts = np.asarray(state["starts"], bool)


def _stack(rows: list[dict], seq_len: int) -> dict[str, np.ndarray]:
    if not rows:
        return {c: np.zeros((0, seq_len), np.int64) for c in COLUMNS}
    stacked = {c: np.concatenate([r[c] for r in rows]) for c in rows[0] if c != IMAGES}
    if IMAGES in rows[0]:
        stacked[IMAGES] = [blobs for r in rows for blobs in r[IMAGES]]
    return stacked
