"""Token-budget micro-batches: a rank's sequences grouped so that no micro-batch exceeds a budget.

RL rollouts vary in length by orders of magnitude, so a fixed number of sequences per micro-batch
either wastes memory on short ones or runs out on long ones (verl's `use_dynamic_bsz`). Here a
micro-batch holds at most `max_tokens` tokens (packed: the sum of lengths; padded: the longest
times the count), a sequence is never split, and one longer than the budget goes alone. FSDP's
collectives need every data-parallel rank to run the same number of forwards, so the ranks agree
on the largest count and the others split their micro-batches until they have as many (a rank
with fewer sequences than that gets empty micro-batches, for which the caller runs a stand-in
forward with nothing scored). Global aggregation (`fullshard.rl.losses`) makes the update's
result independent of the split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _cost(lengths: list[int], padded: bool) -> int:
    return (max(lengths) * len(lengths) if padded else sum(lengths)) if lengths else 0


def _fit(lengths: list[int], count: int, max_tokens: int, padded: bool) -> list[list[int]] | None:
    """Longest first, each into the lightest micro-batch it fits in; None if one fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in bins if not b or
                _cost([lengths[i] for i in b] + [lengths[index]], padded) <= max_tokens]
        if not fits:
            return None
        min(fits, key=lambda b: (_cost([lengths[i] for i in b], padded), len(b))).append(index)
    return bins


def _next_fit(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Padded: longest first, a new micro-batch when the next would push the padded size over the
    budget (sequences of similar length share one)."""
    bins: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if not bins or lengths[bins[-1][0]] * (len(bins[-1]) + 1) > max_tokens:
            bins.append([])
        bins[-1].append(index)
    return bins


def _split(bins: list[list[int]], lengths: list[int], padded: bool) -> bool:
    """Split the heaviest micro-batch of several sequences in two; False when none has two."""
    splittable = [b for b in bins if len(b) > 1]
    if not splittable:
        return False
    heaviest = max(splittable, key=lambda b: _cost([lengths[i] for i in b], padded))
    bins.remove(heaviest)
    halves = _fit([lengths[i] for i in heaviest], 2, 1 << 62, padded)
    bins.extend([[heaviest[i] for i in half] for half in halves])
    return True


def _packed(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Packed: the fewest micro-batches, from the lower bound up, that the longest-first fill fits."""
    count = max(1, -(-sum(lengths) // max_tokens)) if lengths else 0
    bins = None
    while lengths and bins is None:
        bins = _fit(lengths, count, max_tokens, False)
        count += bins is None
    return [b for b in (bins or []) if b]


def token_batches(lengths, max_tokens: int, *, padded: bool = False, group=None) -> list[list[int]]:
    """This rank's sequences (their `lengths`) as micro-batches of indices, each at most
    `max_tokens` tokens, every rank of `group` (default: all; a collective when distributed) with
    the same number of micro-batches. Indices within a micro-batch are in increasing order."""
    lengths = [int(length) for length in lengths]
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    bins = _next_fit(lengths, max_tokens) if padded else _packed(lengths, max_tokens)
    wanted = torch.tensor([len(bins)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        wanted = wanted.to(device)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=group)
    target = max(int(wanted), 1)
    while len(bins) < target and _split(bins, lengths, padded):
        pass
    bins += [[] for _ in range(target - len(bins))]
    return sorted((sorted(b) for b in bins), key=lambda b: (not b, b))
