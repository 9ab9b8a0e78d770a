"""Rollouts from engine processes (`rl.rollout=engines`): plain transformers models that sample and
get the trainer's weights through `WeightSync` after every update, the place vLLM or SGLang takes
in a deployment.

Trainer rank 0 starts `num_engines` processes on its node and hosts the sync's rendezvous; every
trainer rank joins it (`WeightSync.trainer`). A step: the ranks' prompts go to rank 0 with their
indices in the step, which hands each engine a contiguous share with every completion's stream
(`rl.sampling`, the streams colocated sampling uses, so engines and colocated ranks sample the same
completions from the same weights) and sends every rank its completions back; after the update
every rank takes part in `push`, which the engines `pull` before they sample again. An engine that
fails, or answers nothing within the timeout, fails the step on every rank in one line.
"""

from __future__ import annotations

import os
import queue as queues

import torch
import torch.distributed as dist

from ..distributed import agreed, broadcast_from_rank0, find_free_port, get_rank, get_world_size
from ..errors import ConfigError
from .rollout import Completions, cut_completions, left_padded
from .sampling import completion_seeds, sampling_options

HOST = "127.0.0.1"


def build_engine_model(spec: dict):
    """The engine's own copy of the policy, plain (unsharded) and in eval mode: a built-in config
    with random weights (the first pull replaces them all) or the model directory's."""
    import transformers

    if spec["builtin"]:
        from ..data.builtin import BUILTIN_MODELS, builtin_model_config, builtin_tokenizer

        name = spec["name"]
        config, model_class = builtin_model_config(
            name, builtin_tokenizer(name), spec["seq_len"], BUILTIN_MODELS[name]
        )
        model = model_class._from_config(config, dtype=spec["dtype"])
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["name"], dtype=spec["dtype"], trust_remote_code=spec["trust_remote_code"]
        )
    return model.eval()


def engine_main(
    spec: dict, engine_rank: int, num_engines: int, port: int, requests, responses, timeout_s: float
) -> None:
    """One engine process: pull the weights, then sample every request from them, pulling again
    after each answer (the trainer pushes after each update)."""
    from ..weight_sync import WeightSync, weight_loader

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = build_engine_model(spec).to(device)
        load = weight_loader(model)
        responses.put(("ready", None))  # the trainer hosts the rendezvous once every engine is up
        sync = WeightSync.engine(
            HOST, port, engine_rank, num_engines, timeout_s=timeout_s, device=device
        )
        sync.pull(load)
        while (request := _next(requests)) is not None:
            responses.put(("ok", _generate(model, request)))
            sync.pull(load)
    except Exception as err:  # noqa: BLE001 - reported to the trainer, which fails the step by name
        responses.put(("error", f"rollout engine {engine_rank}: {type(err).__name__}: {err}"))


def _next(requests):
    """The next request, or None once the trainer says stop or its rank 0 is gone."""
    parent = os.getppid()
    while True:
        try:
            return requests.get(timeout=5)
        except queues.Empty:
            if os.getppid() != parent:
                return None


@torch.no_grad()
def _generate(model, request: dict) -> list[list[int]]:
    """`group_size` completions of each prompt of the request, completion i from stream
    `seeds[i]`, at the request's temperature and top-p."""
    ids, mask = left_padded(request["prompts"], request["pad_token_id"])
    group, device = request["group_size"], next(model.parameters()).device
    sampling = dict(request["sampling"])
    options = sampling_options(request["seeds"], sampling.pop("temperature"), sampling.pop("top_p"))
    out = model.generate(
        input_ids=ids.repeat_interleave(group, 0).to(device),
        attention_mask=mask.repeat_interleave(group, 0).to(device),
        **options,
        **sampling,
    )
    return out[:, ids.shape[1] :].tolist()


class Engines:
    """The run's engine processes (started by trainer rank 0) and every rank's end of the sync."""

    def __init__(self, spec: dict, num_engines: int, timeout_s: float):
        import torch.multiprocessing as mp

        from ..weight_sync import WeightSync

        self.num_engines, self.timeout_s, self.processes = num_engines, timeout_s, []
        port = broadcast_from_rank0(find_free_port() if get_rank() == 0 else None)
        with agreed(ConfigError):  # every engine up, or one line naming the one that is not
            if get_rank() == 0:
                context = mp.get_context("spawn")
                self.requests = [context.Queue() for _ in range(num_engines)]
                self.responses = [context.Queue() for _ in range(num_engines)]
                for e in range(num_engines):
                    process = context.Process(target=engine_main, daemon=True, args=(
                        spec, e, num_engines, port, self.requests[e], self.responses[e], timeout_s))
                    process.start()
                    self.processes.append(process)
                for e in range(num_engines):
                    self._answer(e)
        self.sync = WeightSync.trainer(HOST, port, num_engines, timeout_s=timeout_s)

    def _answer(self, e: int):
        """Engine `e`'s next answer; a `ConfigError` if it failed, exited or timed out."""
        waited = 0.0
        while True:
            try:
                status, value = self.responses[e].get(timeout=5)
                break
            except queues.Empty:
                waited += 5
                process = self.processes[e]
                if not process.is_alive() or waited >= self.timeout_s:
                    why = f"exited (code {process.exitcode})" if not process.is_alive() else \
                        f"answered nothing in {self.timeout_s:.0f} s"
                    raise ConfigError(f"rollout engine {e} {why}") from None
        if status == "error":
            raise ConfigError(value)
        return value

    def push(self, model) -> float:
        """The model's weights to every engine (every rank calls it); the seconds it took."""
        return self.sync.push(model).seconds

    def sample(
        self,
        prompts: list[list[int]],
        group_size: int,
        *,
        seed: int,
        step: int,
        first: int,
        pad_token_id: int,
        eos_token_id,
        **sampling,
    ) -> Completions:
        """This rank's completions, `group_size` per prompt, sampled by the engines (`first`: the
        index of this rank's first prompt in the step; ranks of one data rank send the same)."""
        everyone = [None] * get_world_size()
        if dist.is_initialized() and get_world_size() > 1:
            dist.all_gather_object(everyone, (first, prompts))
        else:
            everyone = [(first, prompts)]
        answers = None
        with agreed(ConfigError):
            if get_rank() == 0:
                step_prompts = {at + i: p for at, part in everyone for i, p in enumerate(part)}
                options = dict(sampling, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
                answers = self._ask(step_prompts, group_size, seed, step, options)
        answers = broadcast_from_rank0(answers)
        rows = [row for i in range(first, first + len(prompts)) for row in answers[i]]
        return cut_completions([p for p in prompts for _ in range(group_size)], rows, eos_token_id)

    def _ask(self, prompts: dict, group_size, seed, step, sampling) -> dict[int, list]:
        """Each engine a contiguous share of the step's prompts (by index in the step); each
        prompt's `group_size` completions by its index."""
        order = sorted(prompts)
        share = -(-len(order) // self.num_engines)
        asked = []
        for e in range(self.num_engines):
            part = order[e * share : (e + 1) * share]
            if part:
                seeds = [s for i in part for s in completion_seeds(seed, step, i * group_size,
                                                                    group_size)]
                self.requests[e].put(
                    {
                        "prompts": [prompts[i] for i in part],
                        "group_size": group_size,
                        "pad_token_id": sampling["pad_token_id"],
                        "seeds": seeds,
                        "sampling": sampling,
                    }
                )
                asked.append((e, part))
        answers = {}
        for e, part in asked:
            rows = self._answer(e)
            for k, i in enumerate(part):
                answers[i] = rows[k * group_size : (k + 1) * group_size]
        return answers

    def close(self) -> None:
        """Stop the engines (rank 0) and leave the sync."""
        for requests in getattr(self, "requests", []):
            requests.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self.sync.close()
