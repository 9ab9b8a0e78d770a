"""What the trainer optimises: one module per objective (`sft`, `preference`, `reward`), each an
`Objective` (data -> batch -> loss and metrics, `base.py`), and the per-token log-probs they share
(`logprobs`)."""

from __future__ import annotations

from .base import Objective
from .logprobs import token_logprobs

__all__ = ["Objective", "build_objective", "token_logprobs"]


def build_objective(name: str, chunk_tokens: int, preference=None, lora: bool = False,
                    reference_model=None, reward=None) -> Objective:
    """The objective `train.objective` names. `reference_model()` builds the frozen reference copy
    when the preference section's strategy is `model` (called only then); `reward` is the reward
    section."""
    if name == "sft":
        from .sft import SFT

        return SFT(chunk_tokens)
    if name == "reward":
        from .reward import Reward

        return Reward(reward.center_coefficient)
    from .preference import AdapterReference, ModelReference, Preference

    strategy = preference.resolved_reference(lora)
    # precompute: the table is read or computed once the run's starting weights are in (the trainer)
    reference = {"none": lambda: None, "precompute": lambda: None, "adapter": AdapterReference,
                 "model": lambda: ModelReference(reference_model())}[strategy]()
    objective = Preference(preference, reference, chunk_tokens)
    objective.reference_strategy = strategy
    return objective
