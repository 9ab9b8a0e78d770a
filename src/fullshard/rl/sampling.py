"""Every completion sampled from its own random stream, whatever batch, rank or process draws it.

A stream is keyed by (`train.seed`, step, the completion's global index in the step: its prompt's
index among the step's prompts x `rl.group_size` + k), so a run sampled at world 1, at world 2,
resumed at another world size, or in engine processes draws the same completions from the same
weights. transformers' `generate` draws one `torch.multinomial` over the whole batch from the
global generator, which ties a row's tokens to the batch it sits in; here `generate` decodes
greedily over scores that `StreamSampler` makes: temperature, then top-p (transformers' own
warpers, so the distribution is `do_sample=True`'s with `top_k=0`), then Gumbel noise of the row's
own stream. The argmax of logits plus Gumbel noise is an exact sample of the softmax (the
Gumbel-max trick), and each row takes one noise vector per decode step, so its tokens depend only
on its stream and the model's logits.

The noise is counter-based, as JAX's and Philox's streams are: uniform draw (row, decode step t,
token v) is SplitMix64's output for the row's seed at counter t x vocabulary + v + 1, computed with
int64 arithmetic on the logits' device for the whole [rows, vocabulary] block at once. Integer
arithmetic is exact, so the draws are the same on CPU and GPU, and no per-row generator state is
kept or moved.
"""

from __future__ import annotations

import hashlib

import torch

_BITS = 64


def _int64(constant: int) -> int:
    """An unsigned 64-bit constant as the int64 with its bits (torch's multiply wraps)."""
    return constant - (1 << _BITS) if constant >= 1 << (_BITS - 1) else constant


GAMMA = _int64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the golden ratio)
MIX1, MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def completion_seed(seed: int, step: int, index: int) -> int:
    """The seed of the stream of completion `index` (global in the step) at `step`."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def completion_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """The seeds of completions `first` .. `first + count - 1` of `step`."""
    return [completion_seed(seed, step, index) for index in range(first, first + count)]


def _shift_right(z: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """A logical right shift of int64 bits into `out` (torch's `>>` keeps the sign)."""
    torch.bitwise_right_shift(z, bits, out=out)
    return out.bitwise_and_((1 << (_BITS - bits)) - 1)


def splitmix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function (Steele, Lea, Flood 2014) on int64 bits, elementwise, in
    place (one scratch tensor: the [rows, vocabulary] blocks are large)."""
    scratch = torch.empty_like(z)
    z.bitwise_xor_(_shift_right(z, 30, scratch)).mul_(MIX1)
    z.bitwise_xor_(_shift_right(z, 27, scratch)).mul_(MIX2)
    return z.bitwise_xor_(_shift_right(z, 31, scratch))


def stream_uniforms(seeds: torch.Tensor, step: int, size: int) -> torch.Tensor:
    """[rows, size] uniform draws in [0, 1) (53 bits), row i from stream `seeds[i]` at decode step
    `step`, on `seeds`' device."""
    counters = torch.arange(size, dtype=torch.int64, device=seeds.device) + (step * size + 1)
    bits = splitmix64_(seeds[:, None] + counters.mul_(GAMMA)[None, :])
    return _shift_right(bits, 11, bits).double().mul_(2.0**-53)


def gumbel_noise(seeds: torch.Tensor, step: int, size: int) -> torch.Tensor:
    """Standard Gumbel draws, -log(-log u), of `stream_uniforms` (u = 0: -inf, never chosen)."""
    return stream_uniforms(seeds, step, size).log_().neg_().log_().neg_()


class StreamSampler:
    """A logits processor: row i of every decode step is sampled from stream `seeds[i]` when
    `generate` decodes greedily over its output (`sampling_options`). Rows without a stream (the
    one-token stand-in a rank without prompts runs) get no noise."""

    def __init__(self, seeds: list[int], temperature: float = 1.0, top_p: float = 1.0):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.seeds, self.step = torch.tensor(seeds, dtype=torch.int64), 0
        self.warpers = []
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        if not len(self.seeds):
            return scores
        if len(self.seeds) != scores.shape[0]:
            raise ValueError(f"{scores.shape[0]} rows to sample, {len(self.seeds)} streams")
        self.seeds = self.seeds.to(scores.device)
        noise = gumbel_noise(self.seeds, self.step, scores.shape[-1])
        self.step += 1  # one call per decode step: the rows' next draws
        return scores + noise.to(scores.dtype)


def sampling_options(seeds: list[int], temperature: float, top_p: float) -> dict:
    """`generate`'s keyword arguments that sample row i from stream `seeds[i]` (no top-k cut)."""
    from transformers import LogitsProcessorList

    sampler = StreamSampler(seeds, temperature, top_p)
    return dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
