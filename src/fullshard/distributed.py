"""Process groups, devices and the data-parallel mesh.

torch.distributed is the engine: torchrun (or any launcher that sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT) starts the ranks, and this module only picks the backend
that matches the device and builds the `DeviceMesh` that `fully_shard` shards over.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import ConfigError, FullshardError

# the functional all-gathers under their current names (torch 2.13 renamed them; the old names warn
# FutureWarning there, and are the only ones older torch has)
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
all_gather_single_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "hpu": "hccl"}


def detect_device_type() -> str:
    """The accelerator torch sees on this host, or "cpu"."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None else "cpu"


def has_accelerator() -> bool:
    return detect_device_type() != "cpu"


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def current_device(device_type: str | None = None) -> torch.device:
    device_type = device_type or detect_device_type()
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, get_local_rank())


def init_distributed(device_type: str | None = None, timeout_s: float | None = None) -> torch.device:
    """Start the default process group from the launcher's environment and bind this rank's device.

    Without a launcher (no WORLD_SIZE in the environment) a world of one is started on a free
    local port, so single-process scripts and notebooks use the same code path as torchrun.
    `timeout_s` bounds how long a collective waits for a rank that stopped calling it: past it,
    every waiting rank fails instead of hanging. More ranks on a node than it has devices is
    one error naming both counts, raised by every rank before any collective.
    Calling it again is a no-op that returns the bound device.
    """
    device_type = device_type or detect_device_type()
    if device_type not in BACKEND_FOR_DEVICE:
        raise ValueError(f"no backend known for device type {device_type!r}; known: {sorted(BACKEND_FOR_DEVICE)}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if device_type != "cpu":
        _check_devices_per_node(device_type)
    device = current_device(device_type)
    if device_type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if dist.is_initialized():
        return device
    backend = BACKEND_FOR_DEVICE[device_type]
    if device_type != "cpu":
        # lets CPU-side collectives (object broadcasts, error agreement) run beside the device ones
        backend = f"cpu:gloo,{device_type}:{backend}"
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if "WORLD_SIZE" not in os.environ:
        # one process without a launcher: a private rendezvous. The environment is left as it was,
        # since a launcher's variables there would make later code in this process (the CLI)
        # believe it runs under torchrun.
        dist.init_process_group(backend=backend, timeout=timeout, rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{find_free_port()}")
    else:
        store = _restarted_workers_store(timeout or timedelta(minutes=10))
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    _close_at_exit(dist.distributed_c10d._get_default_group())
    return device


# how long a closing process lets torch's gloo worker threads take the GIL to drop their last work
WORKERS_DRAIN_S = 0.05


def close_process_groups(drain: bool = True) -> None:
    """Destroy every process group, then let their worker threads finish with the GIL free.

    A gloo worker thread drops each collective's work after running it; the work holds the
    collective's tensors, and a tensor Python has already let go of needs the GIL to be freed.
    When that happens after the interpreter started finalizing, Python ends the thread
    (`pthread_exit` in `take_gil`), the unwind meets gloo's `noexcept` run loop, and the process
    dies in C++'s "terminate called without an active exception" (SIGABRT) after a run that
    succeeded. A barrier on each group first runs every collective still queued there (gloo's
    barrier waits for all prior work; a group a model still references is not freed, so destroying
    it does not wait); the pause lets the worker that ran the last one drop it while this thread
    holds no GIL. `drain=False` (after a failure: peers may never reach a barrier) only destroys."""
    import time

    if not (dist.is_available() and dist.is_initialized()):
        return
    rank = dist.get_rank()
    for group in list(dist.distributed_c10d._world.pg_map) if drain else []:  # creation order
        if rank in dist.get_process_group_ranks(group):
            dist.barrier(group=group)
    dist.destroy_process_group()
    time.sleep(WORKERS_DRAIN_S)


_started_groups: list = []  # the default group fullshard started (torch's registry may hold others)


def _close_at_exit(group) -> None:
    """At exit, the default group fullshard started is destroyed (`close_process_groups`), so a script
    that ends without `destroy_process_group()` exits cleanly. Registered with `atexit` at the
    first start, so it runs after handlers registered later (an async save's commit among them)."""
    import atexit

    if not _started_groups:
        atexit.register(_close_started_groups)
    _started_groups[:] = [group]


def _close_started_groups() -> None:
    import sys

    if getattr(sys, "last_value", None) is not None:
        return  # an uncaught exception: peers may be inside a collective this rank will never join
    if not _started_groups or not dist.is_initialized():
        return
    if dist.distributed_c10d._get_default_group() is not _started_groups[0]:
        return  # the script destroyed ours and started its own: it is the script's to close
    try:
        close_process_groups()
    except Exception:  # noqa: BLE001 - the script's outcome is decided; exit with it
        pass


def _restarted_workers_store(timeout: timedelta) -> dist.Store | None:
    """torchrun hands its workers the agent's own TCPStore and keeps that store over restarts of
    the workers, with nothing to tell one group of workers' keys from the last one's
    (pytorch#135712): a restarted rank can read a dead rank's gloo address or NCCL id and fail with
    a refused connection, or hang. Each group gets its own prefix, `group_key`'s."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"fullshard/workers_{group_key(shared, int(os.environ['WORLD_SIZE']), timeout)}",
                            shared)


def group_key(store: dist.Store, world: int, timeout: timedelta, poll_s: float = 0.02) -> int:
    """A number every rank of this group of workers agrees on and no earlier group had, read from a
    store that outlives the groups. Nothing torchrun tells the workers would do: its restart count
    goes up only on the node whose workers failed (the others restart theirs unchanged), and the
    rendezvous round stays inside the agents. Counting arrivals (n-th group: counts n*world+1 ..)
    breaks once a rank of some group died before counting: every later group splits.

    The store's counter orders arrivals instead: every rank of a dead group counted (if at all)
    before any rank of this one started (torchrun stops a group before starting the next), so
    this group's counts are all above theirs. Each rank counts itself in, then confirms the
    counter's current value `m` under `confirm/m`; a confirmation of `m` can come only from a rank
    that counted at or below `m` in this group, so `world` of them mean every rank has counted and
    `m` is the last count: the same number for every rank. One read and at most one add a poll."""
    import time

    store.add("fullshard/arrivals", 1)
    deadline, confirmed = time.monotonic() + timeout.total_seconds(), None
    while True:
        last = store.add("fullshard/arrivals", 0)
        if last != confirmed:
            confirmed = last
            if store.add(f"fullshard/confirm_{last}", 1) >= world:
                return last
        elif store.add(f"fullshard/confirm_{last}", 0) >= world:
            return last
        if time.monotonic() > deadline:
            raise FullshardError(f"{world} workers did not all start within {timeout.total_seconds():.0f} s "
                                 f"(torchrun's store counted {last} arrivals)")
        if STOP_ASKED.is_set():  # torchrun stopping this group (another worker failed): nothing to wait for
            raise FullshardError("stopped while waiting for the other workers to start")
        time.sleep(poll_s)


# set by a stop signal (`train.stop`): a wait for other workers to start gives up at once
STOP_ASKED = threading.Event()


def _check_devices_per_node(device_type: str) -> None:
    """Rank k of a node binds device k: a node with fewer devices than ranks cannot run."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", get_local_rank() + 1))
    devices = torch.accelerator.device_count()
    if max(ranks, get_local_rank() + 1) > devices:
        raise ConfigError(f"{ranks} processes per node but this node has {devices} {device_type} device(s): "
                          f"start at most {devices} per node (--nproc, torchrun --nproc_per_node)")


def find_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ParallelDims:
    """The layout of the world: `pp x dp_replicate x dp_shard x cp x tp` ranks, the fastest-linked dims last.

    dp_replicate > 1 gives HSDP (parameters sharded inside a group, replicated across groups,
    gradients reduce-scattered then all-reduced). `tp` splits each layer's weights (tensor
    parallel); `cp` splits each sequence (context parallel). FSDP shards over `dp_shard x cp`
    flattened: cp ranks hold the same weights, so they may as well share the shards.
    `dp_shard=-1` takes whatever the world leaves. `pp` (outermost: its links carry only
    activations, once per micro-batch) cuts the model into stages, each sharded over its own
    `dp_replicate x dp_shard x cp x tp` sub-mesh.

    `ep` splits the FSDP ranks a second way for MoE experts only: each group of `ep` neighbouring
    ranks holds every expert once (each rank `num_experts / ep` whole experts), and FSDP shards
    those over the `efsdp = dp_shard x cp / ep` ranks holding the same experts. Dense parameters
    keep the layout they have without ep.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    world_size: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                label = self._label("pp", "dp_replicate", "cp", "tp")
                raise ConfigError(f"world size {self.world_size} is not divisible by {label}")
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            label = self._label("pp", "dp_replicate", "dp_shard", "cp", "tp")
            raise ConfigError(f"{label}, but the world size is {self.world_size}")
        self._check_ep()

    def _check_ep(self) -> None:
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"ep_size must be an int >= 1, got {self.ep!r}")
        if self.ep == 1:
            return
        if self.fsdp_shard_size % self.ep:
            raise ConfigError(f"ep_size={self.ep} does not divide the data-parallel shard size "
                              f"{self._label('dp_shard', 'cp')} (experts are split inside the FSDP ranks)")
        others = [f"{n}={getattr(self, n)}" for n in ("pp", "dp_replicate", "cp", "tp") if getattr(self, n) > 1]
        if others:
            raise ConfigError(f"ep_size={self.ep} does not compose with {', '.join(others)} yet; "
                              "use ep with dp_shard alone")

    def _label(self, *names: str) -> str:
        """"dp_replicate=3 x tp=2 = 6": the dims named (cp and tp only when used) and their product."""
        used = [n for n in names if n not in ("cp", "tp", "pp") or getattr(self, n) > 1]
        product = math.prod(getattr(self, n) for n in used)
        return " x ".join(f"{n}={getattr(self, n)}" for n in used) + (f" = {product}" if len(used) > 1 else "")

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks see different data (cp and tp ranks of one group see the same batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard_size(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """How many ranks hold the same experts (FSDP shards the experts over them)."""
        return self.fsdp_shard_size // self.ep

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each dim (row-major over pp, dp_replicate, dp_shard, cp, tp), and its dp rank."""
        pp, rank = divmod(rank, self.world_size // self.pp)
        tp, rest = rank % self.tp, rank // self.tp
        cp, dp = rest % self.cp, rest // self.cp
        return {"dp": dp, "dp_replicate": dp // self.dp_shard, "dp_shard": dp % self.dp_shard, "cp": cp, "tp": tp,
                "pp": pp}

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The mesh `fully_shard` shards over (1-D, or 2-D for HSDP)."""
        return self.build_meshes(device_type).fsdp

    def build_meshes(self, device_type: str | None = None) -> "Meshes":
        """The world mesh and the sub-meshes each parallelism uses.

        At tp = cp = pp = 1 the world mesh is the FSDP mesh itself, exactly as before tp and cp existed.
        Slicing a dim out of the world mesh gives this rank's part of it, so under pp every
        sub-mesh (fsdp, tp, cp) is this rank's stage's.
        """
        device_type = device_type or detect_device_type()
        if self.ep > 1:
            # ep is the fast dim: rank = efsdp_rank * ep + ep_rank, so the flattened FSDP mesh lists
            # the ranks in the same order as without ep and dense shards do not move
            world = init_device_mesh(device_type, (self.efsdp, self.ep), mesh_dim_names=("efsdp", "ep"))
            fsdp = world["efsdp", "ep"]._flatten("dp_shard")
            return Meshes(world=world, fsdp=fsdp, ep=world["ep"], efsdp=world["efsdp"])
        if self.tp == 1 and self.cp == 1 and self.pp == 1:
            if self.hsdp:
                mesh = init_device_mesh(
                    device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
                )
            else:
                mesh = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
            return Meshes(world=mesh, fsdp=mesh)
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}
        names = tuple(n for n, size in sizes.items() if size > 1 or n == "dp_shard")
        world = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        # the flattened mesh is kept as returned (torch deprecates slicing it back out of the root),
        # except for HSDP, whose 2-D (dp_replicate, dp_shard_cp) mesh only the root can give
        shard = world["dp_shard", "cp"]._flatten("dp_shard_cp") if self.cp > 1 else world["dp_shard"]
        fsdp = world["dp_replicate", shard.mesh_dim_names[0]] if self.hsdp else shard
        return Meshes(
            world=world,
            fsdp=fsdp,
            tp=world["tp"] if self.tp > 1 else None,
            cp=world["cp"] if self.cp > 1 else None,
            pp=world["pp"] if self.pp > 1 else None,
        )


@dataclass
class Meshes:
    """The world mesh and its parts: `fsdp` (what `fully_shard` shards over), `tp`, `cp` and `pp` (None at size 1),
    `ep` (the ranks that split the experts) and `efsdp` (the ranks that shard the same experts), None without ep."""

    world: DeviceMesh
    fsdp: DeviceMesh
    tp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    pp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None


def build_mesh(dp_replicate: int = 1, dp_shard: int = -1, device_type: str | None = None) -> DeviceMesh:
    """The data-parallel mesh for the running world (starting the process group if needed)."""
    init_distributed(device_type)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=get_world_size())
    return dims.build_mesh(device_type)


def all_gather_slots(buffer: torch.Tensor, slot: int, group=None) -> None:
    """Every rank's `slot` bytes of `buffer` (rank r's at `r * slot`) in place on every rank: one
    `all_gather_into_tensor`, except on gloo, whose all-gather moves bytes several times slower than
    its broadcast (measured here: 64 MiB over 2 CPU ranks, 0.33 s against 0.05 s for one broadcast
    per rank), so there each rank's slot is broadcast from it, all in flight together."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if "gloo" not in str(dist.get_backend(group)) or buffer.device.type != "cpu":
        dist.all_gather_into_tensor(buffer, buffer[rank * slot:(rank + 1) * slot], group=group)
        return
    works = [dist.broadcast(buffer[r * slot:(r + 1) * slot], src=dist.get_global_rank(group, r) if group else r,
                            group=group, async_op=True) for r in range(world)]
    for work in works:
        work.wait()


def gather_to_first(parts: dict[int, list[torch.Tensor]], group=None) -> list:
    """Other ranks' parts into the first rank, nothing to anyone else: on the first rank `parts` maps
    each sending rank to the tensors its parts land in, in order; on the others it holds this rank's
    own parts, in the same order. A message per part, all in flight together (gloo's `gather`
    copies, several times slower, and needs one size for all); returns the works to wait for."""
    if not any(t.numel() for ts in parts.values() for t in ts):  # also: one process, no group
        return []
    rank = dist.get_rank(group)
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    if rank == 0:
        return [dist.irecv(t, src=global_rank(r), group=group) for r, ts in parts.items() if r for t in ts if t.numel()]
    return [dist.isend(t, dst=global_rank(0), group=group) for t in parts.get(rank, []) if t.numel()]


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh that parameters are sharded over (the last dim of an HSDP mesh)."""
    return mesh[mesh.mesh_dim_names[-1]] if mesh.ndim > 1 else mesh


class agreed:
    """Run a block on every rank; if it raised on any rank, raise on every rank, so no rank is left
    waiting in a later collective for one that failed.

        with agreed(LoadError, "reading checkpoint 'x'"):
            ...

    The error every rank raises has the messages of all failing ranks (identical ones grouped,
    each labelled with its ranks) and keeps the failing rank's own error type when that is an
    `error_type` (a `PlanError` stays a `PlanError`); any other exception becomes `error_type`,
    its message prefixed with `context` and its type name. Every rank must enter the block.
    """

    def __init__(self, error_type: type[Exception] = RuntimeError, context: str = "") -> None:
        self.error_type, self.context = error_type, context

    def __enter__(self) -> "agreed":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, (Exception, CheckpointException)):
            return False  # KeyboardInterrupt, SystemExit: not ours to agree on
        failure = None
        if exc is not None:
            if isinstance(exc, FullshardError) and isinstance(exc, self.error_type):
                failure = (str(exc), type(exc))  # already names what is wrong
            else:
                prefix = f"{self.context}: " if self.context else ""
                cls = type(exc) if isinstance(exc, self.error_type) else self.error_type
                failure = (f"{prefix}{type(exc).__name__}: {exc}", cls)
        raise_if_any_failed(failure, self.error_type)  # raises on every rank when any failed
        return False


def raise_if_any_failed(failure: tuple[str, type] | None, error_type: type[Exception] = RuntimeError) -> None:
    """The collective behind `agreed`: each rank passes None or (message, error class)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        failures = [failure]
    else:
        # one small all-reduce on the common path; the messages are gathered only when a rank failed
        cpu_ok = "gloo" in str(dist.get_backend())  # a process group started elsewhere may be device-only
        device = "cpu" if cpu_ok else current_device()
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    ranks_by_message: dict[str, list[int]] = {}
    cls = None
    for rank, item in enumerate(failures):
        if item is not None:
            ranks_by_message.setdefault(item[0], []).append(rank)
            cls = cls or item[1]
    if not ranks_by_message:
        return
    if len(failures) == 1:
        message = next(iter(ranks_by_message))
    else:
        message = "; ".join(f"{_ranks_label(ranks)}: {msg}" for msg, ranks in ranks_by_message.items())
    cls = cls if isinstance(cls, type) and issubclass(cls, error_type) else error_type
    try:
        error = cls(message)
    except TypeError:  # an error class whose constructor wants more than a message
        error = error_type(message)
    raise error from None


def all_ranks_agree_ok(ok: bool, message: str = "", error_type: type[Exception] = RuntimeError) -> None:
    """`agreed` for code that already caught its error: each rank says whether it succeeded."""
    raise_if_any_failed(None if ok else (message, error_type), error_type)


def run_agreed(fn, on_rank: int | None = None, error_type: type[Exception] = RuntimeError):
    """Run `fn` on every rank (or only `on_rank`) inside `agreed`; returns its result on the ranks that ran it."""
    result = None
    with agreed(error_type):
        if on_rank is None or get_rank() == on_rank:
            result = fn()
    return result


def broadcast_from_rank0(value):
    if not dist.is_initialized() or get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _ranks_label(ranks: list[int]) -> str:
    if ranks == list(range(get_world_size())):
        return "all ranks"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
