"""Reward functions: the ones a run names, the built-ins, and their weighted sum per completion.

A reward function has TRL's signature, `reward(prompts, completions, completion_ids, **columns)
-> list[float | None]`: one value per completion, `None` where it does not apply (left out of the
sum and of its mean). `prompts` and `completions` are text, or chat turns when the prompt was a
conversation (`[{"role": "assistant", "content": text}]` per completion, as TRL passes them);
every other column of the prompt's record comes as a keyword, a list with one value per
completion. Only functions the run's config names are imported: `path/to/file.py:function` or
`module:function`; a data file never names code. An entry naming an existing directory is a
trained reward model (`rl.reward_model`), scored as TRL scores a model it is given as a reward.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from pathlib import Path

import torch

from ..errors import ConfigError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    """A completion's text: itself, or the content of its last turn."""
    if isinstance(completion, list):
        return str(completion[-1].get("content") or "") if completion else ""
    return str(completion)


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of a text (braces inside it balanced), if any."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += (text[index] == "{") - (text[index] == "}")
        if depth < 0:
            return text[begin:index].strip()
    return None


def final_answer(text: str) -> str | None:
    """The answer a text ends with: the last `\\boxed{...}`'s content, else its last number."""
    found = boxed(text)
    if found is not None:
        return found
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _same(answer: str | None, expected: str | None) -> bool:
    if answer is None or expected is None:
        return False
    try:
        return math.isclose(
            float(answer), float(expected.replace(",", "")), rel_tol=1e-9, abs_tol=1e-9
        )
    except ValueError:
        return answer.replace(" ", "") == expected.replace(" ", "")


def accuracy(prompts, completions, completion_ids, **columns) -> list[float | None]:
    """1 when the completion's final answer (`\\boxed{}` or its last number) equals the record's
    `answer` (as it is, or its `\\boxed{}`), or the final answer of its `solution`; else 0. None
    for a record with neither."""
    if columns.get("answer") is not None:
        expected = [
            None if a is None else boxed(str(a)) or str(a).strip() for a in columns["answer"]
        ]
    else:
        expected = [
            None if s is None else final_answer(str(s))
            for s in columns.get("solution") or [None] * len(completions)
        ]
    return [
        None if e is None else float(_same(final_answer(_text(c)), e))
        for c, e in zip(completions, expected)
    ]


FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_(prompts, completions, completion_ids, **columns) -> list[float]:
    """1 when the completion is `<think>...</think><answer>...</answer>` (TRL's and open-r1's
    format reward), else 0."""
    return [float(bool(FORMAT.match(_text(c)))) for c in completions]


def digits(prompts, completions, completion_ids, **columns) -> list[float]:
    """The built-in toy's verifier: the share of the completion's characters that are digits (a
    byte-level model sampling at random scores about 0.04)."""
    texts = [_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]


BUILTIN = {"accuracy": accuracy, "format": format_, "digits": digits}


def names_reward_model(spec: str) -> bool:
    """Whether an `rl.reward` entry is a reward model: a directory that is not a built-in's name
    (one that is both is refused by `load_reward`)."""
    from .reward_model import is_reward_model

    return spec not in BUILTIN and is_reward_model(spec)


def check_reward(spec: str) -> None:
    """What `spec` names exists and fits: a function (imported) or a reward model directory (its
    config read); else one line naming it."""
    from .reward_model import check_reward_model

    if names_reward_model(spec):
        check_reward_model(spec)
    else:
        load_reward(spec)


def load_reward(spec: str):
    """The function `spec` names: a built-in, `path/to/file.py:function` or `module:function`."""
    from .reward_model import is_reward_model

    if spec in BUILTIN and is_reward_model(spec):
        raise ConfigError(
            f"rl.reward={spec!r} is both a built-in and a directory here: write ./{spec} for the "
            "reward model in that directory, or move it"
        )
    if spec in BUILTIN:
        return BUILTIN[spec]
    if is_reward_model(spec):
        raise ConfigError(f"rl.reward={spec!r} names a reward model directory, not a function")
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(
            f"rl.reward={spec!r} is no built-in ({', '.join(BUILTIN)}), not "
            "path/to/file.py:function or module:function, and no directory (a reward model)"
        )
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ConfigError(f"rl.reward={spec!r}: no file {str(path)!r}")
        module_spec = importlib.util.spec_from_file_location(f"fullshard_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file: named, one line
            raise ConfigError(
                f"rl.reward={spec!r}: importing {str(path)!r} raised {type(err).__name__}: {err}"
            ) from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(
                f"rl.reward={spec!r}: importing module {where!r} raised {type(err).__name__}: {err}"
            ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"rl.reward={spec!r}: {where!r} has no function {name!r}")
    return function


def reward_name(spec: str) -> str:
    """The name its metrics go under (`rewards/<name>/mean`), as TRL's: the function's name, or a
    reward model directory's last part."""
    from .reward_model import reward_model_name

    if names_reward_model(spec):
        return reward_model_name(spec)
    return spec.rpartition(":")[2] or spec


def check_names(specs: list[str]) -> None:
    """Two rewards whose metrics would share a name (`rewards/<name>/mean`): one line."""
    seen: dict[str, str] = {}
    for spec in specs:
        name = reward_name(spec)
        if name in seen:
            raise ConfigError(
                f"rl.reward entries {seen[name]!r} and {spec!r} both log as rewards/{name}/mean: "
                "rename a function or a reward model's directory"
            )
        seen[name] = spec


class Rewards:
    """The run's rewards and weights: `score` gives each completion's weighted sum and each
    reward's values (NaN where a function returned None). A reward model directory is built by
    `load_model(spec)` (the trainer's: `rl.reward_model.load_reward_model` on every rank)."""

    def __init__(self, specs: list[str], weights: list[float] | None = None, load_model=None):
        if not specs:
            raise ConfigError(
                "train.objective=grpo needs rl.reward: name a function (path/to/file.py:function, "
                f"module:function), a built-in ({', '.join(BUILTIN)}) or a reward model directory"
            )
        if weights is not None and len(weights) != len(specs):
            raise ConfigError(
                f"rl.reward_weights has {len(weights)} weights for {len(specs)} reward functions"
            )
        check_names(specs)
        models = [names_reward_model(spec) for spec in specs]
        if any(models) and load_model is None:
            raise ConfigError(f"rl.reward={specs[models.index(True)]!r} is a reward model: "
                              "Rewards needs load_model to build it")
        self.specs, self.names = list(specs), [reward_name(spec) for spec in specs]
        self.functions = [
            load_model(spec) if model else load_reward(spec) for spec, model in zip(specs, models)
        ]
        self.models = [index for index, model in enumerate(models) if model]
        self.weights = torch.tensor(
            weights if weights is not None else [1.0] * len(specs), dtype=torch.float64
        )

    def encode(self, prompts: list, completions: list) -> dict[int, list[list[int]]]:
        """Each reward model's tokens of every prompt + completion (may fail on one rank alone:
        the caller agrees on it before `model_scores`)."""
        return {i: self.functions[i].encode(prompts, completions) for i in self.models}

    def model_scores(self, encoded: dict[int, list[list[int]]]) -> dict[int, torch.Tensor]:
        """The reward models' scores: their forwards, a collective every rank runs in step."""
        return {i: self.functions[i].scores(ids) for i, ids in encoded.items()}

    def score(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list],
        model_scores: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[n]` weighted sums, `[n, rewards]` values); a function that raises or returns other
        than one number or None per completion is a `ConfigError` naming it. `model_scores`: the
        reward models' values when already taken (else taken here)."""
        if model_scores is None:
            model_scores = self.model_scores(self.encode(prompts, completions))
        table = torch.full((len(completions), len(self.functions)), math.nan, dtype=torch.float64)
        for index, (spec, function) in enumerate(zip(self.specs, self.functions)):
            if index in model_scores:
                table[:, index] = model_scores[index].double()
                continue
            try:
                values = function(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    **columns,
                )
            except Exception as err:  # noqa: BLE001 - the user's function: named, one line
                raise ConfigError(
                    f"reward function {spec!r} raised {type(err).__name__}: {err}"
                ) from None
            table[:, index] = self._checked(spec, values, len(completions))
        # TRL: a completion no function applies to sums to 0 (nansum)
        return (torch.nan_to_num(table) * self.weights).sum(dim=1), table

    @staticmethod
    def _checked(spec: str, values, count: int) -> torch.Tensor:
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = (
                f"{len(values)} values"
                if isinstance(values, (list, tuple))
                else type(values).__name__
            )
            raise ConfigError(
                f"reward function {spec!r} returned {got} for {count} completions "
                "(one float or None each)"
            )
        try:
            return torch.tensor(
                [math.nan if v is None else float(v) for v in values], dtype=torch.float64
            )
        except (TypeError, ValueError):
            raise ConfigError(
                f"reward function {spec!r} returned a value that is not a number or None: "
                f"{next(v for v in values if not isinstance(v, (int, float, type(None))))!r}"
            ) from None
