"""Export a checkpoint to a plain Hugging Face directory in one process, with no process group.

A save records, in `model_meta.json`, the recipe the export follows (`model_meta`): output name ->
state key, with tied aliases left out and, for a LoRA run, the adapter terms to merge into each
base weight, plus the PEFT adapter's file names. So an offline export of a LoRA run writes the
merged model under the base model's names (and the adapter beside it, in `adapter/`) exactly as
the live `export_merged` does, without building the model; and what cannot be merged correctly
was recorded as refused at save time and is refused here, never written wrong.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import get_world_size
from ..dtypes import dtype_name, resolve_dtype
from ..errors import CheckpointError
from ..fsdp import model_class_name
from . import layout
from ..tensors import holds_part
from .export import (DEFAULT_SHARD_SIZE, Entry, SafetensorsStream, every_rank_part, export_config, export_recipe,
                     finish_directory, parse_size, plan_files, source_dtype, staging_dir, written_dtype)
from .read import CheckpointReader


def model_meta(model: torch.nn.Module, state_keys) -> dict:
    """What an offline export needs to know of the model: class, source dtype and the export recipe."""
    from ..lora import is_peft_model, merge_recipe  # lora imports checkpoint.export: not at import time

    base = model.get_base_model() if is_peft_model(model) else model
    try:
        recipe = merge_recipe(model, state_keys) if base is not model else export_recipe(model, state_keys)
    except CheckpointError as err:  # training goes on; only the export is refused, by name
        recipe = {"refused": str(err)}
    return {"format": layout.FORMAT_VERSION, "class_name": model_class_name(base),
            "dtype": dtype_name(source_dtype(base)), "export": recipe}


def whole_model_meta(model: torch.nn.Module, own_keys: list[str]) -> dict:
    """`model_meta` of the whole model, on every rank (a collective where ranks hold parts of it:
    pipeline stages, experts under ep). A LoRA model's recipe comes from each part's own LoRA
    layers (their adapters and scalings are known only where they are held), merged."""
    from ..lora import is_peft_model

    if not holds_part(model):
        return model_meta(model, own_keys)
    if not is_peft_model(model):
        return model_meta(model, every_rank_part(own_keys))
    metas: list = [None] * get_world_size()
    dist.all_gather_object(metas, model_meta(model, own_keys))
    recipes = [meta["export"] for meta in metas]
    refused = next((r["refused"] for r in recipes if r.get("refused")), None)
    if refused:
        return {**metas[0], "export": {"refused": refused}}
    names = {name: key for recipe in recipes for name, key in recipe["names"].items()}
    ordered = every_rank_part(list(names))  # layers by number, as the live export orders them
    merges = {name: merge for recipe in recipes for name, merge in recipe["merges"].items()}
    files = {name: key for recipe in recipes for name, key in recipe["adapter"]["files"].items()}
    export = {"names": {name: names[name] for name in ordered}, "merges": merges,
              "adapter": {**recipes[0]["adapter"], "files": files}}
    return {**metas[0], "export": export}


def _recipe(checkpoint: Path, meta: dict) -> dict:
    recipe = meta.get("export")
    if not isinstance(recipe, dict):
        raise CheckpointError(f"{checkpoint / layout.MODEL_META} has no export recipe: the checkpoint was written by "
                              "an older fullshard; load it with CheckpointManager and use export_hf")
    if recipe.get("refused"):
        raise CheckpointError(f"checkpoint {checkpoint} cannot be exported: {recipe['refused']}")
    if not (checkpoint / layout.CONFIG).is_file():
        raise CheckpointError(f"{checkpoint / layout.CONFIG} is missing: the checkpoint was saved from a model "
                              "without a Hugging Face config, so there is nothing to export it as")
    return recipe


def _read(reader: CheckpointReader, keys: list[str]) -> dict[str, torch.Tensor]:
    """State tensors `keys` of the checkpoint, whole, in their stored dtype."""
    state = {}
    for key in keys:
        item = reader.metadata.state_dict_metadata.get(f"model.{key}")
        if item is None or not hasattr(item, "size"):
            raise CheckpointError(f"{reader.checkpoint}: tensor {key!r} is in the export recipe but not in the DCP index")
        state[f"model.{key}"] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    reader.read(state)
    return {key: state[f"model.{key}"] for key in keys}


def _output_tensor(reader: CheckpointReader, recipe: dict, name: str) -> torch.Tensor:
    key, merge = recipe["names"][name], recipe["merges"].get(name)
    if merge is None:
        return _read(reader, [key])[key]
    from ..lora import merge_lora

    terms = merge["terms"]
    read = _read(reader, [key, *(k for a, b, _ in terms for k in (a, b) if k is not None)])
    return merge_lora(read[key], [(read.get(a), read[b], s) for a, b, s in terms], merge["fan_in_fan_out"])


def _write_adapter(reader: CheckpointReader, recipe: dict, staging: Path) -> None:
    """The PEFT adapter beside the merged model (`adapter/`), as `save_adapter` writes it."""
    from safetensors.torch import save_file

    from ..lora import ADAPTER_WEIGHTS

    files = recipe["adapter"]["files"]
    read = _read(reader, list(files.values()))
    target = staging / layout.ADAPTER_DIR
    shutil.copytree(reader.checkpoint / layout.ADAPTER_DIR, target)
    save_file({name: read[key].contiguous() for name, key in files.items()}, str(target / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def export_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                      dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Turn a fullshard checkpoint (any world size) into an HF directory in this one process.

    `checkpoint_dir` is one checkpoint or a save directory (its newest complete checkpoint; a save
    interrupted while committing is finished first). Tensors are read and written one at a time;
    the tokenizer saved with the checkpoint, and a LoRA run's adapter, travel along. Every failure
    is a CheckpointError naming the checkpoint and file.
    """
    checkpoint = layout.resolve_checkpoint(checkpoint_dir)
    meta = layout.read_json(checkpoint / layout.MODEL_META)
    recipe = _recipe(checkpoint, meta)
    reader = CheckpointReader(checkpoint)
    out_dtype = resolve_dtype(dtype) or resolve_dtype(meta["dtype"])
    index = reader.metadata.state_dict_metadata
    entries = []
    for name, key in recipe["names"].items():
        item = index.get(f"model.{key}")
        if item is None or not hasattr(item, "size"):
            raise CheckpointError(f"{checkpoint}: tensor {key!r} is listed in {layout.MODEL_META} but not in the DCP index")
        entries.append(Entry(name, tuple(item.size), written_dtype(item.properties.dtype, out_dtype)))
    files = plan_files(entries, parse_size(max_shard_size))
    output_dir = Path(output_dir)
    staging = staging_dir(output_dir)
    staging.mkdir(parents=True)
    try:
        for fname, group in files:
            stream = SafetensorsStream(staging / fname, group)
            for entry in group:
                stream.write(entry.name, _output_tensor(reader, recipe, entry.name).to(entry.dtype))
            stream.close()
        if recipe.get("adapter"):
            _write_adapter(reader, recipe, staging)
        if (checkpoint / layout.TOKENIZER_DIR).is_dir():
            for item in (checkpoint / layout.TOKENIZER_DIR).iterdir():
                shutil.copy2(item, staging / item.name)
        generation = checkpoint / layout.GENERATION_CONFIG
        finish_directory(staging, output_dir, files,
                         export_config((checkpoint / layout.CONFIG).read_text(), meta["class_name"], out_dtype),
                         generation.read_text() if generation.is_file() else None, tokenizer=None)
    except OSError as err:
        raise CheckpointError(f"exporting checkpoint {checkpoint} to {output_dir} failed: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
