"""The pieces of an RL update that a framework calls a training backend for.

Advantages (`group_advantages`, `rloo_advantages`), the policy loss (`policy_loss`: PPO with dual
clip, GSPO, CISPO, every aggregation mode of verl), KL estimators (`kl_penalty`), the counts that
make aggregation global (`global_counts`) and token-budget micro-batches (`token_batches`), with
verl's (`verl.trainer.ppo.core_algos`) semantics; one update from fixed rollouts (`policy_update`);
the other phases of a colocated step: log-probs without gradients (`sequence_logprobs`,
`reference_logprobs`, `adapters_disabled`) and moving state off the device (`offload`, `onload`).
"""

from .advantages import group_advantages, rloo_advantages
from .batches import token_batches
from .counts import GlobalCounts, global_counts
from .losses import AGG_MODES, KL_KINDS, LOSS_TYPES, aggregate, kl_penalty, masked_mean, policy_loss
from .phases import adapters_disabled, offload, onload, reference_logprobs, sequence_logprobs
from .terms import Rollouts, UpdateConfig
from .update import policy_update

__all__ = ["AGG_MODES", "GlobalCounts", "KL_KINDS", "LOSS_TYPES", "Rollouts", "UpdateConfig",
           "adapters_disabled", "aggregate", "global_counts", "group_advantages", "kl_penalty",
           "masked_mean", "offload", "onload", "policy_loss", "policy_update", "reference_logprobs",
           "rloo_advantages", "sequence_logprobs", "token_batches"]
