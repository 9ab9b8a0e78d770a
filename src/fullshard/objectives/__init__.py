"""What the trainer optimises: one module per objective, and the per-token log-probs they share."""

from .logprobs import token_logprobs

__all__ = ["token_logprobs"]
