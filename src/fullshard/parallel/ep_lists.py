"""Expert parallelism for MoEs that keep one module per expert (`self.experts = nn.ModuleList([...])`)
and loop over them in their own forward: transformers 4.x Mixtral / Qwen2-MoE / OLMoE, DeepSeek's
and many remote-code models.

Storage: the list becomes `LocalExperts`, holding only this ep rank's experts (the same contiguous
run `owned_experts` gives fused experts) under their global index, so every name stays the model's
own (`...experts.5.w1.weight`). The loader then reads only this rank's experts by name, DCP saves
each expert once, from its owners, and a run resumes at any ep size (world 1 included) with no code
of its own; the model records the names other ranks hold (`fullshard.tensors.mark_held_elsewhere`),
as a pipeline stage does, so loading, resuming and exporting expect them elsewhere.

Dispatch without rewriting the block: the block's forward runs twice. In the first pass each
`self.experts[e](x)` records `(e, x)` and returns zeros; every rank's calls per expert are gathered
(a small all-gather over the world: the owners' row counts, and whether any block called an expert
at all), the recorded rows go to their experts' owners with one all-to-all, the owners run them
through `LocalExperts` (one module call, so FSDP's hooks on it fire once), and a second all-to-all
brings the outputs home. In the second pass `self.experts[e](x)` returns the output computed for
that call, and the block combines them with its own router weights, differentiably. The second
pass starts from the random state the first did (router jitter routes the same), and the first
works on copies of the block's inputs (a block that scales its input in place, as Mixtral's jitter
does, sees it once). The cost: what the block computes besides its experts (router, shared expert)
runs twice, and forward hooks inside the block fire twice; the rows cross the network once each
way, as with fused experts. It assumes what every per-token MLP expert is: rows computed
independently, output shaped like the input.

Gradients: an expert's gradient on its owner sums every rank's tokens (the all-to-all's backward
brings them), so it is divided by the whole data-parallel size, as fused experts' are: by FSDP over
the efsdp ranks, or, where no other rank holds them (efsdp 1) and FSDP leaves them out, in the
graph of their call, which also casts them to the compute dtype (the engine's `shard` callback
decides). An expert that no rank's block called (a block that skips experts without tokens) has no
gradient, as in one process, so AdamW leaves it alone; one called by some block has one, zero
without rows. Each element of these experts lives on one rank of the world: `unique_parameters`
tells the global norm not to count it as a replica.

Without ep (`agree_on_expert_calls`) no row moves, but the same rule needs the ranks to agree: a
block skipping experts without tokens calls different experts on different data-parallel ranks, so
the calls are OR-ed over them and an expert called only elsewhere runs here on no rows.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tensors import mark_held_elsewhere, parameter_counts, state_names
from .ep import as_computed, owned_experts, per_expert_module_lists

_LIVE: "weakref.WeakSet[LocalExperts]" = weakref.WeakSet()


class LocalExperts(nn.Module):
    """This ep rank's experts of one per-expert MoE layer, each under its global index.

    Indexed and iterated like the `ModuleList` it replaces (length: every expert), so the block's
    own loop runs unchanged; inside its two passes `self[e]` is the stand-in for expert `e`, outside
    them the module itself, or an error naming the rank's run for an expert held elsewhere.
    Called, it runs its experts on rows grouped by expert.
    """

    def __init__(self, experts: nn.ModuleList, owned: range):
        super().__init__()
        self.num_experts, self.owned = len(experts), owned
        for e in owned:
            self.add_module(str(e), experts[e])
        self.stand_in: Callable | None = None
        self.grad_divisor = 1.0  # where no FSDP unit divides the experts' gradients, the data-parallel size
        _LIVE.add(self)

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return (self[e] for e in range(self.num_experts))

    def __getitem__(self, index):
        expert = operator.index(index)  # an int, or a one-element tensor from `nonzero()`
        expert += self.num_experts if expert < 0 else 0
        if self.stand_in is not None:
            return functools.partial(self.stand_in, expert)
        if expert in self.owned:
            return self._modules[str(expert)]
        raise IndexError(f"expert {expert} is held by another ep rank (this one holds experts "
                         f"{self.owned[0]}-{self.owned[-1]} of {self.num_experts})")

    def forward(self, rows: torch.Tensor, counts: list[int], called: list[bool]) -> torch.Tensor:
        """Rows grouped by local expert (`counts` each) -> their outputs, in the same order. The experts
        some rank's block called run, on no rows if none came here: as in one process, an expert the
        whole batch called has a gradient (zero without rows) and one nobody called has none; every
        rank holding an expert sees the same calls, so FSDP reduces the same gradients on each."""
        chunks = [(e, chunk) for e, chunk, runs in zip(self.owned, rows.split(counts), called) if runs]
        if not chunks:
            return rows.clone()  # no rows either
        with (
            contextlib.nullcontext() if self.grad_divisor == 1.0 else _outside_fsdp(self, rows.dtype, self.grad_divisor)
        ):
            return torch.cat([self._modules[str(e)](chunk) for e, chunk in chunks])


def unique_parameters(params: Iterable[torch.Tensor]) -> set[int]:
    """The ids of `params` that are per-expert parameters under ep: each element on one rank of the world."""
    held = {id(p) for experts in list(_LIVE) for p in experts.parameters()}
    return {id(p) for p in params if id(p) in held}


def apply_expert_lists(model: nn.Module, ep_mesh: DeviceMesh, shard: Callable[[nn.Module], float]) -> None:
    """Keep only this rank's experts of every per-expert list (`ep.per_expert_module_lists`), route
    each MoE block's calls through the all-to-all, and hand each `LocalExperts` to `shard` (the
    engine's FSDP unit over the efsdp ranks, or nothing where no other rank holds the same experts),
    which returns what their call must divide their gradients by. The checks
    (`ep.check_expert_parallel`) came first."""
    names = per_expert_module_lists(model)
    if not names:
        return
    everything, counts = state_names(model), parameter_counts(model)
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in names:
        parent, _, attr = name.rpartition(".")
        block = model.get_submodule(parent)
        experts = LocalExperts(getattr(block, attr), owned_experts(len(getattr(block, attr)), ep, ep_rank))
        setattr(block, attr, experts)
        block.forward = TwoPassDispatch(block.forward, experts, ep_mesh)
        experts.grad_divisor = shard(experts)
    mark_held_elsewhere(model, everything, getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    model.whole_model_parameter_counts = counts  # throughput and MFU count every expert


class TwoPassDispatch:
    """A per-expert MoE block's forward under ep (see the module docstring)."""

    def __init__(self, forward: Callable, experts: LocalExperts, ep_mesh: DeviceMesh):
        self.forward, self.experts = forward, experts
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.sources = ep_mesh.mesh.tolist()  # the global ranks of this ep group, in ep order

    @torch.compiler.disable  # a Python-level replay with host-side counts: compiled blocks run it eagerly
    def __call__(self, *args, **kwargs):
        like = _first_float_tensor(args, kwargs)  # the tokens, (..., hidden)
        calls: list[tuple[int, torch.Tensor]] = []

        def record(expert: int, rows: torch.Tensor) -> torch.Tensor:
            calls.append((expert, rows))
            return torch.zeros_like(rows)

        copy = lambda value: value.clone() if isinstance(value, torch.Tensor) else value  # noqa: E731
        devices = [like.device.index or 0] if like.device.type != "cpu" else []
        with torch.random.fork_rng(devices, device_type=like.device.type), _standing_in(self.experts, record):
            self.forward(*map(copy, args), **{k: copy(v) for k, v in kwargs.items()})
        outputs = iter(self._exchange(calls, like))

        def replay(expert: int, rows: torch.Tensor) -> torch.Tensor:
            recorded, output = next(outputs, (None, None))
            _same_call(recorded, (expert, rows.shape[0]))
            return output

        with _standing_in(self.experts, replay):
            result = self.forward(*args, **kwargs)
        _same_call(next(outputs, (None,))[0], None)  # and no recorded call was left out
        return result

    def _exchange(self, calls: list[tuple[int, torch.Tensor]], like: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
        """Every recorded call's rows to its expert's owner and back: ((expert, rows), output) per call."""
        num, local = self.experts.num_experts, len(self.experts.owned)
        order = sorted(range(len(calls)), key=lambda i: calls[i][0])  # by expert, so by owner
        send = torch.cat([calls[i][1] for i in order]) if calls else like.new_zeros((0, like.shape[-1]))
        counts, called = [0] * num, [False] * num
        for expert, rows in calls:
            counts[expert] += rows.shape[0]
            called[expert] = True
        # every rank's calls, a call as its rows + 1: the owners' rows, and whether any rank's block
        # called an expert at all (what decides, in one process, whether it has a gradient)
        mine = torch.tensor([c + 1 if k else 0 for c, k in zip(counts, called)], device=like.device)
        everyone = mine.new_empty(dist.get_world_size() * num)
        dist.all_gather_into_tensor(everyone, mine)
        everyone = everyone.view(-1, num).tolist()  # the one host sync of the layer
        owned = self.experts.owned
        table = [[max(everyone[r][e] - 1, 0) for e in owned] for r in self.sources]  # per source, per local expert
        send_sizes = [sum(counts[r * local:(r + 1) * local]) for r in range(self.ep)]
        recv_sizes = [sum(row) for row in table]
        received = funcol.all_to_all_single_autograd(send.contiguous(), recv_sizes, send_sizes, self.group)
        # arrived grouped by source rank, then expert: the experts want them grouped by expert
        per_row = torch.tensor([n for row in table for n in row], device=like.device)
        local_ids = torch.arange(local, device=like.device).repeat(self.ep).repeat_interleave(per_row)
        by_expert = torch.argsort(local_ids, stable=True)
        output = self.experts(received[by_expert], [sum(column) for column in zip(*table)],
                              [any(row[e] for row in everyone) for e in owned])[torch.argsort(by_expert)]
        returned = funcol.all_to_all_single_autograd(output.contiguous(), send_sizes, recv_sizes, self.group)
        pieces = dict(zip(order, returned.split([calls[i][1].shape[0] for i in order])))
        return [((e, rows.shape[0]), pieces[i]) for i, (e, rows) in enumerate(calls)]


def _first_float_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _same_call(recorded: tuple | None, replayed: tuple | None) -> None:
    if recorded != replayed:
        raise RuntimeError(f"the MoE block called its experts differently in its second pass ((expert, rows) "
                           f"{replayed} where the first had {recorded}; None: no call): its routing must be "
                           "deterministic for expert parallelism")


@contextlib.contextmanager
def _standing_in(experts: LocalExperts, function: Callable):
    experts.stand_in = function
    try:
        yield
    finally:
        experts.stand_in = None


@contextlib.contextmanager
def _outside_fsdp(module: nn.Module, dtype: torch.dtype, grad_divisor: float):
    """For one call of experts FSDP leaves out (efsdp 1): every parameter in the tokens' `dtype`, its
    gradient divided by `grad_divisor` in the graph, as `ep._local_experts` does for fused experts."""
    slots = [(owner, name, param) for owner in module.modules() for name, param in owner._parameters.items()
             if param is not None]
    for owner, name, param in slots:
        owner._parameters[name] = as_computed(param, dtype, grad_divisor)
    try:
        yield
    finally:
        for owner, name, param in slots:
            owner._parameters[name] = param


def agree_on_expert_calls(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Without ep, make the ranks FSDP reduces over agree on which experts of every per-expert list
    (`ep.per_expert_module_lists`) have a gradient.

    FSDP reduces only the parameters that have one, and a block that skips experts without tokens
    (transformers 4.x's `expert_hit` loop, DeepSeek's `if num_tokens == 0: continue`) gives each rank
    its own set: the ranks' reduce-scatters no longer match (gloo: a collective mismatch; NCCL: a
    hang). One process on the whole batch gives an expert a gradient iff some token reached it, so
    each block's calls are OR-ed over the data-parallel ranks (`AgreedExpertCalls`), and an expert
    called elsewhere but not here runs here on no rows: a zero gradient, as FSDP's sum wants. The
    block, its experts and every name stay as they are."""
    if dp_mesh.size() == 1:
        return
    for name in per_expert_module_lists(model):
        parent, _, attr = name.rpartition(".")
        block = model.get_submodule(parent)
        block.forward = AgreedExpertCalls(block.forward, getattr(block, attr), dp_mesh)


class AgreedExpertCalls:
    """A per-expert MoE block's forward that, where gradients are recorded, agrees with the other
    data-parallel ranks on the experts it called (see `agree_on_expert_calls`).

    The calls are seen by forward pre-hooks on the experts (a block that calls `expert.forward`
    directly is not seen). One small all-reduce per block call, in the same order on every rank,
    checkpoint recompute included; none under `no_grad` (evaluation, generation), where the ranks
    may call the model a different number of times and no gradient is reduced."""

    def __init__(self, forward: Callable, experts: nn.ModuleList, dp_mesh: DeviceMesh):
        self.forward, self.experts = forward, experts
        self.groups = [dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim)]  # HSDP: replicate and shard
        self.called: list[bool] | None = None
        for index, expert in enumerate(experts):
            expert.register_forward_pre_hook(functools.partial(self._record, index))

    def _record(self, index: int, module: nn.Module, args) -> None:
        if self.called is not None:
            self.called[index] = True

    def __call__(self, *args, **kwargs):
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in self.experts.parameters())):
            return self.forward(*args, **kwargs)
        self.called = [False] * len(self.experts)
        try:
            result = self.forward(*args, **kwargs)
            called = self.called
        finally:
            self.called = None
        like = _first_float_tensor(args, kwargs)  # the tokens, (..., hidden)
        everywhere = _called_anywhere(called, like.device, self.groups)
        no_rows = like.reshape(-1, like.shape[-1])[:0]
        idle = [self.experts[e](no_rows) for e, (here, anywhere) in enumerate(zip(called, everywhere.tolist()))
                if anywhere and not here]
        return _tie_into_first_tensor(result, everywhere, idle)


@torch.compiler.disable
def _called_anywhere(called: list[bool], device: torch.device, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    flags = torch.tensor(called, dtype=torch.int32, device=device)
    for group in groups:  # a max over each mesh dim in turn: over the whole mesh
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


def _tie_into_first_tensor(result, flags: torch.Tensor, idle: list[torch.Tensor]):
    """`result` (a tensor, or a tuple whose first tensor is the block's output) with `_Tie` on that tensor."""
    if isinstance(result, torch.Tensor):
        return _Tie.apply(result, flags, *idle)
    first = next(i for i, item in enumerate(result) if isinstance(item, torch.Tensor))
    return type(result)((*result[:first], _Tie.apply(result[first], flags, *idle), *result[first + 1:]))


class _Tie(torch.autograd.Function):
    """The block's output, unchanged, with the empty outputs of experts run on no rows as inputs whose
    gradient is empty: autograd runs those experts' backward, which leaves each parameter a zero
    gradient. It also saves the agreed flags on every rank, so a non-reentrant checkpoint's recompute
    (which stops once every saved tensor is back) reaches the all-reduce on every rank, not only on
    those whose idle experts saved tensors after it."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, flags: torch.Tensor, *idle: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flags)
        ctx.idle = [(t.shape, t.dtype, t.device) for t in idle]
        return output.clone()  # a new tensor: a block or layer may still change its output in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.idle))
