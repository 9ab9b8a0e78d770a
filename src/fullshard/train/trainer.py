"""The training loop behind `fullshard train`: config in, trained checkpoint and HF directory out.

It runs on a `TrainingSession` (`train.session`, the core LightRFT's strategy API is a face of),
plus what a run needs around it: data positions and the config in every checkpoint (so a resume
continues with the next unseen batch and refuses other data), evaluation, metrics and the loss plot.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.manager import CheckpointManager
from ..data.builtin import builtin_model_config, builtin_tokenizer
from ..data.chat import adopt_chat_template
from ..data.prompts import load_prompts
from ..data.vision import is_multimodal
from ..distributed import ParallelDims, barrier, broadcast_from_rank0, get_rank, get_world_size, run_agreed
from ..dtypes import DTYPES, dtype_name
from ..fsdp import reshard_all
from ..hf.export import export_hf
from ..hf.lora import export_merged, save_adapter
from ..hf.recipe import source_dtype
from ..log import log_rank0, warn_rank0
from ..lora import apply_lora
from ..objectives import Objective, build_objective
from ..objectives.grpo import build_grpo
from ..objectives.logprobs import DEFAULT_LOSS_CHUNK_TOKENS
from ..objectives.sft import SFT
from ..optim import create_scheduler
from ..packed_attention import attention_path, use_attention
from ..tensors import parameter_counts
from .config import BUILTIN_MODELS, ConfigError, TrainConfig
from .data import load_data
from .metrics import (
    NO_PLOT,
    MetricsLogger,
    Throughput,
    check_report_to,
    model_flops_per_token,
    peak_device_flops,
    peak_memory_gb,
    plot_loss,
)
from .pp_step import pipeline_evaluate, pipeline_of, pipeline_train_step
from .rundir import claim_run_directory, lock_for_this_process, run_identity
from .session import TrainingSession, describe_mesh
from .step import train_step
from .stop import StopRequest


def strategy_of(config: TrainConfig) -> TrainingSession:
    """The training session for a run, not yet set up: the engine config of its fsdp and parallel
    sections (every engine setting reaches the engines it builds) plus the train section's batch
    sizes, seed, clipping and accumulation policy."""
    train = config.train
    micro = config.rl.group_size if train.objective == "grpo" else train.micro_batch_size  # grpo: whole groups
    return TrainingSession(seed=train.seed, max_norm=train.max_norm, micro_batch_size=micro,
                           global_batch_size=train.global_batch_size, config=engine_settings(config),
                           accumulation_policy=train.accumulation_policy)


def engine_settings(config: TrainConfig):
    """The engine's config: the fsdp section, the parallel section's mesh, the run's freeze."""
    return config.engine_config()


def build_strategy(config: TrainConfig) -> TrainingSession:
    """`strategy_of(config)` with its process group started and its mesh and batch arithmetic checked."""
    strategy = strategy_of(config)
    strategy.setup_distributed()
    return strategy


class ContextSplit:
    """This rank's part of every batch under context parallelism (the batches unchanged without it)."""

    def __init__(self, dims: ParallelDims, rank: int, pad_token_id: int | None):
        self.cp, self.cp_rank = dims.cp, dims.coordinates(rank)["cp"]
        self.pad_token_id = pad_token_id or 0

    def __call__(self, micro_batches: list[dict]) -> list[dict]:
        if self.cp == 1:
            return micro_batches
        from ..objectives.preference import ROLE, context_parallel_pairs
        from ..parallel.cp import context_parallel_batch

        parts = []
        for batch in micro_batches:
            part = context_parallel_batch(batch, self.cp_rank, self.cp, self.pad_token_id)
            parts.append(context_parallel_pairs(batch, part, self.cp_rank, self.cp) if ROLE in batch else part)
        return parts


def load_tokenizer(config: TrainConfig):
    """The run's tokenizer, or for a vision-language model its processor (images, tokenizer, chat
    template), holding the chat template the run trains with (saved with checkpoints and exports)."""
    return adopt_chat_template(read_tokenizer(config), config.data)


def read_tokenizer(config: TrainConfig):
    """The model's tokenizer or processor as stored."""
    if config.model.name_or_path in BUILTIN_MODELS:
        return builtin_tokenizer(config.model.name_or_path)
    from transformers import AutoTokenizer

    name, trust = config.model.name_or_path, config.model.trust_remote_code
    if is_vision_language(name, trust):
        from ..data.vision import load_processor

        return load_processor(name, trust)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ConfigError(f"the tokenizer of model.name_or_path={name!r} ships its own Python code, which fullshard "
                          "does not run unless model.trust_remote_code is true") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of model.name_or_path={config.model.name_or_path!r} has no EOS token "
                          "to separate packed documents")
    return tokenizer


def is_vision_language(name: str, trust_remote_code: bool) -> bool:
    """Whether the model at `name` is one transformers builds for image-text-to-text."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        model_type = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError):
        return False  # loading the tokenizer names the problem
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def rope_index(config: TrainConfig, tokenizer):
    """For a vision-language model with mRoPE, the position rows its data is built with (`data.vision.RopeIndex`)."""
    from ..data.vision import RopeIndex

    if not is_multimodal(tokenizer):
        return None
    name = config.model.name_or_path
    if name in BUILTIN_MODELS:
        return RopeIndex.of(builtin_model_config(name, tokenizer, config.data.seq_len, BUILTIN_MODELS[name])[0])
    from transformers import AutoConfig

    return RopeIndex.of(AutoConfig.from_pretrained(name, trust_remote_code=config.model.trust_remote_code))


def quiet_image_feature_views() -> None:
    """Silence torch's "FSDP2-wrapped module returned a view tensor" for a VLM's root module. The
    views are its per-image features (transformers' `get_image_features` returns `torch.split` of the
    vision tower's output, and the model output carries them beside the loss); the warning is about
    an in-place op on such a view dropping FSDP's pre-backward hook, and the step never changes a
    model output in place (it reads the loss or the logits), so training is exact (the VLM parity
    tests compare it with one process)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+For\w+\) returned a "
                            "view tensor", category=UserWarning)


def text_tokenizer(tokenizer):
    """The tokenizer itself, also when the run reads with a processor."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def build_model(config: TrainConfig, strategy: TrainingSession, tokenizer) -> torch.nn.Module:
    """A sharded model: a built-in config with seeded random weights, or a local HF directory
    loaded slice by slice into the shards."""
    dtype = DTYPES[config.model.dtype]
    lora = config.lora.peft_fields() if config.lora.enabled else None
    torch.manual_seed(config.train.seed)  # the random weights of a built-in model, and the adapters' init
    reward = config.train.objective == "reward"
    if reward:
        from ..objectives import reward as reward_model

        pad = text_tokenizer(tokenizer).pad_token_id
        pad = text_tokenizer(tokenizer).eos_token_id if pad is None else pad  # TRL's, the packer's
    if config.model.name_or_path not in BUILTIN_MODELS:
        if reward:
            return reward_model.load_reward_model(
                config.model.name_or_path, strategy.engine(), dtype, config.train.seed, pad,
                config.model.attn_implementation).train()
        from ..pretrained import from_pretrained

        return from_pretrained(config.model.name_or_path, engine=strategy.engine(), dtype=dtype, lora=lora,
                               attn_implementation=config.model.attn_implementation).train()
    name = config.model.name_or_path
    hf_config, model_class = builtin_model_config(name, tokenizer, config.data.seq_len, BUILTIN_MODELS[name])
    if reward:
        model_class = reward_model.reward_model_class(reward_model.as_reward_config(hf_config, pad))
    model = use_attention(model_class._from_config(hf_config, dtype=dtype), config.model.attn_implementation)
    if lora is not None:
        model = apply_lora(model, lora)
    return strategy.prepare_model(model, is_training=True)


def parameters_line(model: torch.nn.Module) -> str:
    """"35,040 parameters", and where some are frozen (LoRA) how many of them train: "36,576
    parameters, 1,536 trainable" (sharded or not: a DTensor counts its global elements)."""
    total, params = parameter_counts(model)[0], list(model.parameters())
    if all(p.requires_grad for p in params):
        return f"{total:,} parameters"
    return f"{total:,} parameters, {sum(p.numel() for p in params if p.requires_grad):,} trainable"


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict], loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
             objective: Objective | None = None) -> float | None:
    """Mean loss per unit (target token, pair) over this rank's eval batches and every other rank's;
    with `objective.metrics`, `(loss, {metric: mean})`."""
    if not batches:
        return None
    if pipeline_of(model) is not None:
        return pipeline_evaluate(model, batches, loss_chunk_tokens, objective)
    objective = objective or SFT(loss_chunk_tokens)
    model.eval()
    # tp ranks repeat their data rank's sums: they cancel in the ratio
    totals = torch.zeros(2 + len(objective.metrics), dtype=torch.float64)
    objective.begin_step(batches)
    for batch in batches:
        loss_sum, metric_sums = objective.loss_sum(model, batch)
        totals[0] += loss_sum.to("cpu", torch.float64)
        totals[1] += objective.count(batch)
        if metric_sums is not None:
            totals[2:] += metric_sums
    model.train()
    reshard_all(model)
    if dist.is_initialized() and get_world_size() > 1:
        dist.all_reduce(totals)
    loss = float(totals[0] / totals[1])
    if not objective.metrics:
        return loss
    return loss, dict(zip(objective.metrics, (totals[2:] / totals[1]).tolist()))


def eval_metrics(loss) -> dict:
    """Eval loss (mean per unit) and its perplexity, exp(loss) (next-token loss only); an objective's
    metrics under `eval_` names."""
    if isinstance(loss, tuple):
        loss, metrics = loss
        return {"eval_loss": loss, **{f"eval_{k}": v for k, v in metrics.items()}}
    return {"eval_loss": loss, "eval_ppl": None if loss is None else math.exp(min(loss, 700.0))}


class Trainer:
    """Runs one training job from a `TrainConfig`; `run()` returns a summary of what it did."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def _resume(self, manager: CheckpointManager, model, optimizer, scheduler, strategy, data, batches) -> int:
        """The step this run starts at: where its own newest checkpoint left off, or 0 for a new
        run, which `checkpoint.init_from` starts from another run's weights."""
        resume = self._resume_from
        extra = None
        if resume != "none":
            extra = manager.load(model, optimizer, scheduler, states={"strategy": strategy}, path=resume)
        if extra is None:
            self._init_from(manager, model, optimizer)
            return 0
        saved = extra.get("data", {}).get("fingerprint")
        if saved != data.fingerprint():
            raise ConfigError(f"the checkpoint in {manager.last_load_info['path']} was trained on other data "
                              f"(fingerprint {saved}, this data {data.fingerprint()}): write to another "
                              "train.output_dir, or set checkpoint.resume=none and checkpoint.overwrite=true to "
                              "replace that run")
        batches.load_state_dict(extra["data"])
        start = int(extra["data"]["position"])
        if start > self.config.train.steps:
            raise ConfigError(f"the checkpoint in {manager.last_load_info['path']} is at step {start}, past "
                              f"train.steps={self.config.train.steps}: raise train.steps to continue it")
        return start

    def _init_from(self, manager: CheckpointManager, model, optimizer) -> None:
        """Stage-2 training: this new run's weights (and optimizer state, when asked) from another
        run's checkpoint; its step, data and schedule start anew."""
        source = self.config.checkpoint.init_from
        if not source:
            return
        with_optimizer = self.config.checkpoint.init_optimizer
        optimizer = optimizer if with_optimizer else None
        if self.config.train.objective == "reward":  # an SFT run's checkpoint: the score head new
            from ..objectives.reward import init_reward_from

            extra = init_reward_from(manager, source, model, optimizer, self.config.train.seed)
        else:
            extra = manager.init_from(source, model, optimizer)
        log_rank0(f"initialised from {manager.last_load_info['path']} (step {extra['step']} of that run): its weights"
                  + (" and optimizer state" if with_optimizer else "") + "; steps, data and schedule start anew")

    def run(self) -> dict:
        """Build, train, finish, holding the run directory's lock (`rundir`) throughout. A stop asked
        for before the first step ends the run there: nothing trained, nothing saved."""
        self._lock = lock_for_this_process(self.config.output_dir)
        stop = StopRequest()  # from here a Ctrl-C is a stop
        try:
            run = self._build(stop)
            if stop.requested():
                run.logger.close()
                stop.finish(run.start, self.config.train.steps, None, before_start=True)
                return {"start_step": run.start, "end_step": run.start, "losses": {}, "batch_hashes": {},
                        "stopped_before_start": True}
            summary = self._train(run)
            return self._finish(run, summary)
        finally:
            stop.restore()
            if self._lock is not None:
                self._lock.release()

    def _claim_directory(self) -> None:
        """Rank 0 (or the launcher before it) holds the output directory and settles whose
        checkpoints it keeps, before anything of this run is written there; every rank learns what
        to resume (workers torchrun restarted resume what their run saved)."""
        def claim():
            if self._lock is not None:
                self._lock.acquire()
            return claim_run_directory(self.config)

        self._resume_from = broadcast_from_rank0(run_agreed(claim, on_rank=0, error_type=ConfigError))

    def _build(self, stop: StopRequest) -> "Run":
        """Everything a run needs, in order: the strategy (process group), data, model, optimizer,
        the checkpoint it resumes from, and the loggers."""
        config = self.config
        report_to = config.train.report_to
        check_report_to(report_to)  # on every rank, before any collective: a missing package fails them all
        strategy = build_strategy(config)
        self._claim_directory()
        rank = get_rank()
        if 0 < config.optim.warmup_steps >= config.train.steps:
            warn_rank0(f"optim.warmup_steps={config.optim.warmup_steps} >= train.steps={config.train.steps}: the "
                       "learning rate never reaches optim.lr")
        tokenizer = load_tokenizer(config)
        if is_multimodal(tokenizer) and (config.parallel.cp_size > 1 or config.parallel.pp_size > 1):
            raise ConfigError("image-text data is not split over context- or pipeline-parallel ranks yet: "
                              f"set {config.key('cp_size')}=1 and {config.key('pp_size')}=1")
        rl = config.train.objective == "grpo"
        data = load_prompts(config.data, tokenizer, config.rl.group_size) if rl else \
            load_data(config.data, tokenizer, rope_index(config, tokenizer))
        if is_multimodal(tokenizer):
            quiet_image_feature_views()
        model = build_model(config, strategy, tokenizer)
        reference = lambda: build_reference(config, strategy, tokenizer)  # noqa: E731
        objective = build_grpo(config, data, tokenizer, reference) if rl else build_objective(
            config.train.objective, config.train.loss_chunk_tokens, config.preference, config.lora.enabled, reference,
            config.reward)
        if strategy.engine().meshes.cp is not None:  # the pair losses sum each sequence's parts over cp
            objective.cp_group = strategy.engine().meshes.cp.get_group()
        optimizer = strategy.create_optimizer(
            model, lr=config.optim.lr, weight_decay=config.optim.weight_decay, name=config.optim.name,
            betas=tuple(config.optim.betas), eps=config.optim.eps, decay_embeddings=config.optim.decay_embeddings)
        scheduler = create_scheduler(optimizer, config.optim.schedule, config.optim.warmup_steps, config.train.steps,
                                     config.optim.min_lr_ratio)
        manager = CheckpointManager(config.checkpoint_dir, max_num=config.checkpoint.max_num,
                                    async_save=config.checkpoint.async_save)
        # tp and cp ranks of one data-parallel rank see the same rows
        dims = strategy.engine().dims
        dp_rank, dp_size = dims.coordinates(rank)["dp"], dims.dp_size
        batches = data.step_batches(config.train.global_batch_size, config.train.micro_batch_size, dp_rank, dp_size,
                                    seed=config.train.seed, shuffle=config.data.shuffle)
        start = self._resume(manager, model, optimizer, scheduler, strategy, data, batches)
        if getattr(objective, "reference_strategy", None) == "precompute":
            objective.reference = self._precomputed_reference(model, objective, data, dp_rank, dp_size, start)
        end = config.train.steps
        if config.train.stop_after is not None:
            end = min(end, start + config.train.stop_after)
        logger = MetricsLogger(config.output_dir, config.train.steps, start, enabled=rank == 0,
                               report_to=report_to, config=config.to_dict())
        log_rank0(f"{config.model.name_or_path}: {parameters_line(model)}, "
                  f"{describe_mesh(dims)}, {data.describe()} of {config.data.seq_len} tokens, "
                  f"steps {start}..{end} of {config.train.steps}" + (f" (resumed from step {start})" if start else ""))
        log_rank0(attention_path(model, config.data.packing and not rl))  # rollouts: one sequence a row
        split = ContextSplit(dims, rank, text_tokenizer(tokenizer).pad_token_id)
        eval_rows = config.train.eval_batches * config.train.global_batch_size  # the same rows on any batching
        evals = split(data.eval_batches(config.train.micro_batch_size, dp_rank, dp_size, eval_rows))
        checkpoint = manager.last_load_info["path"] if start else None
        return Run(strategy, tokenizer, data, model, optimizer, scheduler, manager, logger, start, end, batches,
                   evals, split, last_saved=start, checkpoint=checkpoint, stop=stop, objective=objective)

    def _precomputed_reference(self, model, objective, data, dp_rank: int, dp_size: int, start: int):
        """`preference.reference=precompute`: the reference log-probs of every pair, from the starting
        weights (the model as built, or `checkpoint.init_from`'s), kept in the run directory."""
        from ..objectives.precompute import cache_file, compute_table, precomputed_reference
        from .data import cache_dir_of
        from .rundir import REFERENCE_DIR

        config = self.config
        model_id = json.dumps([config.model.name_or_path, config.model.dtype, config.checkpoint.init_from,
                               config.train.seed, config.lora.peft_fields() if config.lora.enabled else None])
        kept, cached = (cache_file(place, data.fingerprint(), model_id)
                        for place in (Path(config.train.output_dir) / REFERENCE_DIR, cache_dir_of(config.data)))
        return precomputed_reference(kept, cached, lambda: compute_table(
            model, objective, [data.train, data.eval], config.train.micro_batch_size, dp_rank, dp_size),
            resumed=start > 0)

    def _extra_state(self, run: "Run", step: int) -> dict:
        return {"data": {"position": step, "fingerprint": run.data.fingerprint(), **run.batches.state_dict()},
                "config": self.config.to_dict(), "run": run_identity()}

    def _train(self, run: "Run") -> dict:
        """The steps of this run: train, log, evaluate and checkpoint on the configured intervals."""
        config, strategy, model = self.config, run.strategy, run.model
        optimizer, scheduler = run.optimizer, run.scheduler
        manager, logger, batches = run.manager, run.logger, run.batches
        throughput = Throughput(model_flops_per_token(model, config.data.seq_len), get_world_size(),
                                peak_device_flops(config.train.peak_tflops))
        losses, hashes, stop = {}, {}, run.stop
        started = time.perf_counter()
        for step in range(run.start, run.end):
            micro_batches = run.split(batches.micro_batches(step))
            if run.objective.runs_own_step:  # rollouts, rewards and updates (grpo)
                out = run.objective.run_step(strategy, model, optimizer, scheduler, micro_batches, step)
            elif pipeline_of(model) is not None:
                out = pipeline_train_step(strategy, model, optimizer, scheduler, micro_batches,
                                          config.train.loss_chunk_tokens, run.objective)
            else:
                out = train_step(strategy, model, optimizer, scheduler, micro_batches, config.train.loss_chunk_tokens,
                                 run.objective)
            throughput.add(out.tokens)
            losses[step], hashes[step] = out.loss, batches.step_hash(step)
            done = step + 1
            logger.step()
            if done % config.train.log_every == 0 or done == run.end or done == 1:  # the loss it starts from
                logger.log({"kind": "train", "step": done, "loss": out.loss, "lr": scheduler.get_last_lr()[0],
                            "grad_norm": out.result.grad_norm, "skipped": out.result.skipped, "tokens": out.tokens,
                            **({run.objective.unit: out.units} if run.objective.unit != "tokens" else {}),
                            "batch": hashes[step], **out.metrics, **throughput.tick(),
                            "peak_mem_gb": peak_memory_gb()},
                           show=TRAIN_SHOWN + shown_metrics(run.objective, out.metrics))
            if config.train.eval_every and done % config.train.eval_every == 0 and done < config.train.steps:
                evaluated = evaluate(model, run.evals, config.train.loss_chunk_tokens, run.objective)
                logger.log({"kind": "eval", "step": done, **eval_metrics(evaluated)},
                           show=eval_shown(evaluated, run.objective))
            if config.checkpoint.every and done % config.checkpoint.every == 0:
                run.checkpoint = manager.save(done, model, optimizer, scheduler, states={"strategy": strategy},
                                              extra_state=self._extra_state(run, done), tokenizer=run.tokenizer)
                run.last_saved = done
            if stop.requested():
                run.end = done
                break
        return {"start_step": run.start, "end_step": run.end, "losses": losses, "batch_hashes": hashes,
                "train_seconds": time.perf_counter() - started}

    def _finish(self, run: "Run", summary: dict) -> dict:
        """The final evaluation, checkpoint and exports, and one line saying where everything is.
        A run that had nothing left to train (re-run after it finished) logs no second eval row."""
        config, model, manager, end = self.config, run.model, run.manager, run.end
        strategy, output_dir, lora = run.strategy, config.output_dir, config.lora
        finished = end == config.train.steps
        if finished:
            evaluated = evaluate(model, run.evals, config.train.loss_chunk_tokens, run.objective)
            summary.update(eval_metrics(evaluated))
            if end > run.start and evaluated is not None:
                run.logger.log({"kind": "eval", "step": end, **eval_metrics(evaluated)},
                               show=eval_shown(evaluated, run.objective))
        if run.last_saved != end:
            run.checkpoint = manager.save(end, model, run.optimizer, run.scheduler, states={"strategy": strategy},
                                          extra_state=self._extra_state(run, end), tokenizer=run.tokenizer)
        manager.wait()
        run.objective.close()
        summary["checkpoint"] = str(run.checkpoint)  # this run's, whatever else the directory holds
        dtype = DTYPES[config.train.export_dtype] if config.train.export_dtype else source_dtype(model)
        if finished and config.checkpoint.export and not lora.enabled:
            summary["export"] = str(export_hf(model, output_dir / "hf", tokenizer=run.tokenizer, dtype=dtype))
        if finished and config.checkpoint.export and lora.enabled and lora.merge_on_export:
            summary["export"] = str(export_merged(model, output_dir / "hf", tokenizer=run.tokenizer, dtype=dtype))
        if "export" in summary:
            summary["export_dtype"] = dtype_name(dtype)
        if finished and lora.enabled and lora.save_adapter:
            summary["adapter"] = str(save_adapter(model, output_dir / "adapter"))
        run.logger.close()
        summary["metrics"] = str(run.logger.path)
        if get_rank() == 0 and config.train.plot and finished:
            key = "reward" if config.train.objective == "grpo" else "loss"
            png = plot_loss(run.logger.path, output_dir / f"{key}.png", key=key)
            summary["plot"] = str(png) if png else None
        barrier()
        if not run.stop.stopped:  # a stopped run ends with the stop line instead
            log_rank0(done_line(summary, plot_asked=config.train.plot and finished))
        run.stop.finish(end, config.train.steps, summary["checkpoint"])
        return summary


@dataclass
class Run:
    """The pieces of one run that its phases share."""

    strategy: TrainingSession
    tokenizer: object
    data: object  # train/data's prepared dataset
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    manager: CheckpointManager
    logger: MetricsLogger
    start: int
    end: int
    batches: object  # the data's step-addressed batches (train/data)
    evals: list
    split: ContextSplit
    last_saved: int = 0
    checkpoint: object = None  # the checkpoint this run resumed from or last wrote
    stop: StopRequest | None = None
    objective: Objective | None = None


TRAIN_SHOWN = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb")


def shown_metrics(objective: Objective, metrics: dict) -> tuple[str, ...]:
    """The objective's metrics the step line shows: those it names, else its third and fourth."""
    return tuple(objective.shown) if objective.shown is not None else tuple(metrics)[2:4]


def eval_shown(evaluated, objective: Objective | None = None) -> tuple[str, ...]:
    """The eval row's keys the console line shows."""
    if not isinstance(evaluated, tuple):
        return "eval_loss", "eval_ppl"
    if objective is not None and objective.shown is not None:
        return ("eval_loss", *(f"eval_{k}" for k in objective.shown))
    return "eval_loss", "eval_rewards/accuracies"


class OffloadedEngine:
    """What `build_model` asks of a session, with FSDP's CPU offload on: the reference model's shards
    live on the host and are gathered to the device for each forward."""

    def __init__(self, session: TrainingSession):
        from ..engine import FSDP2Engine

        self._engine = FSDP2Engine(replace(session.engine().config, offload_params=True))

    def engine(self):
        return self._engine

    def prepare_model(self, model: torch.nn.Module, is_training: bool = False) -> torch.nn.Module:
        return self._engine.shard_model(model).train(is_training)


def build_reference(config: TrainConfig, strategy: TrainingSession, tokenizer) -> torch.nn.Module:
    """The frozen reference of `preference.reference=model`: the starting weights (the model, or
    `checkpoint.init_from`'s), sharded like the policy, without LoRA, never in the optimizer."""
    from dataclasses import replace

    plain = replace(config, lora=replace(config.lora, r=None))
    reference = build_model(plain, OffloadedEngine(strategy) if config.preference.offload_reference else strategy,
                            tokenizer)
    if config.checkpoint.init_from:
        CheckpointManager(config.checkpoint_dir).init_from(config.checkpoint.init_from, reference, None)
    return reference.eval().requires_grad_(False)


def done_line(summary: dict, plot_asked: bool) -> str:
    """The run's last line: where the checkpoint, model, adapter, metrics and plot are (or why no plot)."""
    parts = [f"checkpoint {summary['checkpoint']}"]
    if "export" in summary:
        parts.append(
            f"model {summary['export']}" + (f" ({summary['export_dtype']})" if "export_dtype" in summary else "")
        )
    if "adapter" in summary:
        parts.append(f"adapter {summary['adapter']}")
    parts.append(f"metrics {summary['metrics']}")
    if summary.get("plot"):
        parts.append(f"{Path(summary['plot']).stem} plot {summary['plot']}")  # loss or reward
    elif plot_asked:
        parts.append(NO_PLOT)
    return "done: " + ", ".join(parts)


def train(config: TrainConfig) -> dict:
    return Trainer(config).run()
