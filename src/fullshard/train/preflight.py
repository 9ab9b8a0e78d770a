"""Everything about a run that can be checked from its config and files, checked in the launching
process before any rank starts, so a mistake is one line naming the key instead of N tracebacks.

`check_before_launch` covers the mesh and batch against the process count, `checkpoint.resume`,
`data.path`, and the model: a built-in name (a near miss is named as a typo), a local directory or a
Hub id (resolved from the local cache when offline, downloaded once otherwise), built on the meta
device from its config (no weights read) so the sharding plan is validated against the real module
names, and its attention implementation against packing. `build_meta_model` is the same model for
`fullshard plan`. None of it writes anything, so a refused run leaves nothing behind.
`check_resumed_checkpoint` then holds the checkpoint the run would resume against that model and
`train.steps` (run with the directory's lock held, after `rundir` settled whose checkpoints it keeps).
The output paths and the run directory's rules (one live run, one run's checkpoints) are `rundir`'s.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from ..errors import CheckpointError, ConfigError, FullshardError, HubUnreachableError, PlanError
from ..packed_attention import attention_path, use_attention
from .config import BUILTIN_MODELS, TrainConfig


def check_before_launch(config: TrainConfig, world_size: int):
    """Every check of `config` that needs no run directory; returns the model on meta (LoRA applied)."""
    config.accumulation_steps(world_size)
    _check_resume(config.checkpoint.resume)
    _check_data(config)
    model = use_attention(build_meta_model(config), config.model.attn_implementation)
    _check_head(config, model)
    if config.parallel.cp_size == 1:  # under cp the all-to-all attention replaces it
        attention_path(model, config.data.packing)
    if config.lora.enabled:
        from ..lora import apply_lora

        model = apply_lora(model, config.lora.peft_fields())
    from ..plan.build import build_plan
    from ..plan.towers import freeze

    freeze(model, config.freeze)  # a word or pattern naming nothing: one line, before launch
    try:
        build_plan(model, config.fsdp.plan)
    except PlanError as err:
        raise PlanError(f"fsdp.plan: {err}") from None
    _check_parallel(model, config)
    _check_init_from(config, model)
    return model


HEADS_WITHOUT_TOKENS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _check_head(config: TrainConfig, model) -> None:
    """The next-token objectives need a language-model head: a classification checkpoint (a reward
    model's `score` head) would fail inside the ranks on mismatched batch and target shapes."""
    kind = type(model).__name__
    if config.train.objective in ("sft", "dpo") and kind.endswith(HEADS_WITHOUT_TOKENS):
        raise ConfigError(f"model.name_or_path={config.model.name_or_path!r} is a {kind} checkpoint (a score head, "
                          f"no language-model head), which train.objective={config.train.objective} cannot train: "
                          "it trains with the reward objective (train.objective=reward); for "
                          f"{config.train.objective} use a causal-LM checkpoint (architectures: *ForCausalLM)")


def _check_init_from(config: TrainConfig, model) -> None:
    """`checkpoint.init_from` names a complete checkpoint that fits the model (weights by name and
    shape, optimizer state when `init_optimizer` asks for it), read from its index alone."""
    path = config.checkpoint.init_from
    if not path:
        return
    from ..checkpoint.fit import fit_to_index
    from ..checkpoint.layout import resolve_run_checkpoint
    from ..checkpoint.read import CheckpointReader
    from ..objectives.reward import SFT_OPTIMIZER, new_head_keys

    key = f"checkpoint.init_from={path!r}"
    try:
        checkpoint = resolve_run_checkpoint(path)
        if checkpoint.resolve().parent == config.checkpoint_dir.resolve():
            raise ConfigError(f"{key} is a checkpoint of this run's own directory: continue it with "
                              "checkpoint.resume=auto, or write this run to another train.output_dir")
        index = CheckpointReader(checkpoint, share=None).metadata
        if config.train.objective == "reward" and new_head_keys(index, model):
            # an SFT run's checkpoint into a reward model: its base checked, the score head new
            if config.checkpoint.init_optimizer:
                raise ConfigError(SFT_OPTIMIZER.format(path=path))
        else:
            fit_to_index(checkpoint, index, {"model": model.state_dict()}, strict=True, model=model)
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None
    if config.checkpoint.init_optimizer and not any(k.startswith("optim.") for k in index.state_dict_metadata):
        raise ConfigError(f"{key} holds no optimizer state (saved without an optimizer): set "
                          "checkpoint.init_optimizer=false")



NEW_RUN = "another train.output_dir, or checkpoint.resume=none with checkpoint.overwrite=true"


def check_resumed_checkpoint(config: TrainConfig, model) -> None:
    """The checkpoint this run would resume (`checkpoint.resume`: the newest in the run's own
    directory, or the one named) must hold this model's weights by name and shape, and a step no
    later than `train.steps`: else one line naming the first keys, their count and what to do.
    One the ranks could not read is left to them (`auto` falls back past it, or names it)."""
    from ..checkpoint import layout
    from ..checkpoint.fit import weights_apart
    from ..safe_dcp import read_dcp_metadata

    resume = config.checkpoint.resume
    if resume == "none":
        return
    if resume == "auto":
        found = layout.complete_checkpoints(config.checkpoint_dir)
        if not found:
            return
        checkpoint, start_anew = found[0], NEW_RUN
    else:
        checkpoint, start_anew = layout.resolve_checkpoint(resume), "checkpoint.resume=none"
    try:
        metadata = read_dcp_metadata(checkpoint / layout.STATE_DIR, CheckpointError)
        step = int(layout.read_json(checkpoint / layout.TRAINER_STATE)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return
    where = f"checkpoint.resume={resume}"
    missing, unexpected, reshaped = weights_apart(metadata, model.state_dict(), model)
    if missing or unexpected or reshaped:
        kinds = ((missing, "missing from it"), (unexpected, "only in it"), (reshaped, "of another shape"))
        counts = ", ".join(f"{len(keys)} {what}" for keys, what in kinds if keys)
        keys = [*missing, *unexpected, *reshaped]
        raise CheckpointError(f"{where}: checkpoint {checkpoint} does not fit this model ({counts}: "
                              f"{', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): use the model it was trained "
                              f"from, or start a new run: {start_anew}")
    if step > config.train.steps:
        raise ConfigError(f"{where}: checkpoint {checkpoint} is at step {step}, past train.steps="
                          f"{config.train.steps}: raise train.steps to at least {step} to continue it, or start a "
                          f"new run: {start_anew}")


def _check_parallel(model, config: TrainConfig) -> None:
    """The TP plan against the model's modules and heads, CP's head split, the pipeline cut and EP's
    experts, as the engine will check them."""
    from ..parallel.cp import check_context_parallel
    from ..parallel.tp import plan_assignments, resolve_tp_plan

    mesh = config.parallel
    if mesh.tp_size > 1:
        try:
            plan_assignments(model, resolve_tp_plan(model, mesh.tp_plan), mesh.tp_size)
        except PlanError as err:
            raise PlanError(f"{config.key('tp_plan')}: {err}") from None
    if mesh.cp_size > 1:
        check_context_parallel(model, mesh.tp_size, mesh.cp_size)
    if mesh.pp_size > 1:
        from ..parallel.pp import decoder_parts, stage_layers

        try:
            stage_layers(model, decoder_parts(model), mesh.pp_size * mesh.pp_virtual_stages, mesh.pp_layers_per_stage)
        except (ConfigError, PlanError) as err:
            raise type(err)(f"{config.key('pp_size')}={mesh.pp_size}: {err}") from None
    if mesh.ep_size > 1:
        from ..parallel.ep import check_expert_parallel

        try:
            check_expert_parallel(model, mesh.ep_size)
        except PlanError as err:
            raise PlanError(f"{config.spelling.get('ep_size', 'parallel')}.{err}") from None


def _check_data(config: TrainConfig) -> None:
    """A local data path must exist and hold data files; a name that is not a local path is a Hub
    dataset, which the ranks read from the local `datasets` cache (and name if it is not there)."""
    paths = config.data.path if isinstance(config.data.path, list) else [config.data.path]
    for path in filter(None, paths):
        _check_data_path(config, path)


def _check_data_path(config: TrainConfig, path: str) -> None:
    if not Path(path).exists():
        if path.startswith(("/", ".", "~")) or Path(path).suffix:
            raise ConfigError(f"data.path={path!r} does not exist")
        return
    from ..data.sources import resolve_source

    data = config.data
    resolve_source(path, (data.text_field, data.messages_field, data.prompt_field, data.response_field), data.split)


def _check_resume(resume: str) -> None:
    if resume in ("auto", "none"):
        return
    from ..checkpoint.layout import resolve_checkpoint

    try:
        resolve_checkpoint(resume)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.resume={resume!r}: {err}") from None


def resolve_model_dir(name: str) -> Path | None:
    """None for a built-in model; otherwise the local directory of a path or a Hub id, which
    `fullshard.loading.resolve_checkpoint_dir` finds in the cache or downloads (here, in the
    launching process, so the ranks find it cached)."""
    if name in BUILTIN_MODELS:
        return None
    path = Path(name)
    if path.is_dir():
        return path
    close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1, cutoff=0.8)
    if close:  # a typo of a built-in name, not a Hub id to look up
        raise ConfigError(f"model.name_or_path={name!r} is not a built-in model; did you mean {close[0]!r}? "
                          f"The built-in models are {', '.join(BUILTIN_MODELS)}")
    if path.exists() or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name_or_path={name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
                          "a local directory nor a Hub id")
    from ..loading import resolve_checkpoint_dir

    try:
        return resolve_checkpoint_dir(name)
    except HubUnreachableError:  # a mistyped name, likely: say what it is not, not the Hub client's error
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        what = ("not in the local Hub cache" if "/" in name
                else f"not a built-in name ({_near_builtin(name)})")
        raise ConfigError(f"model.name_or_path={name!r} is not a local directory, {what}, and the Hub is "
                          f"unreachable{offline}") from None
    except FullshardError as err:
        builtins = "" if "/" in name else f" (the built-in models are {', '.join(BUILTIN_MODELS)})"
        raise ConfigError(f"model.name_or_path={name!r}: {err}{builtins}") from None


def _near_builtin(name: str) -> str:
    """"did you mean 'micro-llama'?" for a name near a built-in one (case and word order aside), else
    the built-in names."""
    def words(text: str) -> str:
        return "-".join(sorted(re.split(r"[-_/ .]+", text.lower())))

    by_words = {words(builtin): builtin for builtin in BUILTIN_MODELS}
    close = (difflib.get_close_matches(name.lower(), BUILTIN_MODELS, n=1, cutoff=0.6)
             or [by_words[m] for m in difflib.get_close_matches(words(name), by_words, n=1, cutoff=0.6)])
    return f"did you mean {close[0]!r}?" if close else f"the built-in names are {', '.join(BUILTIN_MODELS)}"


def build_meta_model(config: TrainConfig):
    """The model of `config` on the meta device, in the dtype training keeps (`model.dtype`, whatever
    the stored `torch_dtype`): a built-in Llama, or a directory's / Hub id's config."""
    from ..dtypes import DTYPES
    from ..loading import init_empty_model, meta_init

    name, dtype = config.model.name_or_path, DTYPES[config.model.dtype]
    directory = resolve_model_dir(name)
    reward = config.train.objective == "reward"  # the checkpoint's sequence-classification class
    if directory is None:
        from ..data.builtin import builtin_model_config, builtin_tokenizer

        hf_config, model_class = builtin_model_config(name, builtin_tokenizer(name), config.data.seq_len,
                                                      BUILTIN_MODELS[name])
        model_class = _reward_class(name, hf_config) if reward else model_class
        with meta_init():
            return model_class._from_config(hf_config, dtype=dtype)
    hf_config = load_hf_config(directory, config.model.trust_remote_code, name)
    # the model class is transformers' own (config.architectures); init_empty_model(trust_remote_code=True)
    # would pass the flag on to the model's __init__
    model_class = _reward_class(name, hf_config) if reward else None
    return init_empty_model(hf_config, model_class, dtype=dtype)


def _reward_class(name: str, hf_config):
    """A reward model's class for a causal-LM or one-output sequence-classification checkpoint."""
    from ..objectives.reward import reward_model_class

    stored = getattr(hf_config, "architectures", None) or []
    other = [a for a in stored if a.endswith(HEADS_WITHOUT_TOKENS[1:])]
    classifier = any(a.endswith(HEADS_WITHOUT_TOKENS[0]) for a in stored)
    if other or (classifier and hf_config.num_labels != 1):
        raise ConfigError(f"model.name_or_path={name!r} is a {(other or stored)[0]} checkpoint "
                          f"with {hf_config.num_labels} outputs: train.objective=reward trains a "
                          "one-output score head (a causal-LM checkpoint, or a "
                          "sequence-classification one with num_labels 1)")
    hf_config.num_labels = 1
    return reward_model_class(hf_config)


def load_hf_config(directory: Path, trust_remote_code: bool, name: str):
    """transformers' AutoConfig, never running a repository's code unless model.trust_remote_code is set."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ConfigError(f"model.name_or_path={name!r} ships its own Python code, which fullshard does not run "
                              "unless model.trust_remote_code is true") from None
        raise ConfigError(f"model.name_or_path={name!r}: cannot read its config: {err}") from None
    except OSError as err:
        raise ConfigError(f"model.name_or_path={name!r}: cannot read its config: {err}") from None
