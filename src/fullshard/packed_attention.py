"""Packed rows whose documents never see each other, through transformers' own packed-sequence support.

A packed row restarts its position ids at every document (`fullshard.data.pack`), and that is all
transformers needs: building the attention mask, it reads document boundaries from the position
ids (`masking_utils.find_packed_sequence_indices`) and gives SDPA and eager a block-diagonal causal
mask and FlexAttention a document BlockMask. It does so only when the forward has no cache, and
a model whose config says `use_cache` builds an empty one in training too, so every training
forward passes `use_cache=False`. Flash attention takes no mask: it reads document starts from the
position ids only for a batch of one row, so a batch of several rows is handed the varlen kernel's
`cu_seq_lens` (its rows flattened, every row start a document start), as transformers'
`DataCollatorWithFlattening` hands them. An mRoPE model (Qwen2-VL family) reads documents only from
4-row position ids (text positions first, then its three rope rows): 2-D ones give it no document
mask at all, so a text-only packed row gets its text positions in all four rows. A Gemma 3-style
model (image tokens attending both ways inside their block, `token_type_ids`) gets its masks from
here under SDPA and eager: transformers composes the block overlay of its sliding-window layers
before remapping a packed row's indices to positions within each document, so there a token would
read another document's image blocks at its own document-relative positions. PaliGemma's prefix
block (`token_type_ids` 0) needs nothing from here: transformers ORs it in on row indices, after the
remapping, and then ANDs the document mask. Under context parallelism the all-to-all attention
(`fullshard.parallel.cp`) builds the same block-diagonal mask from the whole row's position ids.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from .errors import ConfigError

FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# how each attention implementation keeps the documents of a packed row apart
PATHS = {
    "sdpa": "SDPA with a block-diagonal causal mask that transformers builds from the position ids",
    "eager": "eager attention with a block-diagonal causal mask that transformers builds from the position ids",
    "flex_attention": "FlexAttention with a document BlockMask that transformers builds from the position ids",
    **{name: f"{name} varlen kernels over each document (cu_seq_lens from the position ids)" for name in FLASH},
}
CONTEXT_PARALLEL = "fullshard_ulysses"  # parallel/cp.py's attention, named here so this layer needs no import of it
CONTEXT_PARALLEL_PATH = ("the context-parallel all-to-all attention (SDPA) with a block-diagonal causal mask built "
                         "from the whole row's position ids")


def implementation_of(model: nn.Module) -> str:
    """The attention implementation transformers dispatches `model`'s (text) attention layers to."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    return getattr(config, "_attn_implementation", None) or "eager"


def use_attention(model: nn.Module, name: str | None) -> nn.Module:
    """Switch a (meta or real) transformers model to attention implementation `name`; None keeps
    transformers' own pick. A name transformers refuses (unknown, or its package missing) is a
    `ConfigError` naming `model.attn_implementation`."""
    if name is None or name == implementation_of(model):
        return model
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"model.attn_implementation={name!r}: {err}") from None
    return model


def attention_path(model: nn.Module, packed: bool) -> str:
    """One line saying how attention keeps packed documents apart; `ConfigError` for an implementation
    fullshard cannot vouch for when rows are packed."""
    name = implementation_of(model)
    if not packed:
        return f"attention: {name}; one record per row, its padding a separate document nobody attends to"
    path = CONTEXT_PARALLEL_PATH if name == CONTEXT_PARALLEL else PATHS.get(name)
    if path is None:
        raise ConfigError(f"model.attn_implementation={name!r} has no known way to keep packed documents apart: "
                          f"use one of {', '.join(PATHS)}, or data.packing=false")
    return f"attention: {name}; packed documents kept apart by {path}"


def uses_mrope(model: nn.Module) -> bool:
    """Whether the model positions its tokens with multimodal rope (a module with `get_rope_index`)."""
    known = _MROPE.get(model)
    if known is None:
        known = _MROPE[model] = any(hasattr(type(m), "get_rope_index") for m in model.modules())
    return known


_MROPE: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def has_image_blocks(model: nn.Module) -> bool:
    """Whether the model is transformers' Gemma 3 kind: image blocks bidirectional, composed with a
    sliding window by the modelling module's `create_masks_for_vision_model`."""
    return any(hasattr(sys.modules.get(cls.__module__), "create_masks_for_vision_model") for cls in type(model).__mro__)


def image_block_masks(model: nn.Module, token_type_ids: torch.Tensor, positions: torch.Tensor) -> dict | None:
    """Each layer type's mask for packed rows of a Gemma 3-style model, made of transformers' own mask
    functions on row indices: (causal, or within one image block) and within one document, and for
    sliding layers within the window. None when the rows are not packed or the attention takes no
    dense mask (then transformers' own masks)."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        eager_mask,
        find_packed_sequence_indices,
        or_masks,
        packed_sequence_mask_function,
        sdpa_mask,
        sliding_window_overlay,
    )

    build = {"sdpa": sdpa_mask, "eager": eager_mask}.get(implementation_of(model))
    documents = find_packed_sequence_indices(positions)
    if build is None or documents is None:
        return None
    is_image = token_type_ids == 1
    block_starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    blocks = torch.where(is_image, block_starts.cumsum(-1) - 1, -1)
    base = and_masks(
        or_masks(causal_mask_function, blockwise_overlay(blocks)), packed_sequence_mask_function(documents)
    )
    config = model.config.get_text_config()
    batch, length = positions.shape
    dtype = next(model.parameters()).dtype
    masks = {}
    for layer_type in set(getattr(config, "layer_types", None) or ["full_attention"]):
        function = base if layer_type != "sliding_attention" else and_masks(
            base, sliding_window_overlay(config.sliding_window))
        masks[layer_type] = build(batch_size=batch, q_length=length, kv_length=length, mask_function=function,
                                  allow_is_causal_skip=False, device=positions.device, dtype=dtype)
    return masks


def packed_inputs(model: nn.Module, inputs: dict) -> dict:
    """The keyword arguments of a training forward over packed rows: `inputs` (`input_ids`,
    `position_ids`, ...) with no cache, so transformers reads documents from the position ids, and
    for flash attention the varlen lengths of every document of the flattened batch."""
    inputs = {**inputs, "use_cache": False}
    positions = inputs.get("position_ids")
    if positions is not None and positions.ndim == 2 and uses_mrope(model):
        inputs["position_ids"] = positions = positions[None].expand(4, *positions.shape)
    if positions is not None and positions.ndim == 3:
        positions = positions[0]  # the text positions, where documents restart
    if positions is not None and "token_type_ids" in inputs and has_image_blocks(model):
        masks = image_block_masks(model, inputs["token_type_ids"], positions)
        if masks is not None:
            inputs["attention_mask"] = masks
    if positions is not None and implementation_of(model) in FLASH:
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
        inputs.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=int(max_q), max_length_k=int(max_k))
    return inputs


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(batch, 1, seq, seq) booleans, True where a token may attend to another: an earlier (or the
    same) token of its own document. None when every row is one document (plain causal attention)."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        sdpa_mask,
    )

    documents = find_packed_sequence_indices(position_ids)
    if documents is None:
        return None
    batch, length = position_ids.shape
    return sdpa_mask(batch_size=batch, q_length=length, kv_length=length, allow_is_causal_skip=False,
                     mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(documents)),
                     device=position_ids.device)
