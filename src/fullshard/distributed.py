"""Process groups, devices and the data-parallel mesh.

torch.distributed is the engine: torchrun (or any launcher that sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT) starts the ranks, and this module only picks the backend
that matches the device and builds the `DeviceMesh` that `fully_shard` shards over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
    Calling it again is a no-op that returns the bound device.
    """
    device_type = device_type or detect_device_type()
    if device_type not in BACKEND_FOR_DEVICE:
        raise ValueError(f"no backend known for device type {device_type!r}; known: {sorted(BACKEND_FOR_DEVICE)}")
    device = current_device(device_type)
    if device_type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if dist.is_initialized():
        return device
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    kwargs = {}
    if timeout_s is not None:
        from datetime import timedelta

        kwargs["timeout"] = timedelta(seconds=timeout_s)
    backend = BACKEND_FOR_DEVICE[device_type]
    if device_type != "cpu":
        # lets CPU-side collectives (object broadcasts, error agreement) run beside the device ones
        backend = f"cpu:gloo,{device_type}:{backend}"
    dist.init_process_group(backend=backend, **kwargs)
    return device


def find_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ParallelDims:
    """The data-parallel layout: `dp_replicate` groups of `dp_shard` ranks each.

    dp_replicate > 1 gives HSDP (parameters sharded inside a group, replicated across groups,
    gradients reduce-scattered then all-reduced). `dp_shard=-1` takes whatever the world leaves.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate={self.dp_replicate}"
                )
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} = "
                f"{self.dp_replicate * self.dp_shard}, but the world size is {self.world_size}"
            )

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks see different data."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        device_type = device_type or detect_device_type()
        if self.hsdp:
            return init_device_mesh(
                device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
            )
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))


def build_mesh(dp_replicate: int = 1, dp_shard: int = -1, device_type: str | None = None) -> DeviceMesh:
    """The data-parallel mesh for the running world (starting the process group if needed)."""
    init_distributed(device_type)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=get_world_size())
    return dims.build_mesh(device_type)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh that parameters are sharded over (the last dim of an HSDP mesh)."""
    return mesh["dp_shard"] if mesh.ndim > 1 else mesh


def all_ranks_agree_ok(ok: bool, message: str = "", error_type: type[Exception] = RuntimeError) -> None:
    """Raise `error_type` on every rank when any rank failed, so no rank is left waiting in a
    later collective.

    Each rank passes whether its own step succeeded and, if not, what went wrong; every rank
    then raises with the messages of all failing ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if not ok:
            raise error_type(message)
        return
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ok, message))
    ranks_by_message: dict[str, list[int]] = {}
    for rank, (rank_ok, msg) in enumerate(gathered):
        if not rank_ok:
            ranks_by_message.setdefault(msg, []).append(rank)
    if ranks_by_message:
        raise error_type("; ".join(f"{_ranks_label(ranks)}: {msg}" for msg, ranks in ranks_by_message.items()))


def _ranks_label(ranks: list[int]) -> str:
    if ranks == list(range(get_world_size())):
        return "all ranks"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
