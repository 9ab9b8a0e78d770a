"""`preference.reference=precompute`: the reference's log-probs computed once, before training, and kept.

One pass over every training and held-out row with the starting weights (the model, or
`checkpoint.init_from`'s) under no gradient, each data-parallel rank its share, gathered on every
rank. The table is kept in the run directory (where the checkpoints are, so a resume on other
nodes, or of a run directory moved elsewhere, finds it) and cached beside the tokenized rows (so
another run on the same data and starting weights skips the pass), each written under a
temporary name and renamed into place; both are keyed by the data's fingerprint and the model it
started from. No reference model is held while training: a micro-batch's reference log-probs are
looked up by the content of its rows (a row's log-probs depend on nothing else). Ranks that find
no table get it from one that does; a resumed run none of whose ranks finds one stops naming it
(the weights have moved on: it cannot be recomputed).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.preference import ROLE
from ..data.prepare import on_node_first_rank
from ..data.rows import eval_batches
from ..distributed import get_rank
from ..errors import ConfigError
from ..fsdp import reshard_all
from .preference import text_positions


def row_key(input_ids: torch.Tensor, roles: torch.Tensor) -> str:
    digest = hashlib.sha1(input_ids.to(torch.int64).numpy().tobytes())
    digest.update(roles.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def row_starts(batch: dict) -> torch.Tensor:
    """Per row, how many sequences start in it."""
    return ((text_positions(batch) == 0) & (batch[ROLE] > 0)).sum(1)


class PrecomputedReference:
    """Reference log-probs per sequence, looked up by the rows that hold them."""

    def __init__(self, table: dict[str, list[float]]):
        self.table = table

    def __call__(self, policy, batch: dict, objective) -> torch.Tensor:
        values = []
        for ids, roles in zip(batch["input_ids"], batch[ROLE]):
            if int((roles > 0).sum()):
                values += self.table[row_key(ids, roles)]
        return torch.tensor(values, dtype=torch.float32)


def cache_file(cache_dir: Path, fingerprint: str, model_id: str) -> Path:
    key = hashlib.sha256(json.dumps([fingerprint, model_id]).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"reference-logps-{key}.json"


@torch.no_grad()
def compute_table(model, objective, row_sets: list, micro_batch_size: int, dp_rank: int, dp_size: int) -> dict:
    """Every row's sequence log-probs under `model`, this rank's share computed, every rank's gathered."""
    mine: dict[str, list[float]] = {}
    model.eval()
    for rows in row_sets:
        for batch in eval_batches(rows, micro_batch_size, dp_rank, dp_size, len(rows)):
            logps = objective.sequence_logps(model, batch)[0].cpu().tolist()
            for ids, roles, count in zip(batch["input_ids"], batch[ROLE], row_starts(batch).tolist()):
                if count:
                    mine[row_key(ids, roles)], logps = logps[:count], logps[count:]
    model.train()
    reshard_all(model)  # a no-grad forward leaves the root unit gathered
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def precomputed_reference(kept: Path, cached: Path, compute, resumed: bool) -> PrecomputedReference:
    """The table `kept` in the run directory, else `cached` beside the data, else (a new run)
    `compute()`'s; then written wherever it is missing (`kept` by the first rank, `cached` by each
    node's first rank)."""
    found = next((json.loads(p.read_text()) for p in (kept, cached) if p.exists()), None)
    table = shared_table(found)
    if table is None and resumed:
        raise ConfigError(f"the precomputed reference log-probs of this run ({kept}) are gone, and the starting "
                          "weights they come from have moved on: restore the file, or start the run anew")
    table = compute() if table is None else table

    def write() -> None:
        for path in (kept, cached) if get_rank() == 0 else (cached,):
            write_once(path, table)

    on_node_first_rank(write, "writing the precomputed reference log-probs")
    return PrecomputedReference(table)


def shared_table(found: dict | None) -> dict | None:
    """The table of the first rank that found one, on every rank (None: no rank did), so that the
    ranks agree on whether to compute it (a collective) whatever each node's cache holds."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return found
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, found is not None)
    if not any(flags):
        return None
    box = [found]
    dist.broadcast_object_list(box, src=flags.index(True))
    return box[0]


def write_once(path: Path, table: dict) -> None:
    """`table` at `path` unless something is there, through a temporary name renamed into place."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    work = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        work.write_text(json.dumps(table))
        work.rename(path)
    finally:
        work.unlink(missing_ok=True)
