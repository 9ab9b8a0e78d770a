"""Every completion sampled from its own random stream, whatever batch, rank or process draws it.

A stream is keyed by (`train.seed`, step, the completion's global index in the step: its prompt's
index among the step's prompts x `rl.group_size` + k), so a run sampled at world 1, at world 2,
resumed at another world size, or in engine processes draws the same completions from the same
weights. transformers' `generate` draws one `torch.multinomial` over the whole batch from the
global generator, which ties a row's tokens to the batch it sits in; here `generate` decodes
greedily over scores that `StreamSampler` makes: temperature, then top-p (transformers' own
warpers, so the distribution is `do_sample=True`'s with `top_k=0`), then Gumbel noise drawn per row
from that row's own `torch.Generator`. The argmax of logits plus Gumbel noise is an exact sample of
the softmax (the Gumbel-max trick), and each row consumes one noise vector per decode step, so its
tokens depend only on its stream and the model's logits.

The noise is drawn on the host (the same on CPU and GPU; one vocabulary-sized vector per row and
token, copied to the logits' device).
"""

from __future__ import annotations

import hashlib

import torch


def completion_seed(seed: int, step: int, index: int) -> int:
    """The seed of the stream of completion `index` (global in the step) at `step`."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def completion_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """The seeds of completions `first` .. `first + count - 1` of `step`."""
    return [completion_seed(seed, step, index) for index in range(first, first + count)]


def gumbel_noise(generator: torch.Generator, size: int) -> torch.Tensor:
    """`size` standard Gumbel draws (-log(-log u), u uniform in double precision) from one stream."""
    uniform = torch.rand(size, generator=generator, dtype=torch.float64)
    return uniform.log_().neg_().log_().neg_()  # u = 0 gives -inf: never chosen


class StreamSampler:
    """A logits processor: row i of every decode step is sampled from stream `seeds[i]` when
    `generate` decodes greedily over its output (`sampling_options`). Rows without a stream (the
    one-token stand-in a rank without prompts runs) get no noise."""

    def __init__(self, seeds: list[int], temperature: float = 1.0, top_p: float = 1.0):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.warpers = []
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        if not self.generators:
            return scores
        if len(self.generators) != scores.shape[0]:
            raise ValueError(f"{scores.shape[0]} rows to sample, {len(self.generators)} streams")
        noise = torch.stack([gumbel_noise(g, scores.shape[-1]) for g in self.generators])
        return scores + noise.to(device=scores.device, dtype=scores.dtype)


def sampling_options(seeds: list[int], temperature: float, top_p: float) -> dict:
    """`generate`'s keyword arguments that sample row i from stream `seeds[i]` (no top-k cut)."""
    from transformers import LogitsProcessorList

    sampler = StreamSampler(seeds, temperature, top_p)
    return dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
