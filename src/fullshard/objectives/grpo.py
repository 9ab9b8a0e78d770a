"""GRPO from the command line (`train.objective=grpo`): each step samples, scores and updates.

One step on the trainer's ranks, colocated: this rank's prompts (`data.prompts`) are sampled
`rl.group_size` times each with `fullshard.generate` (the optimizer state off the device
meanwhile: `rl.offload`), each completion from its own stream keyed by its global index in the
step (`rl.sampling`: the same completions at any world size and in engine processes), the
completions scored by the reward functions (`rl.rewards`), the
rewards turned into advantages within each prompt's group (`rl.advantages`), the old policy's
log-probs (when `rl.epochs` > 1) and the reference's taken (`rl.phases`), and `rl.epochs`
optimizer updates made on them (`rl.policy_update`: token-budget micro-batches, global
aggregation). Metrics carry TRL's `GRPOTrainer` names. Unlike the per-micro-batch objectives, it
runs its own step (`runs_own_step`); the trainer keeps the loop, checkpoints, resume and export.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..optim import StepResult
from .base import Objective


def check_config(config) -> None:
    """What train.objective=grpo does not run yet, or cannot: one line before launch."""
    from ..rl.rewards import check_names, check_reward

    data, mesh, rl = config.data, config.parallel, config.rl
    engines = rl.rollout == "engines"
    unsupported = (
        (
            "model.name_or_path",
            engines and config.model.name_or_path == "tiny-qwen2-vl",
            "rl.rollout=engines holds a causal LM",
        ),
        (
            config.key("pp_size"),
            mesh.pp_size > 1 and not engines,
            "rl.rollout=colocated generates on the trainer, and generate does not run a pipelined "
            "model: use rl.rollout=engines",
        ),
        (config.key("cp_size"), mesh.cp_size > 1, "rollouts are not split over cp ranks"),
        ("data.streaming", data.streaming, "prompts are read whole"),
        ("data.format", data.format == "preference", "prompts come from chat or prompt records"),
        ("model.dtype", config.model.dtype == "fp16", "fp16 loss scaling is not in the RL update"),
    )
    for key, refused, why in unsupported:
        if refused:
            raise ConfigError(f"train.objective=grpo: {key} is not supported ({why})")
    rl.resolved_reference(config.lora.enabled)
    specs = reward_specs(config)
    if rl.reward_weights is not None and len(rl.reward_weights) != len(specs):
        raise ConfigError(
            f"rl.reward_weights has {len(rl.reward_weights)} weights for {len(specs)} reward "
            f"functions ({', '.join(specs)})"
        )
    for spec in specs:
        check_reward(spec)
    check_names(specs)


def reward_specs(config) -> list[str]:
    """The reward functions of the run: the ones named; without data and without any, the toy's."""
    specs = config.rl.rewards()
    if not specs and config.data.path is None:
        return ["digits"]
    if not specs:
        raise ConfigError(
            "train.objective=grpo needs rl.reward: a function (path/to/file.py:function or "
            "module:function), a built-in (accuracy, format, digits) or a reward model directory"
        )
    return specs


def build_grpo(config, data, tokenizer, reference_model) -> "GRPO":
    """The objective with its reference (`rl.reference`): `reference_model()` builds the frozen
    copy (kept on the host between its forwards on an accelerator), and its reward models
    (`rl.reward` directories: `rl.reward_model`, sharded over every rank, kept likewise)."""
    from ..dtypes import DTYPES
    from ..rl.phases import offload
    from ..rl.reward_model import load_reward_model

    kind = config.rl.resolved_reference(config.lora.enabled)
    reference = {"none": None, "adapter": "adapter"}.get(kind)
    if kind == "model":
        reference = reference_model()
        if next(reference.parameters()).device.type != "cpu":
            offload(reference)
    engine, dtype = config.engine_config(), DTYPES[config.model.dtype]
    max_tokens = config.rl.max_tokens_per_micro_batch
    return GRPO(config, data, tokenizer, reference,
                lambda spec: load_reward_model(spec, engine, dtype, max_tokens))


def start_engines(config):
    """`rl.num_engines` engine processes holding the run's model (`rl.engines`)."""
    from ..data.builtin import BUILTIN_MODELS
    from ..dtypes import DTYPES
    from ..rl.engines import Engines

    model = config.model
    spec = {
        "builtin": model.name_or_path in BUILTIN_MODELS,
        "name": model.name_or_path,
        "seq_len": config.data.seq_len,
        "dtype": DTYPES[model.dtype],
        "trust_remote_code": model.trust_remote_code,
    }
    return Engines(spec, config.rl.num_engines, timeout_s=config.fsdp.timeout_s)


class GRPO(Objective):
    """The step of `train.objective=grpo` (the rl section), on the run's prompts."""

    name = "grpo"
    unit = "completions"
    runs_own_step = True
    shown = ("reward", "kl", "entropy", "completions/mean_length", "generation_s", "update_s")

    def __init__(self, config, data, tokenizer, reference=None, load_model=None):
        from ..rl.rewards import Rewards
        from ..rl.update import UpdateConfig

        self.rl, self.data, self.seed = config.rl, data, config.train.seed
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.rewards = Rewards(reward_specs(config), config.rl.reward_weights, load_model)
        self.reference = reference  # a frozen model, "adapter", or None
        rl = config.rl
        self.update = UpdateConfig(
            loss_type=rl.loss_type,
            clip_ratio_low=rl.clip_ratio_low,
            clip_ratio_high=rl.clip_ratio_high,
            clip_ratio_c=rl.clip_ratio_c,
            agg=rl.loss_agg,
            kl_coef=rl.kl_coef,
            kl_kind=rl.kl_kind,
            entropy_coef=rl.entropy_coef,
            temperature=rl.temperature,
            max_tokens=rl.max_tokens_per_micro_batch,
            chunk_tokens=config.train.loss_chunk_tokens or 1 << 30,
            max_norm=config.train.max_norm,
        )
        self.metrics = ("reward", "reward_std", *(f"rewards/{n}/mean" for n in self.rewards.names))
        self.engines, self.pushed = (
            (start_engines(config) if rl.rollout == "engines" else None),
            False,
        )

    def run_step(self, strategy, model, optimizer, scheduler, batches: list, step: int):
        """Sample, score, take log-probs, update; returns the trainer's `StepOutput`."""
        from ..train.step import StepOutput

        dims, rows, seconds = strategy.parallel_dims, batches[0], {}
        dp_rank = dims.coordinates(dist.get_rank() if dist.is_initialized() else 0)["dp"]
        on_device = next(model.parameters()).device.type != "cpu"
        started = time.perf_counter()
        # each data rank holds an equal, contiguous share of the step's prompts (data.prompts)
        first = dp_rank * len(rows)
        completions = self._sample(model, optimizer, rows, step, first, on_device, seconds)
        rewards, table = self._score(rows, completions)
        rollouts = self._rollouts(model, completions, rewards, seconds)
        update = self._update(model, optimizer, scheduler, rollouts, dims, on_device, seconds)
        metrics, units, tokens = self._metrics(
            rewards, table, completions, update, rollouts, dims.tp * dims.pp
        )
        metrics.update(seconds, step_s=time.perf_counter() - started)
        result = StepResult(update["grad_norm"], update["skipped"])
        return StepOutput(update["loss"], tokens, result, metrics, units)

    def _sample(self, model, optimizer, rows, step, first, on_device, seconds):
        """The completions of this rank's prompts (`first`: the first one's index in the step)."""
        from ..distributed import agreed
        from ..rl.phases import offload, onload
        from ..rl.rollout import sample
        from ..rl.sampling import completion_seeds

        with agreed(ConfigError):
            prompts = [self.data.prompt_ids(row) for row in rows]
        if self.engines is not None:
            return self._from_engines(model, prompts, step, first, seconds)
        started = time.perf_counter()
        if on_device:  # the optimizer state leaves the device while the KV cache needs it
            offload(None, optimizer)
        seconds["sync_s"] = time.perf_counter() - started
        started, group = time.perf_counter(), self.rl.group_size
        eos = self.tokenizer.eos_token_id
        completions = sample(
            model,
            prompts,
            group,
            max_new_tokens=self.rl.max_new_tokens,
            temperature=self.rl.temperature,
            top_p=self.rl.top_p,
            pad_token_id=self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else eos,
            eos_token_id=eos,
            seeds=completion_seeds(self.seed, step, first * group, len(prompts) * group),
        )
        seconds["generation_s"] = time.perf_counter() - started
        started = time.perf_counter()
        if on_device:
            onload(None, optimizer)
        seconds["sync_s"] += time.perf_counter() - started
        return completions

    def _from_engines(self, model, prompts, step, first, seconds):
        """The engines' samples, from the streams colocated sampling uses; the first step sends
        them the weights they start from."""
        seconds["sync_s"] = 0.0 if self.pushed else self.engines.push(model)
        self.pushed = True
        started, eos = time.perf_counter(), self.tokenizer.eos_token_id
        completions = self.engines.sample(
            prompts,
            self.rl.group_size,
            seed=self.seed,
            step=step,
            first=first,
            eos_token_id=eos,
            pad_token_id=self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else eos,
            max_new_tokens=self.rl.max_new_tokens,
            temperature=self.rl.temperature,
            top_p=self.rl.top_p,
        )
        seconds["generation_s"] = time.perf_counter() - started
        return completions

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()

    def _score(self, rows, completions):
        """Every completion's weighted reward and each reward's values, agreed over the ranks."""
        from ..distributed import agreed

        group = self.rl.group_size
        texts = self.tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
        prompts = [self.data.prompt(row) for row in rows for _ in range(group)]
        shown = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts)
        ]
        records = [self.data.columns(row) for row in rows]
        keys = list(dict.fromkeys(k for record in records for k in record))
        columns = {k: [record.get(k) for record in records for _ in range(group)] for k in keys}
        scores = {}
        if self.rewards.models:
            with agreed(ConfigError):  # a reward model's chat template may fail on one rank alone
                encoded = self.rewards.encode(prompts, shown)
            scores = self.rewards.model_scores(encoded)  # sharded forwards: every rank in step
        with agreed(ConfigError):
            return self.rewards.score(prompts, shown, completions.completion_ids, columns, scores)

    def _rollouts(self, model, completions, rewards, seconds):
        """The update's input: advantages within each group, old and reference log-probs."""
        from ..rl.advantages import group_advantages, rloo_advantages
        from ..rl.phases import reference_logprobs, sequence_logprobs
        from ..rl.rollout import as_rollouts

        group, kind = self.rl.group_size, self.rl.advantage
        rewards = rewards.float()
        advantages = (
            rloo_advantages(rewards, group)
            if kind == "rloo"
            else group_advantages(rewards, group, norm_by_std=kind == "grpo")
        )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rollouts = as_rollouts(completions, advantages, pad)
        device = next(model.parameters()).device
        ids, mask = rollouts.input_ids.to(device), rollouts.attention_mask.to(device)
        rollouts.input_ids, rollouts.attention_mask = ids, mask
        rollouts.response_mask = rollouts.response_mask.to(device)
        rollouts.advantages = rollouts.advantages.to(device)
        started = time.perf_counter()
        options = dict(
            max_tokens=self.update.max_tokens,
            temperature=self.rl.temperature,
            chunk_tokens=self.update.chunk_tokens,
        )
        if self.rl.epochs > 1:  # on-policy at one epoch: the current log-probs, detached
            rollouts.old_logprobs = sequence_logprobs(model, ids, mask, **options)
        if self.reference is not None:
            rollouts.ref_logprobs = reference_logprobs(
                self.reference, ids, mask, policy=model, offloaded=device.type != "cpu", **options
            )
        seconds["logprobs_s"] = time.perf_counter() - started
        return rollouts

    def _update(self, model, optimizer, scheduler, rollouts, dims, on_device, seconds):
        from ..rl.update import policy_update

        started = time.perf_counter()
        for epoch in range(self.rl.epochs):  # the schedule steps once per batch of rollouts
            last = epoch == self.rl.epochs - 1
            update = policy_update(
                model,
                optimizer,
                rollouts,
                self.update,
                dp_size=dims.dp_size,
                repeats=dims.tp * dims.pp,  # the ranks holding this data rank's rollouts
                scheduler=scheduler if last else None,
            )
        seconds["update_s"] = time.perf_counter() - started
        if self.engines is not None:  # the engines sample the next step from the updated weights
            seconds["sync_s"] += self.engines.push(model)
        return update

    def _metrics(self, rewards, table, completions, update, rollouts, repeats: int):
        """TRL's GRPO metrics over every rank's completions (ranks repeating a data rank once)."""
        group, functions = self.rl.group_size, table.shape[1]
        lengths = torch.tensor([len(c) for c in completions.completion_ids], dtype=torch.float64)
        stds = rewards.view(-1, group).std(dim=1)
        known = ~torch.isnan(table)
        sums = torch.cat(
            [
                torch.stack(
                    [
                        rewards.sum(),
                        stds.sum(),
                        torch.tensor(float(len(stds))),
                        lengths.sum(),
                        torch.tensor(float(sum(completions.clipped))),
                        torch.tensor(float(len(lengths))),
                        rollouts.attention_mask.sum().double().cpu(),
                    ]
                ),
                torch.nan_to_num(table).sum(dim=0),
                known.sum(dim=0).double(),
            ]
        )
        extremes = torch.stack([lengths.max(), -lengths.min()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
            sums = sums / repeats
        reward, std, groups, length, clipped, count, tokens = sums[:7].tolist()
        per_function = sums[7 : 7 + functions] / sums[7 + functions :].clamp(min=1)
        metrics = {"reward": reward / count, "reward_std": std / groups}
        for name, value, seen in zip(
            self.rewards.names, per_function.tolist(), sums[7 + functions :].tolist()
        ):
            metrics[f"rewards/{name}/mean"] = value if seen else None
        metrics.update(
            {
                "completions/mean_length": length / count,
                "completions/max_length": float(extremes[0]),
                "completions/min_length": float(-extremes[1]),
                "completions/clipped_ratio": clipped / count,
                "entropy": update["entropy"],
                "clip_ratio/low_mean": update["clip_ratio/low_mean"],
                "clip_ratio/high_mean": update["clip_ratio/high_mean"],
            }
        )
        if self.reference is not None:
            metrics["kl"] = update["kl"]
        return metrics, int(round(count)), int(round(tokens))
