"""Packed rows as training sees them: a view of a memory-mapped dataset (or of a tensor), the
batches of every step split across data-parallel ranks, and the eval batches.

The batch of step `s` is a pure function of (rows, seed, s): the rows of an epoch are a seeded
permutation and step `s` takes the next `global_batch_size` of them. The data position saved in a
checkpoint is therefore just the step, and a resumed run continues with exactly the batch the
uninterrupted run would have seen next, on any number of ranks.

Rows with images carry them as `images`, one dict of image tensors per row (a list, so micro-batches
slice it like the tensors), and an mRoPE model's position ids as (rows, 4, tokens): the text
positions, then the three rope rows. `model_inputs` turns a micro-batch into the model's arguments.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import ConfigError
from .chat import IGNORE_INDEX
from .pack import IMAGES, ROPE_COLUMNS, SPLIT_COLUMN
from .vision import decode_images

# batch columns that are not the model's arguments (targets, counts, pair and margin columns)
NOT_MODEL_INPUTS = ("labels", "shift_labels", "num_items_in_batch", "pair_role", "pair_margin",
                    "pair_sequence", "pair_sequences")


class Rows:
    """Rows `start..stop` of a packed dataset; `take` reads only the rows asked for."""

    def __init__(self, dataset, start: int = 0, stop: int | None = None):
        self.dataset, self.start = dataset, start
        self.stop = len(dataset) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def split(self, at: int) -> tuple["Rows", "Rows"]:
        return Rows(self.dataset, self.start, self.start + at), Rows(self.dataset, self.start + at, self.stop)

    def take(self, indices) -> dict[str, torch.Tensor]:
        if isinstance(self.dataset, torch.Tensor):  # plain token rows: every token a target, positions 0..n
            ids = self.dataset[torch.as_tensor(indices) + self.start]
            return {"input_ids": ids, "labels": ids.clone()}
        picked = self.dataset[[int(i) + self.start for i in indices]]
        rows = {k: decode_rows(v) if k == IMAGES else torch.from_numpy(np.asarray(v, dtype=np.int64))
                for k, v in picked.items()}
        rope = [rows.pop(c) for c in ROPE_COLUMNS if c in rows]
        if rope:  # text positions (documents restart them: what masks them apart), then the rope rows
            rows["position_ids"] = torch.stack([rows["position_ids"], *rope], dim=1)
        return rows


def aligned_targets(batch: dict) -> torch.Tensor:
    """The next-token target of every position, as long as the inputs (the last position of unshifted
    labels gets none): `shift_labels` as given (context parallelism), else `labels` shifted by one."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)


def decode_rows(blobs) -> list[dict[str, torch.Tensor]]:
    """Each row's image tensors: its documents' concatenated."""
    return [decode_images(list(row)) for row in blobs]


def model_inputs(batch: dict) -> dict:
    """A micro-batch as model arguments: the rows' image tensors concatenated image by image (the
    order of the image tokens in the flattened batch), position ids of an mRoPE model as (4, rows, tokens)."""
    inputs = {k: v for k, v in batch.items() if k != IMAGES}
    images = [row for row in batch.get(IMAGES, []) if row]
    for key in images[0] if images else ():
        inputs[key] = torch.cat([row[key] for row in images])
    positions = inputs.get("position_ids")
    if positions is not None and positions.ndim == 3:
        inputs["position_ids"] = positions.transpose(0, 1)
    return inputs


def as_rows(sequences) -> Rows:
    return sequences if isinstance(sequences, Rows) else Rows(sequences)


def batch_hash(batch: dict[str, torch.Tensor]) -> str:
    """A short id of a batch's tokens and labels, logged so two runs can be compared batch by batch."""
    digest = hashlib.sha1(batch["input_ids"].numpy().tobytes())
    digest.update(batch["labels"].numpy().tobytes())
    return digest.hexdigest()[:12]


def split_micro_batches(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int, micro: int) -> list[dict]:
    """This rank's contiguous share of a global batch, cut into micro-batches."""
    per_rank = len(batch["input_ids"]) // dp_size
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    return [{k: v[s:s + micro] for k, v in mine.items()} for s in range(0, per_rank, micro)]


class StepBatches:
    """The micro-batches each rank trains on at each step.

    Each epoch drops the last partial global batch so a step never straddles two epochs; data
    smaller than one global batch is an error naming both numbers.
    """

    def __init__(self, sequences, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int = 0, shuffle: bool = True):
        self.rows = as_rows(sequences)
        if len(self.rows) < global_batch_size:
            raise ConfigError(f"the data has {len(self.rows)} training sequences, fewer than one "
                              f"train.global_batch_size={global_batch_size}")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = len(self.rows) // global_batch_size
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            n = len(self.rows)
            self._order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
            self._epoch = epoch
        return self._order

    def global_indices(self, step: int) -> torch.Tensor:
        """The row indices of the whole step, in rank order."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        return self._epoch_order(epoch)[start:start + self.global_batch_size]

    def micro_batches(self, step: int) -> list[dict]:
        per_rank = self.global_batch_size // self.dp_size
        mine = self.global_indices(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return split_micro_batches(self.rows.take(mine), 0, 1, self.micro_batch_size)

    def step_hash(self, step: int) -> str:
        return batch_hash(self.rows.take(self.global_indices(step)))

    def state_dict(self) -> dict:
        return {}  # the step is the position

    def load_state_dict(self, state: dict) -> None:
        pass


def eval_batches(sequences, micro_batch_size: int, dp_rank: int, dp_size: int, num_rows: int) -> list[dict]:
    """This rank's share of the first `num_rows` eval rows, in micro-batches, every rank the same count.

    The rows evaluated depend on `num_rows` alone, never on the micro-batch or the world size, so
    the eval loss (summed over every rank, divided by all target tokens) does not either. Slots of
    the last round that no row fills hold a row with no targets: every rank runs the same forwards
    (FSDP's collectives), and a filler adds nothing to the loss or the token count.
    """
    rows = as_rows(sequences)
    num_rows = min(num_rows, len(rows))
    if num_rows == 0:
        return []
    per_round = micro_batch_size * dp_size
    batches = []
    for start in range(dp_rank * micro_batch_size, -(-num_rows // per_round) * per_round, per_round):
        real = list(range(start, min(start + micro_batch_size, num_rows)))
        batch = rows.take(real + [0] * (micro_batch_size - len(real)))
        batch["labels"][len(real):] = IGNORE_INDEX
        if SPLIT_COLUMN in batch:  # a filler holds no preference pair either
            batch[SPLIT_COLUMN][len(real):] = 0
        batches.append(batch)
    return batches
