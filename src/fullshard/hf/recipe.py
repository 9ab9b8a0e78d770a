"""The export recipe: which Hub tensor an export writes from which state tensors, and how.

transformers' `save_pretrained` does not write a model's tensors as the model holds them: it runs
the model's conversion mapping backwards (renames, fused MoE experts split one key per expert,
Qianfan-OCR's vision `q_proj` / `k_proj` / `v_proj` concatenated into `qkv`). The recipe says, for
each Hub tensor, the state tensor it is, the region of one it is, or the concatenation of several
it is (`fullshard.loading.convert.hub_views` works that out on meta tensors), plus the LoRA terms
merged into a weight and what stays fp32 at a half dtype. The live export's region writer
(`fullshard.hf.export`), the offline export (`fullshard.hf.offline`, from the recipe every
checkpoint records in its JSON form) and the weight stream (`fullshard.hf.stream`) all follow it,
so they give the same tensors, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..dtypes import dtype_name, resolve_dtype
from ..errors import CheckpointError
from ..fsdp import model_class_name
from ..loading.convert import HubConcat, HubView, hub_views
from ..tensors import tensor_aliases

SOURCE_DTYPE = "fullshard_source_dtype"  # the attribute `remember_source_dtype` sets


def remember_source_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Record the dtype the model's weights are stored in where it was loaded from; a model built in
    another dtype (fp32 masters of a bf16 checkpoint) keeps its own in its config."""
    if dtype is not None:
        setattr(model, SOURCE_DTYPE, dtype)


def source_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's weights came in: what an export writes unless told otherwise. The
    stored dtype `remember_source_dtype` recorded, else the config's `dtype`; master weights are
    often upcast (bf16 files trained in fp32), so the parameters' dtype is the last resort. A PEFT
    model's is its base model's."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    if getattr(model, SOURCE_DTYPE, None) is not None:
        return getattr(model, SOURCE_DTYPE)
    try:
        configured = resolve_dtype(getattr(getattr(model, "config", None), "dtype", None))
    except ValueError:
        configured = None
    if configured is not None:
        return configured
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


@dataclass
class ExportRecipe:
    """What an export writes, from which state tensor: the one description the live export, the
    offline export (recorded in every checkpoint's `model_meta.json`) and the weight stream follow.

    `names`: Hub name -> state key (tied aliases left out). `views`: for a Hub tensor that is a
    region of its state tensor (one expert of a fused tensor), [sizes, strides, offset] in it.
    `merges`: Hub name -> {"terms": [[A key or None, B key, scaling], ...], "fan_in_fan_out": bool},
    the LoRA terms merged into it. `fused`: Hub name -> {"dim": d, "parts": [entry, ...]} for a Hub
    tensor that is the concatenation along d of several entries of `names` (each with its view and
    merge), which are then its parts and not written themselves (Qianfan-OCR's vision `qkv`).
    `fp32`: half dtype's name -> Hub names transformers keeps in fp32 at that dtype. `adapter`: a
    LoRA model's adapter name and its file names (state key by PEFT's file name)."""

    names: dict[str, str] = field(default_factory=dict)
    views: dict[str, list] = field(default_factory=dict)
    merges: dict[str, dict] = field(default_factory=dict)
    fused: dict[str, dict] = field(default_factory=dict)
    fp32: dict[str, list[str]] = field(default_factory=dict)
    adapter: dict | None = None

    def to_json(self) -> dict:
        """The form `model_meta.json` keeps (empty parts left out)."""
        out = {"names": self.names, "merges": self.merges, "views": self.views}
        optional = (("fused", self.fused), ("fp32", self.fp32), ("adapter", self.adapter))
        out.update({key: value for key, value in optional if value})
        return out

    @classmethod
    def from_json(cls, data: dict) -> "ExportRecipe":
        """A recipe from its JSON form, as every fullshard since the recipe was recorded wrote it
        (one without `fused` writes every entry of `names`)."""
        return cls(names=dict(data["names"]), views=dict(data.get("views", {})), merges=dict(data.get("merges", {})),
                   fused=dict(data.get("fused", {})), fp32=dict(data.get("fp32", {})), adapter=data.get("adapter"))

    def hub_names(self) -> list[str]:
        """The Hub tensors written, in order: every entry of `names` but the parts of a fused one,
        which is written where its first part stands."""
        fused_of = {part: hub for hub, spec in self.fused.items() for part in spec["parts"]}
        out: dict[str, None] = {}
        for name in self.names:
            out.setdefault(fused_of.get(name, name))
        return list(out)


def alias_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that are the same tensor as another, canonical one: written once, under the
    canonical name, as `save_pretrained` does. The canonical name is the tie's target in the HF tie
    map when the model declares one (the loader ties the alias to it), else the first registered."""
    tie_map = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    targets = set(tie_map.values()) if isinstance(tie_map, dict) else set()
    aliases = set()
    for names in tensor_aliases(model).values():
        canonical = next((n for n in names if n in targets), names[0])
        aliases.update(n for n in names if n != canonical)
    return aliases


def hub_recipe(model: torch.nn.Module, names: dict[str, str], merges: dict, shapes) -> ExportRecipe:
    """A recipe in the Hub's layout: `names` (the model's own output name -> state key) and `merges`
    (output name -> LoRA terms) renamed, split and fused as transformers' `save_pretrained` writes
    them (`fullshard.loading.convert.hub_views`); `views` gives, for a Hub tensor that is a region of
    its state tensor (one expert of a fused tensor), its sizes, strides and offset in it; `fused`,
    for a Hub tensor concatenated from several, its parts (entries under the model's own names)."""
    try:
        views = hub_views(model, {out: tuple(shapes[key]) for out, key in names.items()})
    except ValueError as err:
        raise CheckpointError(f"cannot export {model_class_name(model)} in the Hub layout: {err}") from None
    recipe = ExportRecipe()
    for hub_name, view in views.items():
        fused = isinstance(view, HubConcat)
        for part in view.parts:
            entry = part.source if fused else hub_name  # a fused tensor's parts keep the model's names
            if fused and (entry in views or entry in recipe.names):
                raise CheckpointError(f"cannot export {model_class_name(model)} in the Hub layout: "
                                      f"{entry!r}, a part of {hub_name!r}, is also another tensor's name")
            recipe.names[entry] = names[part.source]
            if part.source in merges:
                recipe.merges[entry] = merges[part.source]
            if part.view is not None:
                recipe.views[entry] = [list(part.view[0]), list(part.view[1]), part.view[2]]
        if fused:
            recipe.fused[hub_name] = {"dim": view.dim, "parts": [part.source for part in view.parts]}
    recipe.fp32 = kept_in_fp32(model, {hub_name: [part.source for part in view.parts]
                                       for hub_name, view in views.items()})
    return recipe


def kept_in_fp32(model: torch.nn.Module, own_names: dict[str, list[str]]) -> dict[str, list[str]]:
    """transformers' rule for what stays fp32 when a model is loaded in a half dtype
    (`from_pretrained(dtype=...)`, then `save_pretrained` writes it so): `_keep_in_fp32_modules`
    in fp16, `_keep_in_fp32_modules_strict` in fp16 and bf16 (DeepSeek-V3's router weight and
    `e_score_correction_bias`), their globs searched in the model's own tensor names as transformers
    does. `own_names`: Hub name -> the model's names of the tensors it comes from (one of them
    matching keeps it). Returns, per half dtype's name, the Hub names kept in fp32 (recorded in the
    recipe, so an offline export without the model follows it too)."""
    plan_of = getattr(model, "_get_dtype_plan", None)
    if not callable(plan_of):
        return {}
    from transformers.core_model_loading import build_glob_alternation

    kept = {}
    for half in (torch.float16, torch.bfloat16):
        globs = [glob for glob, dtype in plan_of(half).items() if dtype == torch.float32]
        if globs:
            pattern = build_glob_alternation(globs)[0]
            names = [hub for hub, owns in own_names.items() if any(pattern.search(own) for own in owns)]
            if names:
                kept[dtype_name(half)] = names
    return kept


def export_recipe(model: torch.nn.Module, shapes) -> ExportRecipe:
    """What an export writes from a model's state (`shapes`: state key -> anything with a `.shape`, or
    the shape): Hub name -> state key (tied aliases left out), where a Hub tensor is a region of
    its state tensor, the region, and where it is fused from several, its parts. A LoRA model's
    recipe (`fullshard.lora.merge_recipe`) also merges adapters; this is the plain one."""
    aliases = alias_names(model)
    shapes = {k: tuple(getattr(v, "shape", v)) for k, v in shapes.items()}
    return hub_recipe(model, {k: k for k in shapes if k not in aliases}, {}, shapes)


def recipe_view(recipe: ExportRecipe, name: str) -> HubView | HubConcat:
    """Where the Hub tensor `name` of a recipe lies in its state tensor (`HubView`, `source` the state
    key), or, for one fused from several, the concatenation of its parts' (`HubConcat`)."""
    spec = recipe.fused.get(name)
    if spec is not None:
        return HubConcat(tuple(recipe_view(recipe, part) for part in spec["parts"]), int(spec["dim"]))
    view = recipe.views.get(name)
    return HubView(recipe.names[name], None if view is None else (tuple(view[0]), tuple(view[1]), int(view[2])))


def recipe_parts(recipe: ExportRecipe, name: str) -> list[tuple[str, HubView]]:
    """The entries the Hub tensor `name` is made of and their views: itself, or a fused one's parts
    (an entry's LoRA terms are `recipe.merges[entry]`)."""
    spec = recipe.fused.get(name)
    return [(part, recipe_view(recipe, part)) for part in (spec["parts"] if spec else [name])]


def merge_lora(base: torch.Tensor, terms: list[tuple[torch.Tensor | None, torch.Tensor, float]],
               fan_in_fan_out: bool) -> torch.Tensor:
    """`base` with LoRA terms merged in, as PEFT's `Linear.merge` does: W + transpose(B @ A) * scaling
    per adapter (a bias term has no A: b * scaling), the delta in fp32 then cast to W's dtype, into a
    new tensor. The live export, the weight stream and the offline export all merge here, so they
    give the same bits."""
    merged = base.detach().clone()
    for a, b, scaling in terms:
        if a is None:
            delta = b.float()
        else:
            delta = b.float() @ a.float()
            delta = delta.T if fan_in_fan_out else delta
        merged += (delta * scaling).to(merged.dtype)
    return merged


def written_dtype(recipe: ExportRecipe, name: str, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What the recipe's Hub tensor `name`, stored as `stored`, is written as: floating point cast to
    `dtype` (None: as stored), except what transformers keeps in fp32 at that dtype (`kept_in_fp32`);
    the rest as stored. The export, the weight stream and the offline export all ask here."""
    if not stored.is_floating_point or dtype is None:
        return stored
    return torch.float32 if name in recipe.fp32.get(dtype_name(dtype), ()) else dtype
