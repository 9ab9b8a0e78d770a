"""The training config: YAML sections, `--section.key=value` overrides, and every check that can be
made from the values alone, before a process group starts.

The sections are plain dataclasses; their types, ranges (`Annotated[int, Field(ge=1)]`) and the
attribute docstrings under each key are the single definition that validation, `--help` and
`--print-config` all read. Validation is pydantic 2 (`TypeAdapter` over the stdlib dataclasses),
chosen over tyro / jsonargparse / OmegaConf because it validates the dataclasses we already have
without turning them into its own classes (the trainer and the engine use them unchanged), accepts
values as people write them (`"3e-5"` for a float, `10.0` for an int, `null`), checks ranges
declared in the type, and reports each error with the key's location, which we print as one line.
The others would each own the command line too; ours must also take a YAML file anywhere on the
line and start torchrun. Our own code only does what pydantic cannot know: unknown sections and
keys (named with the known ones), the one canonical section name, YAML 1.1's dotless floats
(`1e-4`), and paths with `~` and `$VARS`.

A mistyped key that is silently ignored trains the wrong run for hours, so an unknown key, a
value of the wrong type or out of range, or a batch that does not split over the ranks is a
`ConfigError` naming the key and the value.
"""

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from ..data.builtin import BUILTIN_MODELS  # noqa: F401  (defined with the built-in models; imported from here too)
from ..distributed import ParallelDims
from ..engine import EngineConfig
from ..errors import ConfigError
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Ratio = Annotated[float, Field(ge=0, le=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]

@dataclass
class ModelSection:
    """The model to train."""

    name_or_path: str = "tiny-llama"
    """a built-in config (tiny-llama, micro-llama: random weights, byte tokenizer; tiny-qwen2-vl: a vision-language
    model), a local HF directory or a Hub id"""
    dtype: str = "fp32"
    """dtype of the sharded master weights (fp32, bf16, fp16)"""
    trust_remote_code: bool = False
    """run the Python code a model repository ships (its config, model and tokenizer classes)"""
    attn_implementation: Optional[str] = None
    """attention kernel (sdpa, eager, flex_attention, flash_attention_2/3); unset: transformers' pick"""
    freeze: Union[str, list[str]] = "auto"
    """parts left untrained: vision, audio, projector, language or module globs (a list); auto: a VLM's vision and
    audio towers, nothing else; none: train everything"""


@dataclass
class DataSection:
    """What to train on (path unset: the built-in generated corpus), as text or as chat."""

    path: Optional[Union[str, list[str]]] = None
    """a data file (.txt .md .jsonl .json .parquet .arrow), a directory of them, a saved or cached Hub dataset; a list
    of them: mixed"""
    weights: Optional[list[PositiveFloat]] = None
    """with a list data.path: each source's share of the rows (unset: each row once)"""
    eval_path: Optional[str] = None
    """held-out data, read like path; unset: the last eval_fraction of path's rows (streaming: no eval)"""
    split: str = "train"
    """the split of a saved DatasetDict or a Hub dataset"""
    format: Literal["text", "chat", "preference"] = "text"
    """text: every token trains; chat: conversations rendered with the chat template, only assistant turns train;
    preference: prompt / chosen / rejected records (TRL's formats; train.objective=dpo)"""
    text_field: str = "text"
    """the field of a JSON / Parquet record holding the document (format text)"""
    messages_field: str = "messages"
    """the field holding a conversation: OpenAI / transformers chat turns (text or text parts, tool calls, tool
    turns)"""
    tools_field: str = "tools"
    """the field, where a chat record has it, of the tool schemas passed to the chat template"""
    prompt_field: str = "prompt"
    """with response_field: the fields of a one-turn record (format chat)"""
    response_field: str = "response"
    """the assistant's answer of a prompt/response record (format chat)"""
    chat_template: Optional[str] = None
    """a Jinja chat template, or a file holding one; unset: the tokenizer's"""
    overlong: Literal["drop", "truncate"] = "drop"
    """a conversation (or, unpacked, a document) longer than seq_len: drop it, or keep its first seq_len tokens (with
    images: up to the first image it would split)"""
    bad_images: Literal["error", "drop"] = "error"
    """an image-text record with a missing or unreadable image, or image tokens that do not match its images: stop
    naming it, or drop and count it"""
    seq_len: int = 128
    """tokens per packed row"""
    packing: bool = True
    """pack several documents or conversations into a row, each attending only to itself; false: one per row, padded"""
    eval_fraction: float = 0.02
    """share of the packed rows held out for evaluation when eval_path is unset"""
    shuffle: bool = True
    """shuffle the rows every epoch, seeded by train.seed (streaming reads in order)"""
    streaming: bool = False
    """read and tokenize on the fly, for data larger than the disk cache; the position is checkpointed"""
    cache_dir: Optional[str] = None
    """where tokenized, packed data is cached; unset: <HF datasets cache>/fullshard"""
    num_proc: Optional[PositiveInt] = None
    """tokenizing processes on each node's first rank; unset: half the cores, one per 20k records"""


@dataclass
class TrainSection:
    """The run: its length, batch and where it writes."""

    steps: PositiveInt = 240
    """optimizer steps of the whole run"""
    micro_batch_size: PositiveInt = 8
    """sequences per rank per forward/backward"""
    global_batch_size: PositiveInt = 16
    """sequences per optimizer step over all ranks (a multiple of micro_batch_size x data-parallel size)"""
    seed: int = 42
    """seed of the random weights, the data order and every rank's RNG"""
    objective: Literal["sft", "dpo", "reward", "grpo"] = "sft"
    """what the run optimises: sft (next-token loss), dpo (the preference section's loss on data.format=preference
    pairs; batch sizes then count pairs, packed: rows), reward (a one-score sequence-classification model on those
    pairs, the reward section's Bradley-Terry loss), grpo (the rl section's rollouts, rewards and update on the
    prompts of chat records; global_batch_size counts completions)"""
    accumulation_policy: str = "reduce_scatter_every"
    """when gradients of accumulated micro-batches are reduced (see TrainingSession)"""
    max_norm: NonNegativeFloat = 1.0
    """global gradient-norm clip; 0 disables clipping"""
    loss_chunk_tokens: NonNegativeInt = DEFAULT_LOSS_CHUNK_TOKENS
    """tokens whose logits exist at once: the loss goes through the output head this many tokens at a time (same loss
    and gradients, far less memory for large vocabularies); 0 computes all logits at once"""
    log_every: PositiveInt = 10
    """steps between metric lines (step 1 and the last step are always logged)"""
    eval_every: NonNegativeInt = 0
    """steps between evaluations; 0 evaluates at the end only"""
    eval_batches: NonNegativeInt = 4
    """one evaluation's size in global batches: the first eval_batches x global_batch_size held-out rows, whatever the
    micro-batch and world size"""
    output_dir: str = "runs/demo"
    """where metrics, checkpoints, the exported model, the loss plot and logs/ go"""
    nproc: Optional[PositiveInt] = None
    """processes to self-launch without torchrun; default: one per GPU, or 2 on CPU"""
    stop_after: Optional[PositiveInt] = None
    """stop (as if interrupted) after this many steps of this run"""
    peak_tflops: Optional[PositiveFloat] = None
    """peak TFLOP/s of one device, for MFU; known GPUs are looked up"""
    plot: bool = True
    """write loss.png at the end"""
    export_dtype: Optional[Literal["bf16", "fp16", "fp32"]] = None
    """dtype of the exported hf/ model; unset: the dtype the source checkpoint is stored in (the masters' for a
    built-in model)"""
    report_to: list[str] = field(default_factory=list)
    """trackers to send metrics to besides metrics.jsonl: any of tensorboard, wandb, trackio"""


@dataclass
class OptimSection:
    """The optimizer and its learning-rate schedule."""

    name: str = "adamw"
    """optimizer (adamw, adam, sgd)"""
    lr: PositiveFloat = 3e-3
    """peak learning rate"""
    weight_decay: NonNegativeFloat = 0.01
    """decoupled weight decay (not applied to norms and biases)"""
    betas: Annotated[list[Beta], Field(min_length=2, max_length=2)] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's two moment decays, each in [0, 1)"""
    eps: PositiveFloat = 1e-8
    """Adam's epsilon"""
    schedule: str = "cosine"
    """learning-rate schedule after warmup (constant, linear, cosine)"""
    warmup_steps: NonNegativeInt = 20
    """linear warmup steps from 0 to lr"""
    min_lr_ratio: Ratio = 0.1
    """final learning rate as a fraction of lr"""
    decay_embeddings: bool = False
    """apply weight decay to embeddings too"""


@dataclass
class CheckpointSection:
    """Sharded checkpoints (resumable on any world size) and the final export."""

    every: NonNegativeInt = 0
    """steps between checkpoints; 0: only at the end"""
    dir: Optional[str] = None
    """where checkpoints go; default: <train.output_dir>/checkpoints"""
    max_num: PositiveInt = 3
    """complete checkpoints kept (older ones are deleted)"""
    resume: Optional[str] = "auto"
    """auto (the latest complete checkpoint in dir, if any), none (or null), or a checkpoint path"""
    overwrite: bool = False
    """a run that does not continue the checkpoints already in dir deletes them first (else it is refused)"""
    init_from: Optional[str] = None
    """stage-2 training: a training checkpoint (or save / run directory: its newest) whose weights start this new run;
    its step, data position and schedule start anew"""
    init_optimizer: bool = False
    """with init_from: also load its optimizer state (moments, step counts); lr and the other optim settings stay this
    run's"""
    export: bool = True
    """write a plain Hugging Face directory to <train.output_dir>/hf at the end"""
    async_save: bool = False
    """write checkpoints in the background while training goes on"""
    on_stop_timeout_s: NonNegativeFloat = 120.0
    """on Ctrl-C / SIGTERM: seconds allowed to finish the step and save before the ranks are killed"""


@dataclass
class FsdpSection(EngineConfig):
    """How the model is sharded (the engine's settings, each documented under its field in `EngineConfig`).

    Its mesh keys (`MESH_KEYS`) are the parallel section's: `fsdp.tp_size` is still read, as
    `parallel.tp_size`, and the section holds the values the parallel section settles on."""


@dataclass
class ParallelSection:
    """The device mesh: pp x dp_replicate x dp_shard x cp x tp ranks, experts over ep, the pipeline's schedule.

    Each key is the `EngineConfig` field of its name (its line in `--help` is that field's); the
    engine is built from this section and the fsdp section (`TrainConfig.engine_config`)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp_size: int = 1
    tp_plan: Any = "auto"
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: Optional[int] = None
    pp_virtual_stages: int = 1
    pp_layers_per_stage: Optional[list[int]] = None


MESH_KEYS = tuple(f.name for f in dataclasses.fields(ParallelSection))


@dataclass
class LoraSection:
    """PEFT LoRA on the model; unset `r` trains the whole model. The base is frozen (and, from a
    directory, loaded sharded under the adapters); only the adapters train and sit in the optimizer."""

    r: Optional[PositiveInt] = None
    """adapter rank; unset: no LoRA, the whole model trains"""
    alpha: PositiveFloat = 16.0
    """LoRA scaling numerator (scale = alpha / r)"""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """dropout on the adapter input"""
    target_modules: Optional[Annotated[list[str], Field(min_length=1)]] = None
    """module names to adapt; default: PEFT's choice for the architecture (q_proj, v_proj for LLaMA)"""
    save_adapter: bool = True
    """write <train.output_dir>/adapter in PEFT's format at the end"""
    merge_on_export: bool = True
    """checkpoint.export writes the base with the adapters merged; false: no merged copy"""

    @property
    def enabled(self) -> bool:
        return self.r is not None

    def peft_fields(self) -> dict:
        fields_ = {"r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout}
        if self.target_modules is not None:
            fields_["target_modules"] = list(self.target_modules)
        return fields_


@dataclass
class PreferenceSection:
    """The preference loss of train.objective=dpo (TRL's DPOTrainer names and defaults)."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo (length-normalised, as TRL), hinge, robust (label_smoothing), simpo (reference-free, length-
    normalised, simpo_gamma), orpo (reference-free: the chosen sequence's NLL plus beta times the odds-ratio term)"""
    beta: PositiveFloat = 0.1
    """the strength of the implicit KL to the reference (IPO's tau)"""
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    """robust: the assumed share of flipped labels"""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin"""
    sft_weight: NonNegativeFloat = 0.0
    """the weight of an NLL term on the chosen completions, a mean over the step's chosen completion tokens (RPO;
    TRL's loss_type=[..., sft] with this loss weight)"""
    reference: Literal["auto", "model", "precompute", "adapter", "none"] = "auto"
    """model: a frozen sharded copy of the starting weights; precompute: their log-probs of every pair computed once
    before training and cached beside the tokenized rows (no reference held while training); adapter: under LoRA the
    same model with its adapters disabled; none: reference-free losses; auto: adapter under LoRA, none for simpo and
    orpo, else model"""
    offload_reference: bool = False
    """reference=model: keep its shards on the host, gathered to the device for its forwards (FSDP's CPU offload)"""

    def resolved_reference(self, lora: bool) -> str:
        """The reference strategy `auto` stands for, or the one set, checked against the loss and LoRA."""
        free = self.loss_type in ("simpo", "orpo")
        if self.sft_weight and self.loss_type == "orpo":
            raise ConfigError("preference.loss_type=orpo has its NLL term on the chosen sequence built in: "
                              "leave preference.sft_weight at 0")
        if self.reference == "auto":
            return "none" if free else "adapter" if lora else "model"
        if free and self.reference != "none":
            raise ConfigError(f"preference.loss_type={self.loss_type} is reference-free: set preference.reference=none "
                              f"(or auto), not {self.reference}")
        if not free and self.reference == "none":
            raise ConfigError(f"preference.loss_type={self.loss_type} needs a reference: set preference.reference to "
                              "model, adapter (LoRA) or auto")
        if self.offload_reference and self.reference not in ("model", "auto"):
            raise ConfigError(f"preference.offload_reference offloads a reference model, and preference.reference="
                              f"{self.reference} holds none")
        if self.reference == "adapter" and not lora:
            raise ConfigError("preference.reference=adapter disables the LoRA adapters, and lora.r is unset: "
                              "use preference.reference=model or set lora.r")
        return self.reference


@dataclass
class RLSection:
    """Rollouts, rewards and the policy update of train.objective=grpo (TRL's GRPOTrainer, verl's losses)."""

    group_size: Annotated[int, Field(ge=2)] = 8
    """completions sampled per prompt (TRL's num_generations); prompts per step = train.global_batch_size / this"""
    max_new_tokens: PositiveInt = 16
    """the longest completion; one that reaches it without an end of text counts as clipped"""
    temperature: PositiveFloat = 1.0
    """sampling temperature; the update's log-probs are taken at it too"""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """nucleus sampling: the smallest set of tokens whose probabilities add up to this"""
    reward: Optional[Union[str, list[str]]] = None
    """reward functions: path/to/file.py:function, module:function, or a built-in (accuracy, format,
    digits), each called as reward(prompts, completions, completion_ids, **columns) ->
    list[float | None]; or a reward model: an existing directory holding a one-output
    sequence-classification checkpoint (train.objective=reward's export), scoring prompt +
    completion; unset without data.path: the built-in toy (digits)"""
    reward_weights: Optional[list[float]] = None
    """each reward's weight in the summed reward (unset: 1 each)"""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """grpo: reward minus its group's mean, over the group's std; dr_grpo: not divided by the std; rloo: minus the
    mean of the others"""
    loss_type: Literal["ppo", "gspo", "cispo"] = "ppo"
    """the policy loss (fullshard.rl.policy_loss): ppo (clipped, dual clip), gspo (sequence ratio), cispo"""
    clip_ratio_low: NonNegativeFloat = 0.2
    """the ratio's lower clip, 1 - this"""
    clip_ratio_high: NonNegativeFloat = 0.2
    """the ratio's upper clip, 1 + this (DAPO: 0.28)"""
    clip_ratio_c: Optional[Annotated[float, Field(gt=1)]] = 3.0
    """ppo's dual clip for negative advantages; null: off"""
    loss_agg: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses become the step's loss, over every completion of the step (verl's loss_agg_mode)"""
    kl_coef: NonNegativeFloat = 0.0
    """weight of the KL to the reference in the loss (0, as TRL and DAPO: no reference held)"""
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k2+", "k3+"] = "k3"
    """the KL estimator (fullshard.rl.kl_penalty); a trailing + takes k2's gradient"""
    reference: Literal["auto", "model", "adapter", "none"] = "auto"
    """the KL's reference: model (a frozen copy of the starting weights, on the host between uses), adapter (LoRA's
    base, adapters disabled), none; auto: none when kl_coef is 0, adapter under LoRA, else model"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (subtracted from the loss)"""
    epochs: PositiveInt = 1
    """optimizer updates per batch of rollouts (TRL's num_iterations); the old log-probs are taken once before them"""
    max_tokens_per_micro_batch: PositiveInt = 4096
    """tokens (padded) per forward of the update and the log-probs; the update does not depend on it"""
    rollout: Literal["colocated", "engines"] = "colocated"
    """colocated: the trainer ranks generate (optimizer state off the device meanwhile); engines: separate processes"""
    num_engines: PositiveInt = 1
    """rollout=engines: engine processes"""

    def resolved_reference(self, lora: bool) -> str:
        """The reference `auto` stands for, or the one set, checked against kl_coef and LoRA."""
        if self.reference == "auto":
            return "none" if not self.kl_coef else "adapter" if lora else "model"
        if self.reference == "adapter" and not lora:
            raise ConfigError("rl.reference=adapter disables the LoRA adapters, and lora.r is unset: use "
                              "rl.reference=model or set lora.r")
        if self.reference == "none" and self.kl_coef:
            raise ConfigError(f"rl.kl_coef={self.kl_coef} needs a reference: set rl.reference to model, adapter "
                              "(LoRA) or auto")
        return self.reference

    def rewards(self) -> list[str]:
        """The reward functions named, as a list."""
        return [] if self.reward is None else [self.reward] if isinstance(self.reward, str) else list(self.reward)


@dataclass
class RewardSection:
    """The reward model of train.objective=reward (TRL's RewardTrainer loss):
    -log sigmoid(r_chosen - r_rejected - margin), the records' margin field when they have one."""

    center_coefficient: NonNegativeFloat = 0.0
    """TRL's center_rewards_coefficient: adds this times (r_chosen + r_rejected)^2, keeping scores
    near 0 (0: off)"""


SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection, "optim": OptimSection,
            "parallel": ParallelSection, "fsdp": FsdpSection, "checkpoint": CheckpointSection,
            "lora": LoraSection, "preference": PreferenceSection, "reward": RewardSection, "rl": RLSection}
ALIASES = {"engine": "fsdp"}  # old name -> canonical name; a file may not use both
PATH_KEYS = ("model.name_or_path", "data.path", "data.eval_path", "data.cache_dir", "train.output_dir",
             "checkpoint.dir", "checkpoint.resume", "fsdp.dcp_path")
for _section in (*SECTIONS.values(), EngineConfig):  # --help: the docstring under each key, read by pydantic
    _section.__pydantic_config__ = ConfigDict(use_attribute_docstrings=True)


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rl: RLSection = field(default_factory=RLSection)

    # mesh key -> the section its messages name: where the config gave it, else where it gave the
    # others ("fsdp", the old place, only when it gave none under "parallel"); `renamed`: the keys
    # it gave under fsdp, said once (`say_renamed_keys`)
    spelling = types.MappingProxyType({})
    renamed = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key(self, name: str) -> str:
        """A mesh key as this config spelled it (`fsdp.tp_size` or `parallel.tp_size`), for messages."""
        return f"{self.spelling.get(name, 'parallel')}.{name}"

    def engine_config(self) -> EngineConfig:
        """The engine's config: the fsdp section's settings, the parallel section's mesh, the run's freeze."""
        values = {f.name: getattr(self.fsdp, f.name) for f in dataclasses.fields(EngineConfig)}
        values.update({key: getattr(self.parallel, key) for key in MESH_KEYS}, freeze=self.freeze)
        return EngineConfig(**values)

    @property
    def output_dir(self) -> Path:
        return Path(self.train.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.output_dir / "checkpoints"

    @property
    def log_dir(self) -> Path:
        """Every rank's traceback of a failed run, and the launcher's log."""
        return self.output_dir / "logs"

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh of `world_size` processes; a `ConfigError` naming the parallel.* keys and the numbers
        when their product does not match (cp and tp named when used)."""
        mesh = self.parallel
        keys = {"pp_size": mesh.pp_size, "dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard,
                "cp_size": mesh.cp_size, "tp_size": mesh.tp_size}
        try:
            dims = ParallelDims(mesh.dp_replicate, mesh.dp_shard, world_size, cp=mesh.cp_size, tp=mesh.tp_size,
                                pp=mesh.pp_size)
        except ConfigError:
            named = " x ".join(f"{self.key(k)}={v}" for k, v in keys.items() if k.startswith("dp") or v > 1)
            fixed = math.prod(v for v in keys.values() if v != -1)
            why = (f"{world_size} is not divisible by {fixed}" if mesh.dp_shard == -1
                   else f"their product is {fixed}")
            raise ConfigError(f"{named} does not match the {world_size} processes ({why})") from None
        if mesh.ep_size == 1:
            return dims
        try:
            return dataclasses.replace(dims, ep=mesh.ep_size)
        except ConfigError as err:
            raise ConfigError(f"{self.spelling.get('ep_size', 'parallel')}.{err}") from None

    @property
    def freeze(self):
        """The run's freeze setting: `model.freeze`, or `fsdp.freeze` (the engine's key) where that is left at auto."""
        return self.fsdp.freeze if self.model.freeze == "auto" else self.model.freeze

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per step, over the data-parallel ranks of the mesh (cp and tp ranks
        share a batch); the mesh and batch arithmetic is checked here, naming the keys."""
        from .session import batch_arithmetic

        dims = self.parallel_dims(world_size)
        if self.train.objective == "grpo":  # completions: whole groups, the same prompts per data rank
            return batch_arithmetic(self.train.global_batch_size, self.rl.group_size, dims.dp_size,
                                    names=("train.global_batch_size", "rl.group_size"))
        steps = batch_arithmetic(self.train.global_batch_size, self.train.micro_batch_size, dims.dp_size,
                                 names=("train.global_batch_size", "train.micro_batch_size"))
        if dims.pp > 1:
            from ..parallel.pp import microbatches_of

            pieces = microbatches_of(dims.pp, self.parallel.pp_microbatches)
            if self.train.micro_batch_size % pieces:
                raise ConfigError(f"train.micro_batch_size={self.train.micro_batch_size} does not split into "
                                  f"{self.key('pp_microbatches')}={pieces} pipeline micro-batches"
                                  + ("" if self.parallel.pp_microbatches else " (unset: one per pp rank)"))
        return steps


# ---------------------------------------------------------------------------------------------- reading


class _Loader(yaml.SafeLoader):
    """YAML as people write it: PyYAML follows YAML 1.1, where `1e-4` (no dot) is a string."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def read_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: builds plain data only


def split_override(arg: str) -> tuple[str, str]:
    """`--section.key=value` into ("section.key", "value"); a ConfigError for anything else."""
    if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
        raise ConfigError(f"cannot read {arg!r}: overrides look like --section.key=value")
    dotted, raw = arg[2:].split("=", 1)
    return dotted, raw


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key=value` (or `--section.key value`) into nested dicts; values are read as YAML,
    so `--train.steps=10` is an int, `--optim.lr=3e-5` a float and `--data.path=null` is None."""
    result: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if "=" not in arg and arg.startswith("--") and "." in arg and i + 1 < len(args):
            arg, i = f"{arg}={args[i + 1]}", i + 1
        elif "=" not in arg and arg.startswith("--") and "." in arg:
            raise ConfigError(f"override {arg!r} has no value")
        dotted, raw = split_override(arg)
        section, _, key = dotted.partition(".")
        try:
            value = read_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        result.setdefault(ALIASES.get(section, section), {})[key] = value
        i += 1
    return result


def read_config_file(path: str | Path) -> dict:
    path = Path(os.path.expandvars(os.path.expanduser(str(path))))
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = read_yaml(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    for alias, canonical in ALIASES.items():
        if alias in raw and canonical in raw:
            raise ConfigError(f"config file {str(path)!r} has both sections {alias!r} and {canonical!r}; "
                              f"{alias!r} is the old name of {canonical!r}: keep one")
    return {ALIASES.get(k, k): v for k, v in raw.items()}


def _check_structure(raw: dict) -> None:
    """Unknown sections and keys, and sections that are not mappings, named with what is known."""
    unknown = sorted(set(raw) - set(SECTIONS), key=str)
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; sections are: {', '.join(SECTIONS)}")
    for name, values in raw.items():
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"section {name!r} must be a mapping of keys to values, got {values!r}")
        known = _keys(name)
        unknown = sorted(set(values) - set(known), key=str)
        if unknown:
            raise ConfigError(f"unknown key {name}.{unknown[0]}; the keys of section {name!r} are: {', '.join(known)}")


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                note: bool = True) -> TrainConfig:
    """Read a YAML file (optional), apply the overrides, check every key, type and range. `note`:
    say which mesh keys were read from their old place now (`fullshard train` says it once the run
    is accepted, so a refusal stays one line)."""
    raw = read_config_file(path) if path is not None else {}
    overrides = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    _check_structure(raw)
    _check_structure(overrides)
    for section, values in overrides.items():
        raw[section] = {**(raw.get(section) or {}), **values}
    raw = {name: values for name, values in raw.items() if values is not None}
    spelling = _settle_mesh(raw)
    try:
        config = _ADAPTER.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_respell(_describe_validation_error(err), spelling)) from None
    config.spelling = types.MappingProxyType(spelling)
    config.renamed = tuple(k for k in MESH_KEYS if k in (raw.get("fsdp") or {}) and spelling[k] == "fsdp")
    _expand_paths(config)
    _check_values(config)
    if note:
        say_renamed_keys(config)
    return config


def _settle_mesh(raw: dict) -> dict[str, str]:
    """The mesh keys given under `fsdp` (their old place) read as `parallel`'s, both sections then
    holding the same values (the engine's own checks see the mesh); the same key given in both with
    different values is refused. Returns each mesh key's section for messages (`TrainConfig.spelling`)."""
    old, new = raw.get("fsdp") or {}, raw.get("parallel") or {}
    for key in MESH_KEYS:
        if key in old and key in new and old[key] != new[key]:
            raise ConfigError(f"fsdp.{key}={old[key]!r} and parallel.{key}={new[key]!r} disagree: fsdp.{key} is "
                              f"the old name of parallel.{key}, keep one")
    given_old = [key for key in MESH_KEYS if key in old and key not in new]
    given_new = {k: v for k, v in new.items() if k in MESH_KEYS}
    mesh = {key: old[key] for key in given_old} | given_new
    if mesh:
        raw["parallel"], raw["fsdp"] = {**new, **mesh}, {**old, **mesh}
    others = "fsdp" if given_old and not given_new else "parallel"
    return {key: "fsdp" if key in given_old else "parallel" if key in given_new else others for key in MESH_KEYS}


def _respell(message: str, spelling: dict[str, str]) -> str:
    """`fsdp.tp_size` / `parallel.tp_size` in a message as the config spelled the key."""
    pattern = r"\b(?:fsdp|parallel)\.(" + "|".join(MESH_KEYS) + r")\b"
    return re.sub(pattern, lambda m: f"{spelling.get(m[1], 'parallel')}.{m[1]}", message)


def renamed_keys_note(config: TrainConfig) -> str | None:
    """The one line saying which mesh keys were read from their old place, or None."""
    old = config.renamed
    if not old:
        return None
    return (f"{', '.join(f'fsdp.{k}' for k in old)} read as {', '.join(f'parallel.{k}' for k in old)}: "
            "the mesh keys moved to the parallel section")


def say_renamed_keys(config: TrainConfig) -> None:
    """`renamed_keys_note` once: by the process that reads the config before launch, or by rank 0 under
    a torchrun the user started (ranks `fullshard train` started leave it to the launcher)."""
    from ..launch import LAUNCHED_ENV
    from ..log import warn_rank0

    note = renamed_keys_note(config)
    if note and os.environ.get(LAUNCHED_ENV) != "1" and os.environ.get("RANK", "0") == "0":
        warn_rank0(note)


_ADAPTER = TypeAdapter(TrainConfig)


def _describe_validation_error(err: ValidationError) -> str:
    """pydantic's first error as one line: `optim.min_lr_ratio=5: input should be less than or equal to 1`."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    msg = first["msg"].removeprefix("Value error, ")
    if len(loc) < 2:  # a section-level error, e.g. from EngineConfig.__post_init__, naming its key
        return f"{loc[0]}.{msg}" if loc and msg.split(" ")[0] in _keys(loc[0]) else f"{'.'.join(loc)}: {msg}"
    key = ".".join(loc[:2]) + "".join(f"[{part}]" for part in loc[2:])
    return f"{key}={first['input']!r}: {msg[:1].lower()}{msg[1:]}"


def _keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])] if section in SECTIONS else []


def _expand_paths(config: TrainConfig) -> None:
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        target = getattr(config, section)
        value = getattr(target, key, None)
        if isinstance(value, str) and value:
            setattr(target, key, os.path.expandvars(os.path.expanduser(value)))
        elif isinstance(value, list):  # data.path of a mixture
            setattr(target, key, [os.path.expandvars(os.path.expanduser(v)) for v in value])
    if config.checkpoint.resume is None:
        config.checkpoint.resume = "none"


def _check_values(config: TrainConfig) -> None:
    """The choices and ranges pydantic cannot see from the types (lists owned by other modules,
    fields of sections defined elsewhere)."""
    from ..dtypes import DTYPES
    from ..optim import OPTIMIZERS, SCHEDULES
    from .session import ACCUMULATION_POLICIES

    mesh = config.parallel
    checks = [
        ("train.accumulation_policy", config.train.accumulation_policy,
         config.train.accumulation_policy in ACCUMULATION_POLICIES, f"must be one of {ACCUMULATION_POLICIES}"),
        ("data.seq_len", config.data.seq_len, config.data.seq_len >= 2, "must be >= 2"),
        ("data.eval_fraction", config.data.eval_fraction, 0 <= config.data.eval_fraction < 1, "must be in [0, 1)"),
        ("optim.name", config.optim.name, config.optim.name in OPTIMIZERS, f"must be one of {sorted(OPTIMIZERS)}"),
        ("optim.schedule", config.optim.schedule, config.optim.schedule in SCHEDULES, f"must be one of {SCHEDULES}"),
        ("model.dtype", config.model.dtype, config.model.dtype in DTYPES, f"must be one of {sorted(DTYPES)}"),
        (config.key("dp_replicate"), mesh.dp_replicate, mesh.dp_replicate >= 1, "must be >= 1"),
        (config.key("dp_shard"), mesh.dp_shard, mesh.dp_shard == -1 or mesh.dp_shard >= 1,
         "must be >= 1, or -1 (what the world leaves)"),
        *((config.key(key), getattr(mesh, key), getattr(mesh, key) >= 1, "must be >= 1")
          for key in ("tp_size", "cp_size", "ep_size", "pp_size")),
        ("fsdp.timeout_s", config.fsdp.timeout_s, config.fsdp.timeout_s > 0, "must be > 0 seconds"),
        ("checkpoint.init_optimizer", config.checkpoint.init_optimizer,
         not config.checkpoint.init_optimizer or config.checkpoint.init_from, "needs checkpoint.init_from"),
    ]
    for key, value, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{key}={value!r} {rule}")
    from .metrics import check_report_to

    check_report_to(config.train.report_to)
    from ..data.mix import check_mixture

    check_mixture(config.data)
    _check_objective(config)


def _check_objective(config: TrainConfig) -> None:
    """Objective, data format and layout that do not fit together: one line before launch."""
    objective, data, mesh = config.train.objective, config.data, config.parallel
    if objective == "grpo":
        from ..objectives.grpo import check_config

        return check_config(config)
    if objective == "sft":
        if data.format == "preference":
            raise ConfigError("data.format=preference holds pairs for train.objective=dpo or "
                              "reward, not sft")
        return
    if data.format != "preference":
        raise ConfigError(f"train.objective={objective} trains on pairs: set data.format=preference "
                          "(prompt / chosen / rejected records)")
    for key, value, why in (("data.streaming", data.streaming, "pairs are prepared once per node"),
                            ("data.overlong", data.overlong == "truncate",
                             "pairs longer than data.seq_len are dropped")):
        if value:
            raise ConfigError(f"train.objective={objective}: {key} is not supported ({why})")
    if objective == "reward":
        for key, value, why in ((config.key("pp_size"), mesh.pp_size > 1,
                                 "the pipeline reads no scores yet"),
                                (config.key("cp_size"), mesh.cp_size > 1,
                                 "a sequence's score is on one cp rank"),
                                ("lora.r", config.lora.enabled,
                                 "the score head would not train beside the adapters")):
            if value:
                raise ConfigError(f"train.objective=reward: {key} is not supported ({why})")
        return
    strategy, section = config.preference.resolved_reference(config.lora.enabled), config.preference
    if mesh.cp_size > 1:
        for key, value, why in ((config.key("pp_size"), mesh.pp_size > 1, "with cp_size > 1"),
                                ("preference.reference=precompute", strategy == "precompute",
                                 "its pass reads whole rows"),
                                ("preference.sft_weight / loss_type=orpo",
                                 section.sft_weight or section.loss_type == "orpo", "their NLL term")):
            if value:
                raise ConfigError(f"train.objective=dpo under {config.key('cp_size')}={mesh.cp_size}: {key} "
                                  f"is not supported ({why})")


# ---------------------------------------------------------------------------------------------- help


def key_rows(name: str) -> list[tuple[str, str, str, str]]:
    """(flag, type, default, one line) for every key of section `name`, from its definition."""
    cls = SECTIONS[name]
    descriptions = key_descriptions(EngineConfig if cls is ParallelSection else cls)
    if cls is FsdpSection:  # the mesh keys' old place
        descriptions.update({key: f"read as --parallel.{key}" for key in MESH_KEYS})
    hints = typing.get_type_hints(cls, include_extras=True)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        about = " ".join(descriptions.get(f.name, "").split())
        rows.append((f"--{name}.{f.name}", _type_label(hints[f.name]), _yaml_value(default), about))
    return rows


def key_descriptions(cls) -> dict[str, str]:
    """Each key's description: the docstring under it, in the section's class or a class it extends
    (the fsdp section's keys are `EngineConfig`'s), as pydantic reads them."""
    found = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        properties = TypeAdapter(klass).json_schema(mode="serialization")["properties"]
        found.update({key: value["description"] for key, value in properties.items() if "description" in value})
    return found


def describe_keys() -> str:
    """Every section and key with its type, default and one line: the body of `fullshard train --help`."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"\n{name}:  {_first_line(cls.__doc__)}".rstrip())
        for flag, type_, default, about in key_rows(name):
            lines.append(f"{f'  {flag}  {type_} = {default}':<58} {about}".rstrip())
    return "\n".join(lines)


def _type_label(tp) -> str:
    """`int >= 1`, `float in [0, 1]`, `str | null`, `list[float]`, `text | chat`: the type with its range."""
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(str(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        bounds = {k: getattr(m, k) for m in meta for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None}
        for m in meta:  # Field(...) keeps its bounds in .metadata
            bounds.update({k: getattr(x, k) for x in getattr(m, "metadata", []) for k in ("ge", "gt", "le", "lt")
                           if getattr(x, k, None) is not None})
        label = _type_label(base)
        low = (f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else None)
        high = (f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else None)
        if low and high:
            return f"{label} in {low}, {high}"
        if low:
            return f"{label} {'>=' if 'ge' in bounds else '>'} {low[1:]}"
        return label
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_label(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{_type_label(args[0])}]" if args else "list"
    return "any" if tp is Any else getattr(tp, "__name__", str(tp))


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _first_line(doc: str | None) -> str:
    """A section's line: the first sentence of its docstring's first paragraph, whole."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    return "" if re.match(r"`?\w+`?: ", paragraph) else first_sentence(paragraph)


def first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence (a '. ' outside parentheses and not after e.g. or
    i.e.), without its final stop: never a cut inside a sentence."""
    depth = 0
    for index, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if depth == 0 and text.startswith(". ", index) and not text[:index].endswith(("e.g", "i.e")):
            return text[:index]
    return text.rstrip(".")


def docstring_entries(cls) -> dict[str, str]:
    """`key: text` (or `a / b: text`) entries of a class docstring and its bases', each with its
    continuation lines (indented further than the key), as one line."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        entry: list[str] | None = None
        indent = 0
        for line in (klass.__doc__ or "").splitlines():
            match = re.match(r"^(\s*)`?([\w /`]+?)`?:\s+(.+)$", line)
            if entry is not None and line.strip() and len(line) - len(line.lstrip()) > indent and not (
                    match and len(match.group(1)) == indent):
                entry.append(line.strip())
                continue
            entry = None
            if match:
                indent, entry = len(match.group(1)), [match.group(3)]
                for key in match.group(2).replace("`", "").split("/"):
                    found[key.strip()] = entry
    return {key: " ".join(parts) for key, parts in found.items()}
