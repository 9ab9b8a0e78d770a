"""The training loop behind `fullshard train`: config in, trained checkpoint and HF directory out.

It is the strategy API used the way seed 001 intends, plus what a run needs around it: data
positions and the config in every checkpoint (so a resume continues with the next unseen batch
and refuses other data), evaluation, metrics and the loss plot.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointManager, export_hf
from ..distributed import barrier, get_rank, get_world_size
from ..dtypes import DTYPES
from ..engine import reshard_all
from ..lora import apply_lora, export_merged, save_adapter
from ..optim import create_scheduler
from ..strategy import FSDPStrategy
from .config import BUILTIN_MODELS, ConfigError, TrainConfig
from .data import PackedData, StepBatches, byte_tokenizer, eval_batches, load_data
from .loss import causal_lm_loss_sum, target_count
from .metrics import MetricsLogger, Throughput, model_flops_per_token, peak_device_flops, peak_memory_gb, plot_loss
from .step import train_step


def build_strategy(config: TrainConfig) -> FSDPStrategy:
    fsdp = config.fsdp
    strategy = FSDPStrategy(
        seed=config.train.seed, max_norm=config.train.max_norm, micro_train_batch_size=config.train.micro_batch_size,
        train_batch_size=config.train.global_batch_size, bf16=fsdp.mixed_precision == "bf16",
        args={"accumulation_policy": config.train.accumulation_policy, "fp16": fsdp.mixed_precision == "fp16",
              "dp_replicate": fsdp.dp_replicate, "activation_checkpointing": fsdp.activation_checkpointing,
              "offload_params": fsdp.offload_params, "reduce_dtype": fsdp.reduce_dtype, "plan": fsdp.plan})
    strategy.setup_distributed()
    return strategy


def load_tokenizer(config: TrainConfig):
    if config.model.name_or_path in BUILTIN_MODELS:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.name_or_path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of model.name_or_path={config.model.name_or_path!r} has no EOS token "
                          "to separate packed documents")
    return tokenizer


def build_model(config: TrainConfig, strategy: FSDPStrategy, vocab_size: int) -> torch.nn.Module:
    """A sharded model: a built-in config with seeded random weights, or a local HF directory
    loaded slice by slice into the shards."""
    dtype = DTYPES[config.model.dtype]
    reshard = config.fsdp.reshard_after_forward
    lora = config.lora.peft_fields() if config.lora.enabled else None
    torch.manual_seed(config.train.seed)  # the random weights of a built-in model, and the adapters' init
    if config.model.name_or_path not in BUILTIN_MODELS:
        from ..loading import from_pretrained

        return from_pretrained(config.model.name_or_path, engine=strategy.engine(-1, reshard), dtype=dtype,
                               lora=lora).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=config.data.seq_len,
                            **BUILTIN_MODELS[config.model.name_or_path])
    model = LlamaForCausalLM._from_config(hf_config, dtype=dtype)
    if lora is not None:
        model = apply_lora(model, lora)
    return strategy.prepare_model(model, is_training=True, reshard_after_forward=reshard)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict]) -> float | None:
    """Mean loss per target token over this rank's eval batches and every other rank's."""
    if not batches:
        return None
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        totals[0] += causal_lm_loss_sum(model, batch).to("cpu", torch.float64)
        totals[1] += target_count(batch)
    model.train()
    reshard_all(model)
    if dist.is_initialized() and get_world_size() > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


class Trainer:
    """Runs one training job from a `TrainConfig`; `run()` returns a summary of what it did."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def _resume(self, manager: CheckpointManager, model, optimizer, scheduler, strategy, data: PackedData) -> int:
        resume = self.config.checkpoint.resume
        if resume == "none":
            return 0
        extra = manager.load(model, optimizer, scheduler, strategy.scaler, path=resume)
        if extra is None:
            return 0
        saved = extra.get("data", {}).get("fingerprint")
        if saved != data.fingerprint():
            raise ConfigError(f"the checkpoint in {manager.last_load_info['path']} was trained on other data "
                              f"(fingerprint {saved}, this data {data.fingerprint()}): point checkpoint.dir elsewhere "
                              "or set checkpoint.resume=none")
        strategy.load_state_dict(extra["strategy"])
        return int(extra["data"]["position"])

    def run(self) -> dict:
        config = self.config
        strategy = build_strategy(config)
        config.accumulation_steps(get_world_size())
        rank, world = get_rank(), get_world_size()
        output_dir = config.output_dir
        tokenizer = load_tokenizer(config)
        data = load_data(config.data, tokenizer)
        model = build_model(config, strategy, len(tokenizer))
        optimizer = strategy.create_optimizer(
            model, lr=config.optim.lr, weight_decay=config.optim.weight_decay, name=config.optim.name,
            betas=tuple(config.optim.betas), eps=config.optim.eps, decay_embeddings=config.optim.decay_embeddings)
        scheduler = create_scheduler(optimizer, config.optim.schedule, config.optim.warmup_steps, config.train.steps,
                                     config.optim.min_lr_ratio)
        manager = CheckpointManager(config.checkpoint_dir, max_num=config.checkpoint.max_num,
                                    async_save=config.checkpoint.async_save)
        start = self._resume(manager, model, optimizer, scheduler, strategy, data)
        batches = StepBatches(data.train, config.train.global_batch_size, config.train.micro_batch_size, rank, world,
                              seed=config.train.seed, shuffle=config.data.shuffle)
        evals = eval_batches(data.eval, config.train.micro_batch_size, rank, world, config.train.eval_batches)
        end = config.train.steps
        if config.train.stop_after is not None:
            end = min(end, start + config.train.stop_after)
        logger = MetricsLogger(output_dir, config.train.steps, start, enabled=rank == 0)
        throughput = Throughput(model_flops_per_token(model, config.data.seq_len), world,
                                peak_device_flops(config.train.peak_tflops))
        if rank == 0:
            print(f"[fullshard] {config.model.name_or_path}: {sum(p.numel() for p in model.parameters()):,} parameters, "
                  f"{world} ranks, {len(data.train)} training sequences of {config.data.seq_len} tokens, "
                  f"steps {start}..{end} of {config.train.steps}" + (f" (resumed from step {start})" if start else ""))

        def extra_state(step: int) -> dict:
            return {"data": {"position": step, "fingerprint": data.fingerprint()}, "strategy": strategy.state_dict(),
                    "config": config.to_dict()}

        losses, hashes, last_saved = {}, {}, start
        started = time.perf_counter()
        for step in range(start, end):
            out = train_step(strategy, model, optimizer, scheduler, batches.micro_batches(step))
            throughput.add(out.tokens)
            losses[step], hashes[step] = out.loss, batches.step_hash(step)
            done = step + 1
            logger.step()
            if done % config.train.log_every == 0 or done == end:
                logger.log({"kind": "train", "step": done, "loss": out.loss, "lr": scheduler.get_last_lr()[0],
                            "grad_norm": out.result.grad_norm, "skipped": out.result.skipped, "tokens": out.tokens,
                            "batch": hashes[step], **throughput.tick(), "peak_mem_gb": peak_memory_gb()})
            if config.train.eval_every and done % config.train.eval_every == 0 and done < config.train.steps:
                logger.log({"kind": "eval", "step": done, "eval_loss": evaluate(model, evals)}, show=("eval_loss",))
            if config.checkpoint.every and done % config.checkpoint.every == 0:
                manager.save(done, model, optimizer, scheduler, strategy.scaler, extra_state=extra_state(done))
                last_saved = done
        summary = {"start_step": start, "end_step": end, "losses": losses, "batch_hashes": hashes,
                   "train_seconds": time.perf_counter() - started}
        finished = end == config.train.steps
        if finished:
            summary["eval_loss"] = evaluate(model, evals)
            logger.log({"kind": "eval", "step": end, "eval_loss": summary["eval_loss"]}, show=("eval_loss",))
        if last_saved != end:
            manager.save(end, model, optimizer, scheduler, strategy.scaler, extra_state=extra_state(end))
        manager.wait()
        summary["checkpoint"] = str(manager.latest())
        lora = config.lora
        if finished and config.checkpoint.export and not lora.enabled:
            summary["export"] = str(export_hf(model, output_dir / "hf", tokenizer=tokenizer))
        if finished and config.checkpoint.export and lora.enabled and lora.merge_on_export:
            summary["export"] = str(export_merged(model, output_dir / "hf", tokenizer=tokenizer))
        if finished and lora.enabled and lora.save_adapter:
            summary["adapter"] = str(save_adapter(model, output_dir / "adapter"))
        logger.close()
        if rank == 0 and config.train.plot and finished:
            png = plot_loss(logger.path, output_dir / "loss.png")
            summary["plot"] = str(png) if png else None
        barrier()
        if rank == 0:
            print(f"[fullshard] done: checkpoint {summary['checkpoint']}"
                  + (f", model {summary['export']}" if "export" in summary else "")
                  + (f", adapter {summary['adapter']}" if "adapter" in summary else "")
                  + (f", loss plot {summary['plot']}" if summary.get("plot") else ""))
        return summary


def train(config: TrainConfig) -> dict:
    return Trainer(config).run()
