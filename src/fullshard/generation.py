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


def _param_groups(state) -> list:
    """A unit's parameter groups: a list since torch 2.12, one group (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every FSDP unit of `model` unsharded for the block (one all-gather each, a collective), and
    kept unsharded across forwards; resharded, with its own reshard setting back, after."""
    groups = [group for module in model.modules() if isinstance(module, FSDPModule)
              for group in _param_groups(module._get_fsdp_state())]
    settings = [group.post_forward_mesh_info for group in groups]
    try:
        if isinstance(model, FSDPModule):  # the root first: a VLM's generate runs its vision tower
            model._get_fsdp_state()._lazy_init()  # before any forward of the root (its encoder outputs)
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


# ------------------------------------------------------------------------------ `fullshard generate`


@contextlib.contextmanager
def model_directory(path: str):
    """An HF directory (or Hub id) as it is; a training checkpoint (or a save directory's newest) exported
    by rank 0 into a temporary directory, removed after the block."""
    import shutil
    import tempfile
    from pathlib import Path

    from .checkpoint.layout import is_complete
    from .distributed import barrier, broadcast_from_rank0, get_rank, run_agreed
    from .errors import CheckpointError
    from .hf.offline import export_checkpoint

    local = Path(path)
    checkpoint = local.is_dir() and (is_complete(local) or not (local / "config.json").is_file())
    if not checkpoint:
        yield path
        return
    temporary = broadcast_from_rank0(tempfile.mkdtemp(prefix="fullshard-generate-") if get_rank() == 0 else None)
    try:
        run_agreed(lambda: export_checkpoint(path, Path(temporary) / "hf"), on_rank=0, error_type=CheckpointError)
        yield str(Path(temporary) / "hf")
    finally:
        barrier()
        if get_rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)


def prompt_text(tokenizer, prompt: str) -> str:
    """The prompt as the model saw prompts in training: a user turn of its chat template, if it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def vision_prompts(processor, prompts: list[str], images: list[list[str]]) -> dict:
    """A vision-language model's inputs for `prompts`, each a user turn of the processor's chat
    template holding its images (files) before its text, through the model's own processor: token
    ids, mask, pixels and whatever else it gives (Qwen2-VL's `mm_token_type_ids`, without which its
    positions are text positions and generation goes wrong without an error)."""
    from PIL import Image

    texts, pictures = [], []
    for prompt, files in zip(prompts, images):
        parts = [{"type": "image"} for _ in files] + [{"type": "text", "text": prompt}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                   add_generation_prompt=True))
        for file in files:
            with Image.open(file) as image:
                pictures.append(image.convert("RGB"))
    return dict(processor(text=texts, images=pictures or None, padding=True, add_special_tokens=False,
                          return_tensors="pt"))


def generate_text(path: str, prompts: list[str], *, images: list[list[str]] | None = None,
                  max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                  seed: int = 0) -> list[str]:
    """Every rank: load `path` sharded, complete its share of `prompts`, and return (rank 0 also prints)
    every completion, in the prompts' order. `images[i]` are image files for prompt i: the model's
    processor (its image processor and chat template) reads them with the prompt."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from .distributed import get_rank, init_distributed
    from .pretrained import from_pretrained

    init_distributed()
    rank, world = get_rank(), get_world_size()
    torch.manual_seed(seed + rank)
    images = images or [[] for _ in prompts]
    processor = None
    with model_directory(path) as directory:
        if any(images):
            from .data.vision import load_processor

            processor = load_processor(directory)  # image-only where its video half needs torchvision
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        model = from_pretrained(directory)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    mine = list(range(rank, len(prompts), world))
    if processor is not None and mine:
        encoded = vision_prompts(processor, [prompts[i] for i in mine], [images[i] for i in mine])
    else:
        texts = [prompt_text(tokenizer, prompts[i]) for i in mine]
        encoded = dict(tokenizer(texts or [""], return_tensors="pt", padding=True,
                                 add_special_tokens=not tokenizer.chat_template))
    ids, mask = encoded.pop("input_ids"), encoded.pop("attention_mask")
    if not mine:
        ids, mask, encoded = ids[:0], None, {}
    sampling = dict(do_sample=True, temperature=temperature) if do_sample else dict(do_sample=False)
    output = generate(model, ids, mask, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      **sampling, **encoded)
    completions = tokenizer.batch_decode(output[:, ids.shape[1]:], skip_special_tokens=True)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, list(zip(mine, completions)))
    ordered = [text for _, text in sorted(pair for part in everyone for pair in part)]
    if rank == 0:
        for prompt, completion in zip(prompts, ordered):
            print(f"### {prompt}\n{completion}\n", flush=True)
    return ordered
