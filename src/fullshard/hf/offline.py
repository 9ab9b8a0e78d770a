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
from typing import Iterator

import torch

from ..checkpoint import layout
from ..checkpoint.read import CheckpointReader
from ..dtypes import dtype_name, resolve_dtype
from ..errors import CheckpointError
from ..fsdp import model_class_name
from .export import (
    DEFAULT_SHARD_SIZE,
    Entry,
    SafetensorsStream,
    export_config,
    finish_directory,
    parse_size,
    plan_files,
    staging_dir,
)
from .lora import ADAPTER_WEIGHTS, is_peft_model, merge_recipe
from .recipe import (
    ExportRecipe,
    export_recipe,
    merge_lora,
    recipe_parts,
    recipe_view,
    source_dtype,
    written_dtype,
)


def model_meta(model: torch.nn.Module, shapes: dict) -> dict:
    """What an offline export needs to know of the model: class, source dtype and the export recipe
    (`shapes`: every state key of the whole model -> its shape)."""
    base = model.get_base_model() if is_peft_model(model) else model
    try:
        recipe = (merge_recipe(model, shapes) if base is not model else export_recipe(model, shapes)).to_json()
    except CheckpointError as err:  # training goes on; only the export is refused, by name
        recipe = {"refused": str(err)}
    return {"format": layout.FORMAT_VERSION, "class_name": model_class_name(base),
            "dtype": dtype_name(source_dtype(base)), "export": recipe}


def _recipe(checkpoint: Path, meta: dict) -> ExportRecipe:
    recipe = meta.get("export")
    if not isinstance(recipe, dict):
        raise CheckpointError(f"{checkpoint / layout.MODEL_META} has no export recipe: the checkpoint was written by "
                              "an older fullshard; load it with CheckpointManager and use export_hf")
    if recipe.get("refused"):
        raise CheckpointError(f"checkpoint {checkpoint} cannot be exported: {recipe['refused']}")
    if not (checkpoint / layout.CONFIG).is_file():
        raise CheckpointError(f"{checkpoint / layout.CONFIG} is missing: the checkpoint was saved from a model "
                              "without a Hugging Face config, so there is nothing to export it as")
    return ExportRecipe.from_json(recipe)


def _read(reader: CheckpointReader, keys: list[str]) -> dict[str, torch.Tensor]:
    """State tensors `keys` of the checkpoint, whole, in their stored dtype."""
    state = {}
    for key in keys:
        item = reader.metadata.state_dict_metadata.get(f"model.{key}")
        if item is None or not hasattr(item, "size"):
            raise CheckpointError(
                f"{reader.checkpoint}: tensor {key!r} is in the export recipe but not in the DCP index"
            )
        state[f"model.{key}"] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    reader.read(state)
    return {key: state[f"model.{key}"] for key in keys}


def _state_tensor(reader: CheckpointReader, recipe: ExportRecipe, name: str) -> torch.Tensor:
    """The whole state tensor the recipe's entry `name` comes from, its LoRA terms merged in."""
    key, merge = recipe.names[name], recipe.merges.get(name)
    if merge is None:
        return _read(reader, [key])[key]
    terms = merge["terms"]
    read = _read(reader, [key, *(k for a, b, _ in terms for k in (a, b) if k is not None)])
    return merge_lora(read[key], [(read.get(a), read[b], s) for a, b, s in terms], merge["fan_in_fan_out"])


def _hub_tensors(reader: CheckpointReader, recipe: ExportRecipe, out_dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Hub tensor of the recipe, in its order, cast to `out_dtype` (`written_dtype`); a
    state tensor split into several (a fused MoE tensor, one per expert) is read once for all of
    them, and the state tensors of one fused from several are read for it alone."""
    held: dict[str, torch.Tensor] = {}
    for name in recipe.hub_names():
        parts = recipe_parts(recipe, name)
        if set(held) != {view.source for _, view in parts}:
            held.clear()  # the previous state tensors go before the next are read
            for part, view in parts:
                state = _state_tensor(reader, recipe, part)
                held[view.source] = state.to(written_dtype(recipe, name, state.dtype, out_dtype))
                del state
        yield name, recipe_view(recipe, name).take(held)


def checkpoint_hf_weights(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face weights of a fullshard checkpoint (any world size), `(name, tensor)` one at a
    time, in this one process with no process group: exactly what `export_checkpoint` writes (and
    `hf_weights` yields from the live model): Hub names and layout, a LoRA run merged, cast to
    `dtype` (default: the dtype the model was loaded from) but for what transformers keeps in fp32."""
    checkpoint = layout.resolve_checkpoint(path)
    meta = layout.read_json(checkpoint / layout.MODEL_META)
    recipe = _recipe(checkpoint, meta)
    out_dtype = resolve_dtype(dtype) or resolve_dtype(meta["dtype"])
    yield from _hub_tensors(CheckpointReader(checkpoint), recipe, out_dtype)


def _write_adapter(reader: CheckpointReader, recipe: ExportRecipe, staging: Path) -> None:
    """The PEFT adapter beside the merged model (`adapter/`), as `save_adapter` writes it."""
    from safetensors.torch import save_file

    files = recipe.adapter["files"]
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
    items = {}
    for key in recipe.names.values():
        item = index.get(f"model.{key}")
        if item is None or not hasattr(item, "size"):
            raise CheckpointError(
                f"{checkpoint}: tensor {key!r} is listed in {layout.MODEL_META} but not in the DCP index"
            )
        items[key] = item
    shapes = {key: tuple(item.size) for key, item in items.items()}
    entries = []
    for name in recipe.hub_names():
        view = recipe_view(recipe, name)
        stored = items[view.parts[0].source].properties.dtype
        written = written_dtype(recipe, name, stored, out_dtype)
        entries.append(Entry(name, view.shape(shapes), written))
    files = plan_files(entries, parse_size(max_shard_size))
    output_dir = Path(output_dir)
    staging = staging_dir(output_dir)
    staging.mkdir(parents=True)
    try:
        tensors = _hub_tensors(reader, recipe, out_dtype)
        for fname, group in files:
            stream = SafetensorsStream(staging / fname, group)
            for entry in group:
                name, tensor = next(tensors)
                stream.write(name, tensor)
            stream.close()
        if recipe.adapter:
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
