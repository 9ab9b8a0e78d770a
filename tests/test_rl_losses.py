"""`fullshard.rl`'s advantages, policy losses and KL estimators against verl's `core_algos`
(verl 0.9.1, installed without its dependencies) on the same random tensors: values, statistics
and gradients within 1e-6. Pure CPU, no process group.

Where the calls differ from verl's:
- `policy_loss(logprobs, old_logprobs, ...)` takes the current policy's log-probs first; verl's
  `compute_policy_loss_*(old_log_prob, log_prob, ...)` takes the old ones first. Its clip ratios,
  aggregation and global counts are keyword arguments; verl reads them from an `ActorConfig`
  (`clip_ratio_low/high`, `clip_ratio_c`, `global_batch_info` = dp_size, batch_num_tokens,
  global_batch_size, loss_scale_factor).
- `loss_type="ppo"` is verl's `vanilla`; `clip_ratio_c=None` (no dual clip) has no verl switch and
  is compared with verl at an unreachable bound (1e9).
- `group_advantages` / `rloo_advantages` take one reward per completion and consecutive group
  sizes, and return one advantage per completion; verl's take token-level rewards (summed), a
  group index per row and a response mask, and return `[batch, length]` (ours times the mask).
- `kl_penalty(logprobs, ref_logprobs, kind)` is verl's `kl_penalty(logprob, ref_logprob,
  kl_penalty)`, the same order.
"""

import importlib.machinery
import sys
import types

import pytest
import torch

from fullshard import rl

# verl's package imports these at import time for parts these tests never reach (its controller,
# its data protocol); they are not installed, so stand-ins are put in their place.
STAND_INS = ("ray", "tensordict", "tensordict.tensorclass", "orjson")


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None,
                               "__call__": lambda self, *a, **k: self})


@pytest.fixture(scope="module")
def verl():
    added = []
    for name in STAND_INS:
        try:
            __import__(name)
        except ImportError:
            module = _StandIn(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__path__ = []
            sys.modules[name] = module
            added.append(name)
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    yield types.SimpleNamespace(core=core_algos, ActorConfig=ActorConfig)
    for name in added:
        sys.modules.pop(name, None)


def _rollout(seed=0, batch=6, length=9):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    old = logprobs + torch.randn(batch, length, generator=generator, dtype=torch.float64) * 0.4
    advantages = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 0, 7, 1, 5])[:batch]
    mask = (torch.arange(length)[None] < lengths[:, None]).to(torch.float64)
    return logprobs, old, advantages, mask


def _close(ours, theirs, what):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float64),
                               torch.as_tensor(theirs, dtype=torch.float64),
                               atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: {m}")


VERL_NAMES = {"ppo": "vanilla", "gspo": "gspo", "cispo": "cispo"}
STATS = {"approx_kl": "actor/ppo_kl", "clip_fraction": "actor/pg_clipfrac",
         "clip_fraction_lower": "actor/pg_clipfrac_lower"}


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
def test_policy_loss_equals_verl(verl, loss_type):
    """Every aggregation, one process (counts from the micro-batch) and global (dp 2, given
    counts, a loss scale factor), with and without the dual clip: loss, statistics, gradient."""
    logprobs, old, advantages, mask = _rollout()
    settings = [dict(), dict(global_tokens=53, global_sequences=9, dp_size=2, loss_scale_factor=13)]
    duals = [3.0, None] if loss_type == "ppo" else [3.0]
    checked = 0
    for agg in rl.AGG_MODES:
        for setting in settings:
            for dual in duals:
                info = {"dp_size": setting.get("dp_size", 1),
                        "batch_num_tokens": setting.get("global_tokens"),
                        "global_batch_size": setting.get("global_sequences"),
                        "loss_scale_factor": setting.get("loss_scale_factor")}
                config = verl.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                                          clip_ratio_low=0.15, clip_ratio_high=0.28,
                                          clip_ratio_c=1e9 if dual is None else dual,
                                          loss_agg_mode=agg, global_batch_info=info)
                theirs_in = logprobs.clone().requires_grad_()
                fn = verl.core.get_policy_loss_fn(VERL_NAMES[loss_type])
                their_loss, their_stats = fn(old, theirs_in, advantages, mask, agg, config)
                their_loss.backward()
                ours_in = logprobs.clone().requires_grad_()
                loss, stats = rl.policy_loss(ours_in, old, advantages, mask, loss_type=loss_type,
                                             clip_ratio_low=0.15, clip_ratio_high=0.28,
                                             clip_ratio_c=dual, agg=agg, **setting)
                loss.backward()
                what = f"{loss_type} {agg} {setting} dual={dual}"
                _close(loss, their_loss, what)
                _close(ours_in.grad, theirs_in.grad, what + " grad")
                for ours_name, their_name in STATS.items():
                    _close(stats[ours_name], their_stats[their_name], f"{what} {ours_name}")
                assert float(ours_in.grad.abs().sum()) > 0
                checked += 1
    assert checked == len(rl.AGG_MODES) * 2 * len(duals)


def test_clipping_is_exercised_and_stats_are_trl_regions():
    """The random rollout clips on both sides and the dual clip bites, so the comparison above
    covers every branch; TRL's region fractions count what they say."""
    logprobs, old, advantages, mask = _rollout()
    _, stats = rl.policy_loss(logprobs, old, advantages, mask, clip_ratio_c=1.5)
    assert float(stats["clip_fraction"]) > 0.1 and float(stats["clip_fraction_lower"]) > 0
    ratio = torch.exp(logprobs - old)
    low = ((ratio < 0.8) & (advantages < 0) & mask.bool()).sum() / mask.sum()
    high = ((ratio > 1.2) & (advantages > 0) & mask.bool()).sum() / mask.sum()
    assert float(low) > 0 and float(high) > 0
    _close(stats["clip_ratio/low_mean"], low, "low")
    _close(stats["clip_ratio/high_mean"], high, "high")


def test_bad_arguments_are_named():
    logprobs, old, advantages, mask = _rollout()
    with pytest.raises(ValueError, match="loss_type='reinforce'"):
        rl.policy_loss(logprobs, old, advantages, mask, loss_type="reinforce")
    with pytest.raises(ValueError, match="agg='mean'"):
        rl.policy_loss(logprobs, old, advantages, mask, agg="mean")
    with pytest.raises(ValueError, match="clip_ratio_c=1.0"):
        rl.policy_loss(logprobs, old, advantages, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="needs global_tokens"):
        rl.policy_loss(logprobs, old, advantages, mask, dp_size=2)
    with pytest.raises(ValueError, match="kl kind 'k4'"):
        rl.kl_penalty(logprobs, old, "k4")
    with pytest.raises(ValueError, match="group_size=4"):
        rl.group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+",
                                  "low_var_kl+"])
def test_kl_penalty_equals_verl(verl, kind):
    logprobs, ref, _, _ = _rollout(seed=1)
    ref = ref.clone()
    ref[0, :3] = logprobs[0, :3] + torch.tensor([30.0, -30.0, 12.0], dtype=ref.dtype)  # the clamps
    ours_in, theirs_in = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    ours = rl.kl_penalty(ours_in, ref, kind)
    theirs = verl.core.kl_penalty(theirs_in, ref, kind)
    _close(ours, theirs, kind)
    weights = torch.randn_like(ours)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    _close(ours_in.grad, theirs_in.grad, kind + " grad")


@pytest.mark.parametrize("sizes", [4, [4, 1, 3, 2]])
def test_advantages_equal_verl(verl, sizes):
    """GRPO (std-normalised and Dr. GRPO) and RLOO; a group of one keeps its reward; a group whose
    rewards are all equal gets zeros."""
    generator = torch.Generator().manual_seed(2)
    n = 8 if isinstance(sizes, int) else sum(sizes)
    group_sizes = [sizes] * (n // sizes) if isinstance(sizes, int) else sizes
    rewards = torch.randint(0, 3, (n,), generator=generator).float() + torch.rand(n, generator=generator)
    rewards[:4] = 0.5  # a group of equal rewards
    index = torch.repeat_interleave(torch.arange(len(group_sizes)),
                                    torch.tensor(group_sizes)).numpy().astype(str)
    length = 5
    mask = (torch.arange(length)[None] < torch.randint(1, length + 1, (n, 1), generator=generator)).float()
    token_rewards = torch.zeros(n, length)
    token_rewards[torch.arange(n), mask.sum(1).long() - 1] = rewards
    for norm in (True, False):
        theirs, _ = verl.core.compute_grpo_outcome_advantage(token_rewards, mask, index,
                                                             norm_adv_by_std_in_grpo=norm)
        ours = rl.group_advantages(rewards, sizes, norm_by_std=norm)
        _close(ours[:, None] * mask, theirs, f"grpo norm={norm}")
        assert torch.all(ours[:4] == 0)
    theirs, _ = verl.core.compute_rloo_outcome_advantage(token_rewards, mask, index)
    _close(rl.rloo_advantages(rewards, sizes)[:, None] * mask, theirs, "rloo")
    if not isinstance(sizes, int):
        assert float(rl.rloo_advantages(rewards, sizes)[4]) == float(rewards[4])
