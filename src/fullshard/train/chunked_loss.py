"""The chunked causal-LM loss, where it lived before the objectives had a package of their own: the
one implementation is `fullshard.objectives.logprobs` (shared with `token_logprobs`)."""

from ..objectives.logprobs import (  # noqa: F401
                                   DEFAULT_LOSS_CHUNK_TOKENS,
                                   IGNORE_INDEX,
                                   LinearCrossEntropy,
                                   chunkable_head,
                                   chunked_loss_sum,
                                   linear_cross_entropy_sum,
)
