"""A step's rollouts on the trainer's ranks: each prompt's group sampled with `fullshard.generate`,
then laid out as the update reads them (`Rollouts`: prompt and completion right-padded, the
completion's positions scored).

Each completion draws from its own random stream (`rl.sampling`: keyed by the seed, the step and
the completion's global index in the step), so what it samples depends on the weights alone, not
on the batch it is generated in, the data-parallel layout or the process: a run at world 1 and at
world 2, a resume at another world size, and engine processes (`rl.engines`) draw the same
completions from the same weights, and ranks that share a data rank (tp) draw the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .terms import Rollouts


@dataclass
class Completions:
    """One step's samples on this rank, `group_size` consecutive ones per prompt."""

    prompt_ids: list[list[int]]  # per completion: its prompt's tokens
    completion_ids: list[list[int]]  # up to and including the end of text
    clipped: list[bool]  # reached max_new_tokens without an end of text

    def __len__(self) -> int:
        return len(self.completion_ids)


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch and its attention mask (what `generate` continues)."""
    width = max((len(p) for p in prompts), default=1)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def sample(
    model,
    prompts: list[list[int]],
    group_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    pad_token_id: int,
    eos_token_id,
    seeds: list[int],
    **model_inputs,
) -> Completions:
    """`group_size` completions of each prompt from the (sharded) model, at `temperature` and
    `top_p` with no top-k cut, completion i from stream `seeds[i]` (`rl.sampling`); a collective
    on every rank of the model."""
    from ..generation import generate
    from .sampling import sampling_options

    ids, mask = left_padded(prompts, pad_token_id)
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        **sampling_options(seeds, temperature, top_p),
        **model_inputs,
    )
    rows = out[:, ids.shape[1] :].tolist()
    return cut_completions([p for p in prompts for _ in range(group_size)], rows, eos_token_id)


def cut_completions(prompts: list[list[int]], rows: list[list[int]], eos_token_id) -> Completions:
    """Generated rows cut after their first end of text (kept), or marked clipped without one."""
    ends = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    completions, clipped = [], []
    for row in rows:
        stop = next((i for i, token in enumerate(row) if token in ends), None)
        completions.append(row if stop is None else row[: stop + 1])
        clipped.append(stop is None)
    return Completions(prompts, completions, clipped)


def as_rollouts(completions: Completions, advantages: torch.Tensor, pad_token_id: int) -> Rollouts:
    """Prompt + completion per row, right-padded; the response mask set on the positions whose
    next token is a completion token (entry t scores token t + 1)."""
    lengths = [len(p) + len(c) for p, c in zip(completions.prompt_ids, completions.completion_ids)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    response = torch.zeros(len(lengths), width - 1)
    for row, (prompt, completion) in enumerate(
        zip(completions.prompt_ids, completions.completion_ids)
    ):
        ids[row, : lengths[row]] = torch.tensor(prompt + completion)
        attention[row, : lengths[row]] = 1
        response[row, len(prompt) - 1 : lengths[row] - 1] = 1
    return Rollouts(ids, attention, response, advantages.float())
