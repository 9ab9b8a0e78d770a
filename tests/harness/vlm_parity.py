"""A sharded VLM against one process on the whole batch, through a schedule of images and none.

Each step is a list of micro-batches, each a list of per-row flags (does the row hold an image). The
rows are split evenly over the data-parallel ranks, so a schedule says which rank sees an image. The
loss is the sum of token losses over the whole step's target tokens (what fullshard's trainer
trains), so the one-process reference and the sharded run take the same gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fullshard.distributed import get_rank, get_world_size
from fullshard.optim import clip_grad_norm
from fullshard.plan.towers import find_towers
from fullshard.testing.vlm_zoo import VLMInputs, build_vlm
from harness.compare import full_state

# step 0: one rank has an image, the other none; step 1: no rank has one; step 2: accumulation of a
# micro-batch with images on both ranks and one text-only
SCHEDULE = [
    [[True, False, False, False]],
    [[False, False, False, False]],
    [[True, False, False, True], [False, False, False, False]],
]


def token_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    targets = labels[:, 1:].reshape(-1)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=-100,
                           reduction="sum")
    return loss, int((targets != -100).sum())


def _vision_names(model) -> list[str]:
    towers = find_towers(model)
    return [n for n, _ in model.named_parameters() if any(n == t or n.startswith(t + ".") for t in towers.vision)]


def vlm_against_reference(model_type: str, shard, schedule=SCHEDULE, max_norm: float = 0.05, lr: float = 1e-3,
                          freeze=None, config=None, prepare=None, dp_size: int | None = None) -> dict:
    """Train `model_type` sharded by `shard(model)` and whole in this process through `schedule`.

    `freeze(model)` (optional) freezes the reference as the sharded run will be. `prepare(model)`
    (optional, e.g. LoRA) turns both models into what is trained, under the same seed, before
    freezing and sharding. `dp_size` is the number of data-parallel ranks the rows are split over
    (default: every rank; tensor-parallel ranks share their rows). Returns per-step losses and grad
    norms of both, the parameter names that had a gradient at each step on each side, the largest
    final weight difference and whether the frozen parameters stayed bit-identical."""
    rank, world = get_rank(), get_world_size()
    dp_size = dp_size or world
    reference, model = build_vlm(model_type, config=config), build_vlm(model_type, config=config)
    videos = any(f == "video" for micro in schedule for flags in micro for f in flags)
    inputs = VLMInputs(reference, video=videos)
    if prepare is not None:
        torch.manual_seed(0)
        reference = prepare(reference)
        torch.manual_seed(0)
        model = prepare(model)
    if freeze is not None:
        freeze(reference)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model = shard(model)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    vision = set(_vision_names(reference))
    ref_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=lr, weight_decay=0.01, eps=1e-6
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01, eps=1e-6)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "grads": [], "ref_grads": [],
           "vision": sorted(vision)}
    for step, micro_batches in enumerate(schedule):
        tokens = 0
        for flags in micro_batches:
            tokens += int((inputs.batch(flags, seed=step)["labels"][:, 1:] != -100).sum())
        ref_total, total = 0.0, torch.zeros(())
        for micro, flags in enumerate(micro_batches):
            seed = 100 * step + micro
            loss, _ = token_loss_sum(reference, inputs.batch(flags, seed=seed))
            (loss / tokens).backward()
            ref_total += float(loss) / tokens
            per_rank, dp_rank = len(flags) // dp_size, rank // (world // dp_size)
            mine = inputs.batch(flags, rows=range(dp_rank * per_rank, (dp_rank + 1) * per_rank), seed=seed)
            loss, _ = token_loss_sum(model, mine)
            (loss * dp_size / tokens).backward()  # FSDP averages over dp ranks: the sum over them is wanted
            total += loss.detach() / tokens
        torch.distributed.all_reduce(total)
        total /= world // dp_size  # ranks sharing rows (tp) each counted them
        out["ref_grads"].append(sorted(n for n, p in reference.named_parameters() if p.grad is not None))
        out["grads"].append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        out["ref_norm"].append(clip_grad_norm([p for p in reference.parameters() if p.grad is not None], max_norm))
        out["norm"].append(clip_grad_norm([p for p in model.parameters() if p.requires_grad], max_norm))
        ref_opt.step(), ref_opt.zero_grad(set_to_none=True)
        opt.step(), opt.zero_grad(set_to_none=True)
        out["ref_loss"].append(ref_total)
        out["loss"].append(float(total))
    return {**out, **_final_weights(model, reference, frozen, initial)}


def _final_weights(model, reference, frozen: list[str], initial: dict) -> dict:
    """The largest difference between the trained weights, the names only one side has, and the
    frozen parameters that changed."""
    sharded, ref = full_state(model), dict(reference.named_parameters())
    diffs = {k: (sharded[k] - ref[k].detach()).abs().max().item() for k in sharded}
    worst = max(diffs, key=diffs.get)
    return {"worst_weight": worst, "max_weight_diff": diffs[worst], "missing": sorted(set(ref) ^ set(sharded)),
            "frozen": frozen, "frozen_changed": [n for n in frozen if not torch.equal(sharded[n], initial[n])]}


def vlm_problems(name: str, r: dict, tol: float = 1e-5) -> list[str]:
    """What is wrong in one `vlm_against_reference` result."""
    if "error" in r:
        return [f"{name}: {r['error']}"]
    problems = []
    for step, (a, b, n, m, g, h) in enumerate(zip(r["loss"], r["ref_loss"], r["norm"], r["ref_norm"],
                                                  r["grads"], r["ref_grads"])):
        if not abs(a - b) <= tol:
            problems.append(f"{name}: step {step} loss {a:.7f} vs one process {b:.7f}")
        if not abs(n - m) <= tol * max(abs(m), 1e-12):
            problems.append(f"{name}: step {step} grad norm {n:.7g} vs one process {m:.7g}")
        if g != h:
            problems.append(f"{name}: step {step} gradients on {sorted(set(g) ^ set(h))[:4]} differ from one process")
    if r["missing"]:
        problems.append(f"{name}: names differ {r['missing'][:4]}")
    if r["frozen_changed"]:
        problems.append(f"{name}: frozen parameters changed: {r['frozen_changed'][:4]}")
    return problems
