"""The training config: YAML sections, `--section.key=value` overrides, and every check that can be
made before a process group starts.

A mistyped key that is silently ignored trains the wrong run for hours, so an unknown key, a
value of the wrong type, or a batch that does not split over the ranks is a `ConfigError` naming
the key and the numbers, raised in the launching process before any rank exists.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ..engine import EngineConfig


class ConfigError(ValueError):
    pass


BUILTIN_MODELS = {
    # name -> LlamaConfig kwargs; vocab size comes from the tokenizer, max positions from data.seq_len
    "tiny-llama": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=False),
    "micro-llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=False),
}


@dataclass
class ModelSection:
    """`name_or_path`: a built-in config (`tiny-llama`, `micro-llama`: random weights, byte-level
    tokenizer, nothing downloaded) or a local Hugging Face directory (weights and tokenizer)."""

    name_or_path: str = "tiny-llama"
    dtype: str = "fp32"  # dtype of the sharded master weights


@dataclass
class DataSection:
    """`path`: a .txt file, a .jsonl file, a directory of them, or a saved `datasets` dataset;
    empty means the built-in generated corpus."""

    path: Optional[str] = None
    text_field: str = "text"
    seq_len: int = 128
    eval_fraction: float = 0.02
    shuffle: bool = True


@dataclass
class TrainSection:
    steps: int = 240
    micro_batch_size: int = 8
    global_batch_size: int = 16
    seed: int = 42
    accumulation_policy: str = "reduce_scatter_every"
    max_norm: float = 1.0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end only
    eval_batches: int = 4
    output_dir: str = "runs/demo"
    nproc: Optional[int] = None  # processes to self-launch without torchrun; default GPUs or 2 CPU processes
    stop_after: Optional[int] = None  # stop (as if interrupted) after this many steps of this run
    peak_tflops: Optional[float] = None  # per device, for the MFU estimate; known GPUs are looked up
    plot: bool = True


@dataclass
class OptimSection:
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    decay_embeddings: bool = False


@dataclass
class CheckpointSection:
    every: int = 0  # steps between checkpoints; 0: only at the end
    dir: Optional[str] = None  # default: <output_dir>/checkpoints
    max_num: int = 3
    resume: str = "auto"  # auto: the latest complete checkpoint in dir, if any; none; or a checkpoint path
    export: bool = True  # write a plain HF directory to <output_dir>/hf at the end
    async_save: bool = False


@dataclass
class FsdpSection(EngineConfig):
    pass


@dataclass
class LoraSection:
    """PEFT LoRA on the model; unset `r` trains the whole model. The base is frozen (and, from a
    directory, loaded sharded under the adapters); only the adapters train and sit in the optimizer."""

    r: Optional[int] = None
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[list] = None  # default: PEFT's choice for the architecture (q_proj, v_proj for LLaMA)
    save_adapter: bool = True  # write <output_dir>/adapter in PEFT's format at the end
    merge_on_export: bool = True  # checkpoint.export writes the base with the adapters merged; False: no merged copy

    @property
    def enabled(self) -> bool:
        return self.r is not None

    def peft_fields(self) -> dict:
        fields_ = {"r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout}
        if self.target_modules is not None:
            fields_["target_modules"] = list(self.target_modules)
        return fields_


SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection, "optim": OptimSection,
            "fsdp": FsdpSection, "checkpoint": CheckpointSection, "lora": LoraSection}
ALIASES = {"engine": "fsdp"}


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def output_dir(self) -> Path:
        return Path(self.train.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.output_dir / "checkpoints"

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per step; the batch arithmetic is checked here, naming the keys."""
        dp = self.fsdp.dp_replicate * (self.fsdp.dp_shard if self.fsdp.dp_shard != -1 else world_size // self.fsdp.dp_replicate)
        if dp != world_size or world_size % self.fsdp.dp_replicate:
            raise ConfigError(f"fsdp.dp_replicate={self.fsdp.dp_replicate} x fsdp.dp_shard={self.fsdp.dp_shard} "
                              f"does not match the {world_size} processes")
        micro, total = self.train.micro_batch_size, self.train.global_batch_size
        if total % (micro * dp):
            raise ConfigError(f"train.global_batch_size={total} is not divisible by train.micro_batch_size={micro} "
                              f"x data-parallel size {dp} = {micro * dp}")
        return total // (micro * dp)


# ---------------------------------------------------------------------------------------------- checks


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(key: str, value: Any, tp) -> Any:
    """`value` as type `tp`, or a ConfigError naming the key, the value and the type expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    else:
        return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _build_section(name: str, values: Any):
    cls = SECTIONS[name]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"section {name!r} must be a mapping of keys to values, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]}; the keys of section {name!r} are: {', '.join(known)}")
    coerced = {key: _coerce(f"{name}.{key}", value, hints[key]) for key, value in values.items()}
    try:
        return cls(**coerced)
    except ValueError as err:
        raise ConfigError(f"section {name!r}: {err}") from None


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key=value` (or `--section.key value`) into nested dicts; values are read as YAML,
    so `--train.steps=10` is an int and `--data.path=null` is None."""
    result: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"cannot read {arg!r}: overrides look like --section.key=value")
        if "=" in arg:
            dotted, raw = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            dotted, raw = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value")
        section, _, key = dotted.partition(".")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        result.setdefault(ALIASES.get(section, section), {})[key] = value
        i += 1
    return result


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Read a YAML file (optional), apply the overrides, check every key and type."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
        raw = {ALIASES.get(k, k): v for k, v in raw.items()}
    overrides = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    for section, values in overrides.items():
        if section in SECTIONS:
            merged = dict(raw.get(section) or {})
            merged.update(values)
            raw[section] = merged
        else:
            raw[section] = values
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; sections are: {', '.join(SECTIONS)}")
    config = TrainConfig(**{name: _build_section(name, raw.get(name)) for name in SECTIONS})
    _check_values(config)
    return config


def _check_values(config: TrainConfig) -> None:
    from ..optim import OPTIMIZERS, SCHEDULES
    from ..strategy import ACCUMULATION_POLICIES

    checks = [
        ("train.steps", config.train.steps, config.train.steps >= 1, "must be >= 1"),
        ("train.micro_batch_size", config.train.micro_batch_size, config.train.micro_batch_size >= 1, "must be >= 1"),
        ("train.global_batch_size", config.train.global_batch_size, config.train.global_batch_size >= 1, "must be >= 1"),
        ("train.log_every", config.train.log_every, config.train.log_every >= 1, "must be >= 1"),
        ("train.accumulation_policy", config.train.accumulation_policy,
         config.train.accumulation_policy in ACCUMULATION_POLICIES, f"must be one of {ACCUMULATION_POLICIES}"),
        ("train.nproc", config.train.nproc, config.train.nproc is None or config.train.nproc >= 1, "must be >= 1"),
        ("data.seq_len", config.data.seq_len, config.data.seq_len >= 2, "must be >= 2"),
        ("data.eval_fraction", config.data.eval_fraction, 0 <= config.data.eval_fraction < 1, "must be in [0, 1)"),
        ("optim.name", config.optim.name, config.optim.name in OPTIMIZERS, f"must be one of {sorted(OPTIMIZERS)}"),
        ("optim.schedule", config.optim.schedule, config.optim.schedule in SCHEDULES, f"must be one of {SCHEDULES}"),
        ("optim.lr", config.optim.lr, config.optim.lr > 0, "must be > 0"),
        ("optim.betas", config.optim.betas, len(config.optim.betas) == 2, "must be two numbers"),
        ("optim.warmup_steps", config.optim.warmup_steps, config.optim.warmup_steps >= 0, "must be >= 0"),
        ("model.dtype", config.model.dtype, config.model.dtype in ("fp32", "bf16", "fp16"), "must be fp32, bf16 or fp16"),
        ("checkpoint.every", config.checkpoint.every, config.checkpoint.every >= 0, "must be >= 0"),
        ("checkpoint.max_num", config.checkpoint.max_num, config.checkpoint.max_num >= 1, "must be >= 1"),
        ("lora.r", config.lora.r, config.lora.r is None or config.lora.r >= 1, "must be >= 1 (or unset: no LoRA)"),
        ("lora.alpha", config.lora.alpha, config.lora.alpha > 0, "must be > 0"),
        ("lora.dropout", config.lora.dropout, 0 <= config.lora.dropout < 1, "must be in [0, 1)"),
        ("lora.target_modules", config.lora.target_modules,
         config.lora.target_modules is None or (config.lora.target_modules and
                                                all(isinstance(m, str) for m in config.lora.target_modules)),
         "must be a non-empty list of module names"),
    ]
    for key, value, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{key}={value!r} {rule}")
    name = config.model.name_or_path
    if name not in BUILTIN_MODELS and not Path(name).is_dir():
        raise ConfigError(f"model.name_or_path={name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                          "nor a local directory")
    if config.data.path and not Path(config.data.path).exists():
        raise ConfigError(f"data.path={config.data.path!r} does not exist")
