"""`from_pretrained`: the short path most users want, composing the engine, the loader and LoRA.

It sits above all three (the loader knows nothing of engines or adapters), so nothing imports
back into it.
"""

from __future__ import annotations

from torch import nn

from .distributed import agreed
from .dtypes import resolve_dtype
from .engine import FSDP2Engine
from .errors import LoadError
from .hf.recipe import remember_source_dtype
from .loading import checkpoint_dtype, init_empty_model, resolve_checkpoint_dir
from .lora import apply_lora, lora_checkpoint_view
from .packed_attention import use_attention


def from_pretrained(name_or_path: str, engine=None, dtype=None, model_class=None, revision: str | None = None,
                    cache_dir: str | None = None, lora=None, trust_remote_code: bool = False,
                    attn_implementation: str | None = None, freeze=None,
                    num_labels: int | None = None, **load_kwargs) -> nn.Module:
    """The short path: build the model on meta from its config, shard it with `engine`, load it sharded.

    `engine` defaults to `FSDP2Engine()` (fp32, auto plan, whole world). `dtype=None` keeps the
    checkpoint's dtype; exports default to the checkpoint's stored dtype either way. Code a
    repository ships runs only with `trust_remote_code=True`. `lora` (a
    `peft.LoraConfig` or a dict of its fields) wraps the model on meta with PEFT LoRA before it is
    sharded (`fullshard.lora.apply_lora`): the result is a `PeftModel` whose base loads sharded from
    the checkpoint and whose adapters are initialised as `get_peft_model` would.
    `attn_implementation` names transformers' attention kernel (None: transformers' pick).
    `freeze` (None: the engine's `freeze`, by default "auto": a VLM's vision and audio towers) names the
    parts left untrained: `vision`, `audio`, `projector`, `language` or module patterns (`fullshard.plan.towers`).
    The model class is the config's (`architectures`), else transformers' image-text-to-text class
    for a VLM config, else its causal-LM class. `num_labels` sets a classification head's outputs
    (transformers' keyword) before the model is built.
    """
    from transformers import AutoConfig

    engine = engine if engine is not None else FSDP2Engine()
    if freeze is not None:
        engine.config.freeze = freeze
    directory = resolve_checkpoint_dir(name_or_path, revision, cache_dir)
    with agreed(LoadError, f"cannot build a model from {str(directory)!r}"):
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        if num_labels is not None:
            config.num_labels = num_labels
        weights = checkpoint_dtype(directory)
        stored = weights or resolve_dtype(getattr(config, "dtype", None))  # read before building sets it
        model = init_empty_model(config, model_class, dtype=resolve_dtype(dtype) or weights,
                                 trust_remote_code=trust_remote_code)
    remember_source_dtype(model, stored)  # what exports write by default, whatever the masters' dtype
    model.config._name_or_path = str(name_or_path)
    use_attention(model, attn_implementation)
    if lora is not None:
        model = apply_lora(model, lora)
        load_kwargs["checkpoint_view"] = lora_checkpoint_view(model)
    model.eval()  # as transformers' from_pretrained returns it
    return engine.shard_model(model, hf_model_path=str(directory), dtype=dtype, revision=revision, cache_dir=cache_dir,
                              **load_kwargs)
