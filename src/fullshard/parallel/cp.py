"""Context parallelism: each cp rank holds a contiguous part of every sequence.

Everything outside attention works token by token, so it runs on the local part unchanged.
Attention needs the whole sequence: an all-to-all (Ulysses-style) trades the sequence split for
a head split, each rank attends over the full sequence for its share of the heads, and a second
all-to-all trades back. Both are torch's functional all-to-alls (differentiable, and on
gloo as on NCCL), so the same path runs in CI on CPU. torch's ring `context_parallel` needs
SDPA kernels gloo has no collectives for; this split needs nothing but all-to-all.

Packed documents stay apart: the parts carry the row's restarting position ids, each rank gathers
the whole row's (once per forward, a small all-gather) and attends with the block-diagonal causal
mask they give (`fullshard.packed_attention.document_causal_mask`), so the mask follows the split.

The loss stays that of the whole sequence: labels are shifted before the split (the last token of
one part predicts the first of the next), and every part is normalised by the target count of
the whole sequence divided by cp. The mean of the cp ranks' losses is then the one-process loss
of the sequence, and that mean is exactly what FSDP takes of gradients over its dp x cp mesh:
no gradient scaling (gloo has no pre-multiplied reduce), and a trainer averages the logged loss
over dp x cp as it did over dp. Parts may hold different numbers of targets; the count that
normalises is always the whole sequence's.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import all_gather_single
from ..errors import ConfigError, PlanError
from ..packed_attention import CONTEXT_PARALLEL as ATTENTION_NAME, document_causal_mask

IGNORE_INDEX = -100


def enable_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route every attention layer of a transformers model through the all-to-all attention on `cp_mesh`."""
    from transformers import AttentionInterface

    attention = [m for m in model.modules() if hasattr(m, "head_dim") and hasattr(m, "num_key_value_groups")]
    if not attention or not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"cp_size={cp_mesh.size()}: no transformers attention layers found in {type(model).__name__}")
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    documents = RowDocuments(cp_mesh.get_group())
    for module in attention:
        module.fullshard_cp_group = cp_mesh.get_group()
        module.fullshard_cp_documents = documents
    model.set_attn_implementation(ATTENTION_NAME)


def check_context_parallel(model: nn.Module, tp_size: int, cp_size: int) -> None:
    """`PlanError` unless each tp rank's query heads divide by cp (the all-to-all splits them)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise PlanError(f"cp_size={cp_size}: {type(model).__name__}'s config names no num_attention_heads")
    if heads % (tp_size * cp_size):
        raise PlanError(f"cp_size={cp_size}: num_attention_heads={heads} over tp_size={tp_size} does not divide "
                        f"by cp_size (the all-to-all gives each cp rank whole heads)")


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention over the whole sequence from each rank's part, each packed document apart:
    (batch, heads, part, dim) in, (batch, part, heads, dim) out, as transformers' attention
    functions return it.

    Key/value heads are repeated to the query heads first, so grouped-query models need only their
    query heads (after TP) to divide by cp.
    """
    group = module.fullshard_cp_group
    cp = group.size()
    if attention_mask is not None or kwargs.get("softcap") is not None:
        raise ConfigError("context parallel attention is causal only: no padding mask, no softcapping")
    if query.shape[1] % cp:
        raise ConfigError(f"context parallel: {query.shape[1]} attention heads on this rank do not divide by cp={cp}")
    window = kwargs.get("sliding_window")
    if window is not None and window < query.shape[2] * cp:
        raise ConfigError(f"context parallel: a sliding window of {window} < sequence length {query.shape[2] * cp}")
    groups = module.num_key_value_groups
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    q, k, v = (_sequence_to_heads(t, group) for t in (query, key, value))
    mask = module.fullshard_cp_documents.mask(kwargs.get("position_ids"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0,
                                         is_causal=mask is None, scale=scaling)
    return _heads_to_sequence(out, group).transpose(1, 2).contiguous(), None


class RowDocuments:
    """The document mask of the whole rows whose parts this rank holds, built from every cp rank's
    position ids. Every attention layer of a forward gets the same position ids tensor, so the
    gather and the mask are made once per forward (and again per recomputation, if the tensor is new)."""

    def __init__(self, group):
        self.group, self.positions, self.last = group, None, None

    @torch.compiler.disable  # a compiled block calls it as it is: the identity check is Python's
    def mask(self, positions: torch.Tensor | None) -> torch.Tensor | None:
        if positions is None:  # the model was given none: one document per row
            return None
        if positions is not self.positions:
            self.positions, self.last = positions, document_causal_mask(self._whole_rows(positions))
        return self.last

    def _whole_rows(self, positions: torch.Tensor) -> torch.Tensor:
        (batch, part), cp = positions.shape, self.group.size()
        parts = all_gather_single(positions.contiguous(), 0, self.group)  # rank i's parts: rows i*batch..
        return parts.view(cp, batch, part).permute(1, 0, 2).reshape(batch, cp * part)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Send chunk i of dim 0 to rank i, receive rank i's chunk as chunk i (differentiable)."""
    return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads, part, dim), this rank's part of the sequence -> (batch, heads/cp, seq, dim)."""
    cp = group.size()
    b, h, s, d = x.shape
    chunks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # chunk i: the heads rank i keeps
    received = _all_to_all(chunks, group)  # chunk i: rank i's part of the sequence
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads/cp, seq, dim) -> (batch, heads, part, dim): the inverse of `_sequence_to_heads`."""
    cp = group.size()
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # chunk i: rank i's part
    received = _all_to_all(chunks, group)  # chunk i: the heads rank i kept
    return received.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def context_parallel_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int,
                           pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """This cp rank's part of a causal-LM batch (`input_ids`, `labels`), ready for `model(**part)`.

    Labels are shifted over the whole sequence first; a length that cp does not divide is padded
    at the end with ignored targets (causal attention never lets a real token see them), so parts
    are equal and the ranks may split a sequence unevenly in real tokens. `position_ids` carry the
    row's positions (the batch's own, restarting at each packed document, or 0..n) for the rotary
    embedding and the document mask, and `num_items_in_batch` the target count of the whole
    sequence over cp, so the mean over cp of the parts' losses is the whole-sequence loss.
    """
    input_ids, labels = batch["input_ids"], batch.get("labels", batch["input_ids"])
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    pad = -input_ids.shape[1] % cp_size
    input_ids = F.pad(input_ids, (0, pad), value=pad_token_id)
    shift_labels = F.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
    positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(pad)], 1)
    part = input_ids.shape[1] // cp_size
    piece = slice(cp_rank * part, (cp_rank + 1) * part)
    labels = shift_labels[:, piece].contiguous()
    return {
        "input_ids": input_ids[:, piece].contiguous(),
        "position_ids": positions[:, piece].contiguous(),
        "labels": labels,  # any labels make the model compute its loss; shift_labels are the ones it uses
        "shift_labels": labels,
        "num_items_in_batch": (shift_labels != IGNORE_INDEX).sum() / cp_size,
    }
