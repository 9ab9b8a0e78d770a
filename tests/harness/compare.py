"""Train a sharded model and a single-process reference side by side and report how far apart they are."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from fullshard.distributed import get_rank, get_world_size
from fullshard.optim import clip_grad_norm, global_grad_norm
from fullshard.tensors import replicated
from fullshard.testing.zoo import build_model, make_batch, make_padded_batch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return replicated(t)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a plain tensor (a collective: call on all ranks)."""
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def grad_norm(params) -> torch.Tensor:
    """The global L2 grad norm, for plain and sharded parameters alike, on one mesh or several
    (FSDP and TP x FSDP parameters side by side, which `clip_grad_norm_` cannot combine; a collective)."""
    return global_grad_norm(params)


def data_slice(batch: dict, rank: int, world: int) -> dict:
    size = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * size:(rank + 1) * size] for k, v in batch.items()}


def step_on_slice(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    """One optimizer step of `model` on this rank's slice of `batch`; the loss averaged over every rank."""
    loss = model(**data_slice(batch, get_rank(), get_world_size())).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / get_world_size()


def reference_gaps(result: dict) -> tuple[float, float]:
    """The largest per-step gaps between a `train_against_reference` result's losses and grad norms
    and the reference's."""
    return (max(abs(a - b) for a, b in zip(result["loss"], result["ref_loss"])),
            max(abs(a - b) for a, b in zip(result["norm"], result["ref_norm"])))


def parity_problems(per_rank: list[dict], tol: float, max_norm: float = 0.0, complete: bool = True,
                    skip: tuple = ()) -> list[str]:
    """What is wrong in every rank's `train_against_reference` results (by key, keys in `skip` left
    out): a loss, grad-norm or weight gap above `tol`, names one side lacks (unless not `complete`: a
    rank holding part of the model), a first reference grad norm that `max_norm` would not clip."""
    return [f"rank {rank} {problem}" for rank, results in enumerate(per_rank)
            for problem in _problems({k: r for k, r in results.items() if k not in skip}, tol, max_norm, complete)]


def _problems(results: dict, tol: float, max_norm: float, complete: bool) -> list[str]:
    problems = []
    for key, r in results.items():
        loss, norm = reference_gaps(r)
        if max(loss, norm, r["max_weight_diff"]) > tol or (complete and r["missing"]):
            problems.append(f"{key}: loss {loss:.1e} norm {norm:.1e} weight {r['max_weight_diff']:.1e} "
                            f"({r['worst_weight']}) missing {r['missing'] if complete else '-'}")
        if max_norm > 0 and not r["ref_norm"][0] > max_norm:
            problems.append(f"{key}: first grad norm {r['ref_norm'][0]:.2f} is not clipped by {max_norm}")
    return problems


def train_against_reference(
    name: str,
    shard: Callable[[torch.nn.Module], torch.nn.Module],
    steps: int = 5, lr: float = 1e-3, batch_size: int = 4, seq_len: int = 16,
    dp_rank: int | None = None, dp_size: int | None = None,
    split: Callable[[dict], dict] | None = None,
    check_tie: bool = True, model_kwargs: dict | None = None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    inspect: Callable[[torch.nn.Module], object] | None = None, max_norm: float = 0.0,
) -> dict:
    """Train `name` sharded (each dp rank a slice of the batch) and whole in this process.

    `model_kwargs` override the zoo config; `prepare` turns each freshly built model into the one to
    train (a PEFT wrapper, a hooked router), for the reference and before sharding alike;
    `inspect(sharded_model)` runs after training and its result is returned as "inspect"; `split`
    cuts this rank's part from the whole batch (default: its dp slice; context parallelism also
    splits the sequence); `max_norm > 0` clips both by their global grad norm before each step.
    Returns the per-step losses and grad norms of both and the largest weight difference.
    """
    dp_rank = get_rank() if dp_rank is None else dp_rank
    dp_size = get_world_size() if dp_size is None else dp_size
    split = split or (lambda batch: data_slice(batch, dp_rank, dp_size))
    model_kwargs = model_kwargs or {}
    prepare = prepare or (lambda m: m)
    reference, model = prepare(build_model(name, **model_kwargs)), prepare(build_model(name, **model_kwargs))
    model = shard(model)
    # eps=1e-6: Adam's first step moves a weight by about lr * g / (|g| + eps); with the default 1e-8 a
    # 1e-9 gradient whose last bits differ (a sum in another order) moves it by different multiples of
    # lr: Adam amplifying rounding, not a sharding error.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.01, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, eps=1e-6)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "tied": []}
    for step in range(steps):
        batch = make_batch(name, batch_size=batch_size, seq_len=seq_len, seed=100)
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        out["ref_norm"].append(clip_grad_norm(reference.parameters(), max_norm))
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_loss"].append(float(ref_loss.detach()))

        loss = model(**split(batch)).loss
        loss.backward()
        out["norm"].append(clip_grad_norm(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        out["loss"].append(float(global_loss) / get_world_size())
        if check_tie:
            head, embed = model.get_output_embeddings(), model.get_input_embeddings()
            out["tied"].append(head is None or head.weight is embed.weight)
    sharded, ref = full_state(model), dict(reference.named_parameters())
    diffs = {k: (sharded[k] - ref[k].detach()).abs().max().item() for k in sharded}
    out["worst_weight"] = max(diffs, key=diffs.get)
    out["max_weight_diff"] = diffs[out["worst_weight"]]
    out["missing"] = sorted(set(ref) ^ set(sharded))
    if inspect is not None:
        out["inspect"] = inspect(model)
    return out


def train_on_padded_batches(name: str, make_model: Callable[[], torch.nn.Module], steps: int = 2,
                            lr: float = 1e-3) -> dict:
    """Train the sharded model `make_model()` builds (zoo model `name`) on this rank's slice of padded
    batches (`make_padded_batch`): its per-step losses and grad norms and its final weights, for
    comparing two ways of building the same model (activation checkpointing on and off, say)."""
    model = make_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, eps=1e-6)
    out = {"loss": [], "norm": []}
    for step in range(steps):
        batch = data_slice(make_padded_batch(name, seed=step), get_rank(), get_world_size())
        loss = model(**batch).loss
        loss.backward()
        out["norm"].append(float(global_grad_norm(model.parameters())))
        optimizer.step()
        optimizer.zero_grad()
        out["loss"].append(float(loss.detach()))
    out["weights"] = full_state(model)
    return out


def largest_gap(a: dict, b: dict) -> float:
    """The largest difference between two `train_on_padded_batches` results (losses, norms, weights)."""
    return max(*(abs(x - y) for key in ("loss", "norm") for x, y in zip(a[key], b[key])),
               *((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]))
