"""Expert parallelism: each MoE layer's experts split over the `ep` ranks, tokens sent to them.

Every rank of an ep group holds `num_experts / ep` whole experts (a contiguous run: ep rank k
owns experts `k*L .. k*L+L-1`), stored as a `DTensor` sharded on the expert dim over the ep mesh;
FSDP then shards each rank's experts over the `efsdp` ranks that hold the same ones, exactly as
torchtitan and transformers' own `DistributedConfig(ep_size=)` lay them out. Because the
parameters stay DTensors of the global expert tensors, DCP checkpoints, loading slices and exports
see the global layout and move between ep sizes without any code of their own.

Token dispatch (dropless, no capacity factor): the model's own router picks each token's experts
on the rank that holds the token; every (token, expert) pair goes to the expert's owner with one
all-to-all, the owner runs its experts with the model's own experts forward (on local expert ids,
weight 1), a second all-to-all brings the rows back, and the router weights combine them per
token, as the experts forward does in one process. Both all-to-alls are torch's differentiable
functional ones, which gloo runs too.

Gradients: an expert's gradient on its owner already sums the contributions of every rank of its
ep group (the all-to-all's backward brings them), so FSDP's reduction over the efsdp ranks must
divide by the whole data-parallel size, not by efsdp, for the result to equal the dense mean.

Experts are found from the model: its `base_model_ep_plan` where the config has one, else its
structure (transformers' fused `*Experts` modules, 3-D `gate_up_proj` / `up_proj` and `down_proj`
tensors whose first dim is `num_experts`). No family table.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..distributed import all_gather_single, all_gather_single_autograd
from ..errors import PlanError
from ..plan.towers import glob_regex

UP_NAMES = ("gate_up_proj", "up_proj")
DOWN_NAME = "down_proj"


@dataclass(frozen=True)
class ExpertsModule:
    """One fused experts module: its name, how many experts it holds, and its per-expert tensors."""

    name: str
    num_experts: int
    params: tuple[str, ...]  # names (inside the module) of the tensors whose dim 0 is the expert


def find_experts(model: nn.Module) -> list[ExpertsModule]:
    """Every fused experts module of `model`, from its EP plan if it has one, else from its structure."""
    return list((_from_ep_plan(model) or _from_structure(model)).values())


def _from_ep_plan(model: nn.Module) -> dict[str, ExpertsModule]:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    plan = getattr(config, "base_model_ep_plan", None) or {}
    if not plan:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    module_patterns = [glob_regex(prefix + p) for p, style in plan.items() if style == "ep_dispatch_experts"]
    param_patterns = [glob_regex(prefix + p) for p, style in plan.items() if style != "ep_dispatch_experts"]
    found = {}
    for name, module in model.named_modules():
        if not any(r.fullmatch(name) for r in module_patterns):
            continue
        params = tuple(p for p, _ in module.named_parameters(recurse=False)
                       if any(r.fullmatch(f"{name}.{p}") for r in param_patterns))
        count = _expert_count(module, params)
        if count:
            found[name] = ExpertsModule(name, count, params)
    return found


def _from_structure(model: nn.Module) -> dict[str, ExpertsModule]:
    found = {}
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        up = next((own[n] for n in UP_NAMES if n in own), None)
        down = own.get(DOWN_NAME)
        if up is None or down is None or up.dim() != 3 or down.dim() != 3 or up.shape[0] != down.shape[0]:
            continue
        params = tuple(n for n, p in own.items() if p.dim() >= 2 and p.shape[0] == up.shape[0])
        count = _expert_count(module, params)
        if count:
            found[name] = ExpertsModule(name, count, params)
    return found


def _expert_count(module: nn.Module, params: tuple[str, ...]) -> int:
    """The experts a module holds: its `num_experts`, which every per-expert tensor's dim 0 must equal."""
    sizes = {getattr(module, p).shape[0] for p in params}
    count = getattr(module, "num_experts", None)
    if not params or len(sizes) != 1 or (isinstance(count, int) and sizes != {count}):
        return 0
    return sizes.pop()


def per_expert_module_lists(model: nn.Module) -> list[str]:
    """ModuleLists named `experts` of identical modules: per-expert MoEs (transformers 4.x, remote-code
    models), whose block loops over its experts itself (`fullshard.parallel.ep_lists` splits those)."""
    return [name for name, m in model.named_modules()
            if name.rpartition(".")[2] == "experts" and isinstance(m, nn.ModuleList) and len(m) > 1
            and len({type(e) for e in m}) == 1]


def check_expert_parallel(model: nn.Module, ep: int) -> list[ExpertsModule]:
    """The fused experts modules to split over `ep` ranks (per-expert lists are checked here and split
    by `ep_lists.apply_expert_lists`), or a `PlanError` naming what cannot be split."""
    experts = find_experts(model)
    counts = {e.name: e.num_experts for e in experts}
    counts.update({name: len(model.get_submodule(name)) for name in per_expert_module_lists(model)})
    if not counts:
        raise PlanError(f"ep_size={ep} but {type(model).__name__} has no MoE experts to split; use ep_size=1")
    modules = dict(model.named_modules())
    for entry in experts:
        if entry.name.endswith(".base_layer") or hasattr(modules[entry.name], "parametrizations"):
            raise PlanError(f"ep_size={ep}: {entry.name} carries LoRA adapters on its expert tensors (PEFT "
                            "target_parameters), which do not compose with expert parallelism; target attention "
                            "or dense modules, or use ep_size=1")
    for name, count in counts.items():
        if count % ep:
            raise PlanError(f"ep_size={ep}: {name} has num_experts={count}, not divisible by ep_size")
    return experts


def owned_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def apply_expert_parallel(model: nn.Module, experts: list[ExpertsModule], ep_mesh: DeviceMesh,
                          shard: Callable[[nn.Module], float]) -> None:
    """Split each experts module's tensors over `ep_mesh`, route its calls through the all-to-all,
    and hand it to `shard` (the engine's `fully_shard` over the efsdp ranks, or nothing where no other
    rank holds the same experts), which returns what the dispatch must divide their gradients by.

    Meta tensors stay meta (the loader fills each rank's experts later); real ones are cut locally,
    every rank holding the same model, so nothing is sent.
    """
    modules = dict(model.named_modules())
    for entry in experts:
        module = modules[entry.name]
        for name in entry.params:
            param = getattr(module, name)
            module._parameters[name] = nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=param.requires_grad)
        module.forward = dispatch = ExpertDispatch(module, entry.num_experts, ep_mesh)
        dispatch.grad_divisor = shard(module)


class ExpertDispatch:
    """The experts module's forward under ep: (tokens, top-k expert ids, top-k weights) of this rank's
    tokens in, their weighted expert output out, the experts computed where they live."""

    def __init__(self, module: nn.Module, num_experts: int, ep_mesh: DeviceMesh):
        self.module, self.local_forward = module, module.forward
        self.num_experts, self.ep = num_experts, ep_mesh.size()
        self.num_local = num_experts // self.ep
        self.group = ep_mesh.get_group()
        self.grad_divisor = 1.0  # where no FSDP unit divides the experts' gradients, the data-parallel size

    @torch.compiler.disable  # split sizes are read on the host: compiled blocks run the dispatch eagerly
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        # grouping the pairs by expert groups them by owner too (owners hold contiguous runs)
        order = torch.argsort(expert_ids, stable=True)
        send = hidden_states[order // top_k]
        send_counts = torch.bincount(expert_ids, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # per source rank, per local expert
        send_sizes, recv_sizes = (c.view(self.ep, self.num_local).sum(1) for c in (send_counts, recv_counts))
        send_sizes, recv_sizes = send_sizes.tolist(), recv_sizes.tolist()  # the one host sync of the layer
        received = funcol.all_to_all_single_autograd(send.contiguous(), recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(self.num_local, device=expert_ids.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(recv_sizes)).unsqueeze(-1)
        output = self._run_local(received, local_ids)
        returned = funcol.all_to_all_single_autograd(output.contiguous(), send_sizes, recv_sizes, self.group)
        per_pair = returned[torch.argsort(order)].view(tokens, top_k, -1)
        return (per_pair * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)

    def _run_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The model's own experts forward on this rank's experts, top-1 with weight 1 (the router's
        weights are applied after the rows come home). A rank that got no rows still runs one zero
        row, so its part of both all-to-alls' backward and of FSDP's reduction happens like the others'."""
        empty = rows.shape[0] == 0
        if empty:
            rows, local_ids = rows.sum(0, keepdim=True), local_ids.new_zeros((1, 1))
        with _local_experts(self.module, self.num_local, rows.dtype, self.grad_divisor):
            output = self.local_forward(rows, local_ids, torch.ones_like(local_ids, dtype=rows.dtype))
        return output[:0] if empty else output


@contextlib.contextmanager
def _local_experts(module: nn.Module, num_local: int, dtype: torch.dtype, grad_divisor: float):
    """This rank's experts as plain tensors in the tokens' `dtype` and `num_experts` = their count, for
    the duration of a call: the experts forward indexes its tensors by local expert id. Experts FSDP
    gathers arrive in the compute dtype already and have their gradients divided by it; ones kept out
    of FSDP are cast here and their gradients divided on the way back (in the graph, not by a hook on
    the parameter: loading from meta replaces the parameters' tensors)."""
    originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    count = module.num_experts if hasattr(module, "num_experts") else None
    module._parameters.update({n: as_computed(p.to_local(), dtype, grad_divisor) for n, p in originals.items()})
    module.num_experts = num_local
    try:
        yield
    finally:
        module._parameters.update(originals)
        if count is None:
            del module.num_experts
        else:
            module.num_experts = count


class _DivideGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by `divisor` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, divisor: float) -> torch.Tensor:
        ctx.divisor = divisor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.divisor == 1.0 else grad / ctx.divisor), None


def as_computed(tensor: torch.Tensor, dtype: torch.dtype, grad_divisor: float) -> torch.Tensor:
    """An expert tensor FSDP leaves out, as one call computes with it: in the tokens' `dtype`, its
    gradient divided by `grad_divisor` (1 where FSDP divides it), both in the graph."""
    tensor = _DivideGrad.apply(tensor, grad_divisor)
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def describe_expert_parallel(model: nn.Module, ep: int, efsdp: int) -> str:
    """What `fullshard plan` prints under ep: how the experts are held and which each ep rank owns."""
    layout = ("each experts module is its own unit, gathering only the experts its rank owns" if efsdp > 1
              else "no other rank holds a rank's experts: kept whole, outside FSDP, never gathered")
    return (f"expert parallel (ep {ep} x efsdp {efsdp}; {layout}; the table above counts the experts inside "
            "their layers):\n" + "\n".join(expert_owners(model, ep)))


def expert_owners(model: nn.Module, ep: int) -> list[str]:
    """One line per ep rank: which experts of each experts module (fused or a per-expert list) it owns."""
    experts = [e.num_experts for e in check_expert_parallel(model, ep)]
    experts += [len(model.get_submodule(name)) for name in per_expert_module_lists(model)]
    counts = sorted(set(experts))
    lines = []
    for ep_rank in range(ep):
        runs = ", ".join(f"{owned_experts(n, ep, ep_rank)[0]}-{owned_experts(n, ep, ep_rank)[-1]} of {n}"
                         for n in counts)
        lines.append(f"  ep rank {ep_rank} (ranks r with r % {ep} == {ep_rank}): experts {runs} "
                     f"in each of the {len(experts)} experts modules")
    return lines



# ------------------------------------------------------------------------------ router (aux) loss

_ROUTER_GROUP: contextvars.ContextVar = contextvars.ContextVar("fullshard_router_group", default=None)


def global_router_loss(model: nn.Module, group) -> bool:
    """Make the model's load-balancing (router aux) loss that of the whole batch, as in one process.

    transformers computes it in the causal-LM forward from the router logits of the tokens it sees
    (`load_balancing_loss_func` of the model's module): a product of two per-expert means, so the
    mean of the ranks' losses is not the loss of their union. While this model runs, the function
    sees every rank's logits (and mask), gathered by a differentiable all-gather over `group`; its
    backward sums each rank's share, which the data-parallel mean of the gradients then turns into
    the one-process gradient. Other models of the class in the process keep the plain function.
    Returns whether the model has such a loss. Every rank must hold as many tokens (fixed-shape batches).
    """
    import sys

    # the module whose forward calls it: the model's own, or a base class's (a model subclassing
    # transformers' MoE to change its blocks keeps the inherited forward and that module's function)
    modules = (sys.modules.get(cls.__module__) for cls in type(model).__mro__)
    module = next((m for m in modules if getattr(m, "load_balancing_loss_func", None) is not None), None)
    if module is None:
        return False
    original = module.load_balancing_loss_func
    if not getattr(original, "fullshard_global", False):
        def over_all_ranks(gate_logits, *args, **kwargs):
            group = _ROUTER_GROUP.get()
            if group is not None and isinstance(gate_logits, (tuple, list)) and gate_logits:
                gate_logits = tuple(all_gather_single_autograd(g, 0, group) for g in gate_logits)
                mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
                if mask is not None:
                    mask = all_gather_single(mask.contiguous(), 0, group)
                    args, kwargs = args[:2], {**kwargs, "attention_mask": mask}
            return original(gate_logits, *args, **kwargs)

        over_all_ranks.fullshard_global = True
        module.load_balancing_loss_func = over_all_ranks
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature transformers inspects (generate, PEFT)
    def forward_with_global_router_loss(*args, **kwargs):
        token = _ROUTER_GROUP.set(group)
        try:
            return forward(*args, **kwargs)
        finally:
            _ROUTER_GROUP.reset(token)

    model.forward = forward_with_global_router_loss
    return True
