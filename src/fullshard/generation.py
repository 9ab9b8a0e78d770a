"""Generation from a sharded model: every FSDP unit gathered once per call, not once per token.

transformers' `generate` runs a forward per new token; on an FSDP model each forward would
all-gather every unit again. Here every unit is unsharded once (one all-gather each), told not to
reshard after its forward, and transformers' own `generate` runs on the whole weights; after it,
every unit is resharded and its reshard setting restored. Each rank brings its own prompts; with
`synced_gpus` (transformers' flag for FSDP / ZeRO-3) a rank whose sequences are done keeps
running forwards until every rank is done, so a layout whose forward has collectives (TP, EP)
stays in step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .distributed import get_world_size
from .errors import ConfigError
from .fsdp import reshard_all
from .tensors import holds_part


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every FSDP unit of `model` unsharded for the block (one all-gather each, a collective), and
    kept unsharded across forwards; resharded, with its own reshard setting back, after."""
    groups = [group for module in model.modules() if isinstance(module, FSDPModule)
              for group in module._get_fsdp_state()._fsdp_param_groups]
    settings = [group.post_forward_mesh_info for group in groups]
    try:
        for group in groups:
            group.post_forward_mesh_info = None  # what `set_reshard_after_forward(False)` sets
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
        yield model
    finally:
        for group, setting in zip(groups, settings):
            group.post_forward_mesh_info = setting
        reshard_all(model)


def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             **generate_kwargs) -> torch.Tensor:
    """`model.generate(input_ids, attention_mask, **generate_kwargs)` on a sharded model; call on
    every rank, each with its own prompts (any count, zero included, and length; left-pad a batch).

    The parameters are gathered once for the call and freed after; greedy decoding gives exactly
    what transformers' `generate` gives on the same weights in one process. The model is in eval
    mode for the call and back in its own mode after.
    """
    if holds_part(model):
        raise ConfigError("fullshard.generate does not run a pipelined model (each rank holds only its stages); "
                          "export it (fullshard.export_hf) and generate from the export")
    device = next(model.parameters()).device
    empty = input_ids.shape[0] == 0
    if empty:  # this rank still takes part in every step's collectives, on a one-token prompt
        input_ids, attention_mask = torch.zeros(1, 1, dtype=torch.long), None
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else torch.ones_like(input_ids)
    training = model.training
    model.eval()
    try:
        with gathered(model), torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                    synced_gpus=get_world_size() > 1, **generate_kwargs)
    finally:
        model.train(training)
    if empty:
        sequences = output.sequences if hasattr(output, "sequences") else output
        return sequences[:0]
    return output
