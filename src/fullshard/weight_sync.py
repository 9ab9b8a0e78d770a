"""Weights from the sharded trainer to inference engines in other processes, a bucket at a time.

An RL loop trains the actor with FSDP on some ranks and samples rollouts with an inference engine
(vLLM, SGLang, a plain transformers model) in other processes. After every optimizer step the new
weights go from the trainer to every engine:

    trainer, every rank:   sync = WeightSync.trainer(host, port, num_engines)   ...   sync.push(model)
    engine e:              sync = WeightSync.engine(host, port, e, num_engines) ...   sync.pull(llm.load_weights)

The two sides meet over a TCPStore hosted by trainer rank 0 and talk in a process group of their
own (gloo on CPU, NCCL on CUDA) made of trainer rank 0 and the engines, built beside torch's
default group, so the trainer's world size does not matter. Every trainer rank iterates
`buckets_to_first` (`hf_weight_buckets`' tensors, put together on rank 0 alone: the others send it
their rows); rank 0 lays each bucket out in one flat buffer and broadcasts it as it lies, with a
header (names, shapes, dtypes) and per-tensor checksums, while the next bucket is put together.
An engine checks the checksums and hands the bucket's `(name, tensor)` pairs to `load_weights`,
vLLM's `load_weights(iterable)` signature. Anything that goes wrong (a name the engine refuses, a
wrong shape, a checksum, a dead engine) is one `WeightSyncError` naming the tensor or engine on
every trainer rank and every engine; nothing waits longer than `timeout_s`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .distributed import all_ranks_agree_ok, current_device, gather_to_first, get_rank, get_world_size
from .errors import WeightSyncError
from .hf.stream import (  # the stream's plan and its regions, which the first-rank sender shares
    DEFAULT_BUCKET_BYTES,
    Box,
    StreamUnit,
    aligned,
    held_region,
    kept_buffer,
    output_size,
    shape_numel,
    stream_device,
    stream_plan,
    unit_outputs,
)
from .tensors import local_tensor, named_state_tensors

BUCKET, END, ABORT = 1, 2, 3  # what a control message announces
ALIGN = 16  # every tensor starts 16-byte aligned in a bucket's buffer, so it can be viewed in its dtype
STATUS_BYTES = 4096  # an engine's verdict on a push: empty, or its error message
PREFIX = "fullshard/weight_sync"
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


@dataclass
class SyncReport:
    """One push or pull: the push's number (1, 2, ...), tensors and bytes sent, seconds taken."""

    version: int
    tensors: int
    bytes: int
    seconds: float


# ------------------------------------------------------------------------------------- the wire format


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _words(offset: int, nbytes: int) -> torch.dtype:
    """The widest integer words that tile a tensor's bytes at that offset (int64 nearly always)."""
    return next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if offset % d.itemsize == 0 and nbytes % d.itemsize == 0)


def checksums(payload: torch.Tensor, header: dict) -> torch.Tensor:
    """Each tensor's bytes summed as integer words (int64, wrapping): one number per tensor, so a
    mismatch names the tensor; the sum runs at memory speed, on the buffer's device."""
    sums = [payload[offset:offset + nbytes].view(_words(offset, nbytes)).sum(dtype=torch.int64)
            for offset, nbytes in zip(header["offsets"], header["nbytes"])]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=payload.device)


def packed_bytes(pairs: list[tuple[str, torch.Tensor]]) -> int:
    """The payload's size when packed: every tensor's bytes, each padded to `ALIGN`."""
    return sum(_padded(t.numel() * t.element_size()) for _, t in pairs)


def lying_together(pairs: list[tuple[str, torch.Tensor]], device: torch.device
                   ) -> tuple[torch.Tensor, list[int]] | None:
    """Where the bucket's tensors already lie in one buffer (contiguous, not overlapping, on
    `device`: one tensor, or a bucket `hf_weights` laid out whole), that run of bytes, from an
    `ALIGN`-aligned start, and each tensor's offset in it: sent as it is, no packing copy."""
    tensors = [t.detach() for _, t in pairs]
    if not tensors or any(not t.is_contiguous() or t.device != device for t in tensors):
        return None
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    spans = [(t.data_ptr() - base, t.numel() * t.element_size()) for t in tensors]
    ordered = sorted(span for span in spans if span[1])
    if any(a + n > b for (a, n), (b, _) in zip(ordered, ordered[1:])):
        return None
    low = ordered[0][0] if ordered else 0
    low -= low % ALIGN
    high = max([a + n for a, n in ordered], default=low)
    payload = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, low, (high - low,))
    return payload, [max(a - low, 0) for a, _ in spans]


def pack_bucket(pairs: list[tuple[str, torch.Tensor]], device: torch.device,
                buffer: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """A bucket as (header, payload): the payload one flat byte buffer holding every tensor (where
    they lie already, `lying_together`; else each copied in, aligned, at the start of `buffer` when
    it is large enough), the header with names, shapes, dtypes and offsets. Its `checksums` go
    after it, summed while the payload is on its way."""
    header = {"names": [], "shapes": [], "dtypes": [], "offsets": [], "nbytes": []}
    together = lying_together(pairs, device)
    offset = 0
    for index, (name, tensor) in enumerate(pairs):
        nbytes = tensor.numel() * tensor.element_size()
        start = together[1][index] if together else offset
        for key, value in zip(
            header, (name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), start, nbytes)
        ):
            header[key].append(value)
        offset += _padded(nbytes)
    if together:
        payload = together[0]
    else:
        payload = buffer[:offset] if buffer is not None and buffer.numel() >= offset and buffer.device == device \
            else torch.empty(offset, dtype=torch.uint8, device=device)
        for (_, tensor), start, nbytes in zip(pairs, header["offsets"], header["nbytes"]):
            if nbytes:
                payload[start:start + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return header, payload


def unpack_bucket(header: dict, payload: torch.Tensor, sent: list[int]) -> list[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of a received bucket, views of `payload`, after checking every
    tensor's checksum against the `sent` ones (a mismatch names the tensor)."""
    for name, expected, found in zip(header["names"], sent, checksums(payload, header).tolist()):
        if expected != found:
            raise WeightSyncError(f"checksum mismatch for {name!r}: sent {expected}, received {found}")
    pairs = []
    for name, shape, dtype, offset, nbytes in zip(
        *(header[k] for k in ("names", "shapes", "dtypes", "offsets", "nbytes"))
    ):
        pairs.append((name, payload[offset:offset + nbytes].view(_DTYPES[dtype]).view(shape)))
    return pairs


def _tracked(pairs: list[tuple[str, torch.Tensor]], seen: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pairs:
        seen.append(name)
        yield name, tensor


def feed(load_weights: Callable[[Iterable], object], pairs: list[tuple[str, torch.Tensor]]) -> None:
    """`load_weights(pairs)`, its failure named by the pair it was consuming; a pair it never
    consumed is a name it did not take."""
    seen: list[str] = []
    try:
        load_weights(_tracked(pairs, seen))
    except Exception as err:  # noqa: BLE001 - turned into the named error every side raises
        at = f" at {seen[-1]!r}" if seen else ""
        raise WeightSyncError(f"load_weights failed{at}: {type(err).__name__}: {err}") from err
    if len(seen) < len(pairs):
        raise WeightSyncError(
            f"load_weights did not take {pairs[len(seen)][0]!r} (it stopped reading the weights there)"
        )


def weight_loader(model: nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]:
    """A `load_weights(iterable)` for a plain (unsharded) transformers model: copies each tensor
    into the parameter or persistent buffer of that HF name. An unknown name, another shape or
    another dtype is refused by name before anything of the call's tensors is copied."""
    targets = named_state_tensors(model)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        checked = []
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise WeightSyncError(f"{name!r} is not a parameter or buffer of {type(model).__name__}")
            if tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
                raise WeightSyncError(f"{name!r}: received {tuple(tensor.shape)} {tensor.dtype}, the model has "
                                      f"{tuple(target.shape)} {target.dtype}")
            checked.append((name, target, tensor))
        with torch.no_grad():
            for _, target, tensor in checked:
                target.copy_(tensor)
        return {name for name, _, _ in checked}

    return load_weights


# ------------------------------------------------------------------------------------- the connection


# ------------------------------------------------------- the stream to the first trainer rank alone

SEND_ALIGN = ALIGN  # each whole tensor of a bucket's buffer starts aligned, as the payload wants


def _own_pieces(bucket: list[StreamUnit], rank: int) -> list[tuple[int, int, Box]]:
    """The regions `rank` sends of the bucket, in order: (unit, input, box)."""
    return [(u, index, box) for u, unit in enumerate(bucket) for index, box in unit.pieces.get(rank, [])]


def _whole_rows(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether the region is whole rows of its tensor: one run of its bytes."""
    return len(shape) > 0 and tuple(box[1][1:]) == tuple(shape[1:])


def _messages(
    bucket: list[StreamUnit], rank: int
) -> tuple[list[tuple[int, int, Box]], list[tuple[int, int, Box, int]]]:
    """What `rank` sends the first rank of a bucket: each region that is whole rows of its tensor
    (FSDP's and EP's) a message of its own, which lands straight in its place; the others (TP's
    columns) packed into one more message, each at its aligned byte position in it."""
    direct, packed, position = [], [], 0
    for u, index, box in _own_pieces(bucket, rank):
        item = bucket[u].inputs[index]
        if _whole_rows(box, item.shape):
            direct.append((u, index, box))
        else:
            packed.append((u, index, box, position))
            position += aligned(_region_bytes(bucket, u, index, box))
    return direct, packed


def _region_bytes(bucket: list[StreamUnit], u: int, index: int, box: Box) -> int:
    return shape_numel(box[1]) * bucket[u].inputs[index].dtype.itemsize


def _packed_span(bucket: list[StreamUnit], packed: list[tuple[int, int, Box, int]]) -> int:
    """The bytes of a rank's packed message (`_messages`): up to the end of its last region."""
    if not packed:
        return 0
    u, index, box, at = packed[-1]
    return at + _region_bytes(bucket, u, index, box)


def _send_to_first(bucket: list[StreamUnit], state: dict, device: torch.device, buffers: dict) -> None:
    """A rank other than the first: its regions of the bucket to the first rank (`_messages`), each
    sent from the shard itself where its bytes already are the message, else cast or packed into a
    buffer kept in `buffers`."""
    direct, packed = _messages(bucket, get_rank())
    local = lambda u, i: local_tensor(state[bucket[u].inputs[i].key]).detach()  # noqa: E731
    as_is = lambda u, i: (local(u, i).dtype == bucket[u].inputs[i].dtype and local(u, i).is_contiguous()  # noqa: E731
                          and local(u, i).device == device)
    placed, position = [], 0  # where the direct regions that need a copy (a cast) go in `kept`
    for u, index, box in direct:
        if not as_is(u, index):
            placed.append((u, index, box, position))
            position += aligned(_region_bytes(bucket, u, index, box))
    placed += [(u, index, box, position + at) for u, index, box, at in packed]
    need = position + aligned(_packed_span(bucket, packed))
    kept = kept_buffer(buffers, "send", need, device) if need else None
    for u, index, box, at in placed:
        size = _region_bytes(bucket, u, index, box)
        kept[at:at + size].view(bucket[u].inputs[index].dtype).view(box[1]).copy_(local(u, index))
    copied = {(u, index): at for u, index, _, at in placed}
    parts = []
    for u, index, box in direct:
        at = copied.get((u, index))
        parts.append(local(u, index).reshape(-1).view(torch.uint8) if at is None
                     else kept[at:at + _region_bytes(bucket, u, index, box)])
    if packed:
        parts.append(kept[position:position + _packed_span(bucket, packed)])
    for work in gather_to_first({get_rank(): parts}):
        work.wait()


def _gather_to_first(bucket: list[StreamUnit], state: dict, out: Callable[[int], torch.Tensor],
                     buffers: dict) -> list[list[torch.Tensor]]:
    """The first rank: the bucket's whole inputs laid out in one byte buffer from `out(nbytes)` (each
    `SEND_ALIGN`-aligned, in order), made from its own shards and the other ranks' messages: runs
    of rows received straight into their place, packed regions into a staging buffer kept in
    `buffers` (only layouts with other regions than rows need it) and copied from there. Its own
    regions are copied while the others arrive."""
    starts, total = [], 0
    for unit in bucket:
        for item in unit.inputs:
            starts.append(total)
            total += item.nbytes + (-item.nbytes % SEND_ALIGN)
    flat = out(total)
    at = iter(starts)
    wholes = [[flat[start:start + item.nbytes].view(item.dtype).view(item.shape)
               for item, start in zip(unit.inputs, at)] for unit in bucket]
    plans = {r: _messages(bucket, r) for r in range(1, get_world_size())}
    need = {r: aligned(_packed_span(bucket, packed)) for r, (_, packed) in plans.items()}
    kept = kept_buffer(buffers, "staging", sum(need.values()), flat.device) if sum(need.values()) else None
    targets, staged, position = {}, {}, 0
    for r, (direct, packed) in plans.items():
        targets[r] = []
        for u, index, box in direct:
            whole = wholes[u][index]
            row = whole[0].numel() * whole.element_size()
            start = box[0][0] * row
            targets[r].append(whole.view(-1).view(torch.uint8)[start:start + _region_bytes(bucket, u, index, box)])
        if packed:
            staged[r] = kept[position:position + need[r]]
            targets[r].append(staged[r][:_packed_span(bucket, packed)])
            position += need[r]
    works = gather_to_first(targets)
    for u, index, box in _own_pieces(bucket, 0):
        held_region(wholes[u][index], box).copy_(local_tensor(state[bucket[u].inputs[index].key]).detach())
    for work in works:
        work.wait()
    for r, message in staged.items():
        for u, index, box, at in plans[r][1]:
            item = bucket[u].inputs[index]
            size = _region_bytes(bucket, u, index, box)
            held_region(wholes[u][index], box).copy_(message[at:at + size].view(item.dtype).view(box[1]))
    return wholes


@dataclass
class SentBucket:
    """A bucket of the stream to the first rank: its `(hf_name, tensor)` pairs there (none elsewhere),
    how many tensors and bytes it has."""

    pairs: list[tuple[str, torch.Tensor]]
    tensors: int
    nbytes: int


def buckets_to_first(model: torch.nn.Module, out: Callable[[int], torch.Tensor], *,
                     dtype: torch.dtype | str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     lora: str = "merge") -> Iterator[SentBucket]:
    """`hf_weight_buckets` for a sender that is the first rank alone (`WeightSync`): the other ranks
    send it their regions (one message each per bucket) and keep nothing; the first rank lays each
    bucket's whole tensors out in the byte buffer `out(nbytes)` gives (the caller's, reused: it
    must be done with a bucket's buffer before handing it out again), so a bucket of plain tensors
    is one run of bytes, ready to send as it is. Every rank iterates it in step."""
    state, buckets = stream_plan(model, dtype, bucket_bytes, lora)
    device, buffers, first = stream_device(), {}, get_rank() == 0
    for bucket in buckets:
        tensors = nbytes = 0
        for unit in bucket:
            count, size = output_size(unit)
            tensors, nbytes = tensors + count, nbytes + size
        if not first:
            _send_to_first(bucket, state, device, buffers)
            yield SentBucket([], tensors, nbytes)
            continue
        wholes = _gather_to_first(bucket, state, out, buffers)
        pairs = [pair for unit, inputs in zip(bucket, wholes) for pair in unit_outputs(unit, inputs)]
        del wholes
        yield SentBucket(pairs, tensors, nbytes)
        del pairs


def _backend(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def _group(store, rank: int, size: int, device: torch.device, timeout: timedelta):
    """The sync's own process group, built directly (not `init_process_group`), so it lives beside
    the default group, or in an engine process that has none."""
    prefixed = dist.PrefixStore(f"{PREFIX}/group", store)
    if device.type == "cpu":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, size, options)


def _status(message: str, device: torch.device) -> torch.Tensor:
    raw = message.encode()[:STATUS_BYTES]
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    status[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else status[:0]
    return status.to(device)


def _message(status: torch.Tensor) -> str:
    raw = bytes(status.cpu().tolist())
    return raw.rstrip(b"\0").decode(errors="replace")


class WeightSync:
    """Build with `WeightSync.trainer` (every trainer rank) or `WeightSync.engine` (each engine process)."""

    def __init__(self, role: str, store, group, rank: int, num_engines: int, device: torch.device, timeout_s: float):
        self.role, self.store, self.group, self.rank = role, store, group, rank
        self.num_engines, self.device, self.timeout_s = num_engines, device, timeout_s
        self.version = 0
        self.broken = ""  # why the connection cannot be used any more
        self.buffers: dict[str, torch.Tensor] = {}  # kept: rank 0's bucket layouts and packing, an engine's receiving
        self.turn, self.filling, self.bucket_bytes = 0, "", 0
        self.in_flight: tuple[list, str | None] = ([], None)  # the works of the bucket being sent, its buffer
        self.failure = ""

    # -------------------------------------------------------------- rendezvous

    @classmethod
    def trainer(cls, host: str, port: int, num_engines: int, timeout_s: float = 60) -> "WeightSync":
        """Call on every trainer rank (a collective of the default group). Rank 0 hosts the
        rendezvous at host:port and joins the engines' group; the others only gather buckets."""
        if num_engines < 1:
            raise WeightSyncError(f"num_engines must be >= 1, got {num_engines}")
        device = current_device()
        store = group = None
        message = ""
        if get_rank() == 0:
            try:
                store, group = cls._host(host, port, num_engines, device, timeout_s)
            except Exception as err:  # noqa: BLE001 - every trainer rank raises it
                message = f"weight sync rendezvous at {host}:{port}: {type(err).__name__}: {err}"
        all_ranks_agree_ok(not message, message, WeightSyncError)
        return cls("trainer", store, group, get_rank(), num_engines, device, timeout_s)

    @staticmethod
    def _host(host: str, port: int, num_engines: int, device: torch.device, timeout_s: float):
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set(f"{PREFIX}/backend", _backend(device))
        keys = [f"{PREFIX}/engine/{e}" for e in range(num_engines)]
        try:
            store.wait(keys, timeout)
        except Exception:
            missing = [e for e, key in enumerate(keys) if not store.check([key])]
            store.set(f"{PREFIX}/verdict", f"engines {missing} never joined")
            raise WeightSyncError(f"engines {missing} of {num_engines} did not join within {timeout_s:g} s") from None
        counts = {e: int(store.get(key)) for e, key in enumerate(keys)}
        wrong = {e: n for e, n in counts.items() if n != num_engines}
        verdict = f"the trainer expects {num_engines} engines, engines {wrong} said otherwise" if wrong else "ok"
        store.set(f"{PREFIX}/verdict", verdict)
        if wrong:
            raise WeightSyncError(verdict)
        return store, _group(store, 0, num_engines + 1, device, timeout)

    @classmethod
    def engine(cls, host: str, port: int, engine_rank: int, num_engines: int, timeout_s: float = 60,
               device: torch.device | str | None = None) -> "WeightSync":
        """Call in each engine process (no default process group needed): join the trainer's
        rendezvous as engine `engine_rank` of `num_engines`."""
        if not 0 <= engine_rank < num_engines:
            raise WeightSyncError(f"engine_rank {engine_rank} is not in 0..{num_engines - 1}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        backend = store.get(f"{PREFIX}/backend").decode()
        if backend != _backend(device):
            raise WeightSyncError(f"the trainer syncs over {backend}, engine {engine_rank} is on {device} "
                                  f"({_backend(device)}): give both the same kind of device")
        store.set(f"{PREFIX}/engine/{engine_rank}", str(num_engines))
        verdict = store.get(f"{PREFIX}/verdict").decode()
        if verdict != "ok":
            raise WeightSyncError(f"engine {engine_rank}: the trainer refused the rendezvous: {verdict}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = _group(store, engine_rank + 1, num_engines + 1, device, timeout)
        return cls("engine", store, group, engine_rank + 1, num_engines, device, timeout_s)

    def close(self) -> None:
        """Drop the group, the store (the trainer's rank 0 hosts it: close it last) and the buffer."""
        self.group = self.store = None
        self.buffers = {}
        self.broken = self.broken or "closed"

    # -------------------------------------------------------------- collectives of the sync's group

    def _broadcast(self, tensor: torch.Tensor):
        return self.group.broadcast([tensor], dist.BroadcastOptions())

    def _control(self, kind: int, header_len: int = 0, payload_len: int = 0) -> list:
        control = torch.tensor([kind, header_len, payload_len, self.version], dtype=torch.int64, device=self.device)
        return [(self._broadcast(control), control)]

    def _verdicts(self, message: str) -> list[str]:
        """Every member's error message (empty when fine), gathered in one collective."""
        outputs = [
            torch.empty(STATUS_BYTES, dtype=torch.uint8, device=self.device) for _ in range(self.num_engines + 1)
        ]
        self.group.allgather([outputs], [_status(message, self.device)]).wait()
        return [_message(status) for status in outputs]

    # -------------------------------------------------------------- trainer side

    def push(self, model: nn.Module, *, dtype: torch.dtype | str | None = None, bucket_bytes: int = 256 * 2**20,
             lora: str = "merge") -> SyncReport:
        """Send every weight of `model` (as `fullshard.hf_weight_buckets` yields them) to every
        engine; call on every trainer rank in step. Raises `WeightSyncError` on every trainer rank
        when any engine failed (naming the tensor), died, or did not come to `pull` in `timeout_s`."""
        if self.role != "trainer":
            raise WeightSyncError("push is the trainer's side; an engine calls pull")
        started = time.perf_counter()
        self.version += 1
        message = self.broken and f"the weight sync is broken since an earlier push: {self.broken}"
        if self.rank == 0 and not message:
            message = self._announce()
        all_ranks_agree_ok(not message, message, WeightSyncError)
        self.bucket_bytes = bucket_bytes
        buckets = buckets_to_first(model, self._bucket_buffer, dtype=dtype, bucket_bytes=bucket_bytes, lora=lora)
        try:
            tensors, nbytes, message = self._send(buckets) if self.rank == 0 else self._follow(buckets)
        finally:
            if self.device.type != "cpu":  # back to the caching allocator, for training to reuse
                self.buffers = {}
        if message:
            self.broken = message
        all_ranks_agree_ok(not message, message, WeightSyncError)
        return SyncReport(self.version, tensors, nbytes, time.perf_counter() - started)

    def _announce(self) -> str:
        """Rank 0 tells the engines push `version` starts and waits for each to come to `pull`."""
        self.store.set(f"{PREFIX}/push", str(self.version))
        keys = [f"{PREFIX}/ready/{self.version}/{e}" for e in range(self.num_engines)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store says timeout or a lost connection alike
            missing = [e for e, key in enumerate(keys) if not self.store.check([key])]
            self.broken = f"engines {missing} did not come to pull push {self.version} within {self.timeout_s:g} s"
            return f"weight sync push {self.version}: {self.broken} (dead, or not calling pull)"
        return ""

    @staticmethod
    def _follow(buckets) -> tuple[int, int, str]:
        """A trainer rank other than 0 sends its parts of each bucket to rank 0, and nothing else."""
        tensors = nbytes = 0
        for bucket in buckets:
            tensors, nbytes = tensors + bucket.tensors, nbytes + bucket.nbytes
        return tensors, nbytes, ""

    def _bucket_buffer(self, nbytes: int) -> torch.Tensor:
        """Where rank 0 lays out the next bucket: two buffers for buckets up to `bucket_bytes`, taken
        in turn (one is being sent while the next bucket is made in the other), a third for a bucket
        bigger than that (a lone large tensor), so at most 2 buckets + the largest tensor. A buffer
        still being sent is waited for first. Kept between pushes on the CPU (a fresh page costs a
        fault), handed back to the caching allocator after each push on an accelerator."""
        if nbytes > self.bucket_bytes:
            which = "big"
        else:
            self.turn = 1 - self.turn
            which = f"bucket{self.turn}"
        if self.in_flight[1] == which:
            self._settle()
        self.filling = which
        capacity = 0 if which == "big" else self.bucket_bytes  # made once, not grown bucket by bucket
        return kept_buffer(self.buffers, which, nbytes, self.device, capacity)

    def _settle(self) -> None:
        """Wait for the bucket in flight; a failure is kept, to be reported on every trainer rank."""
        works, self.in_flight = self.in_flight[0], ([], None)
        error = "" if self.failure else self._try(lambda: self._wait(works))
        self.failure = self.failure or (error and f"sending to the engines: {error}")

    def _send(self, buckets) -> tuple[int, int, str]:
        """Rank 0: each bucket broadcast while the next one is gathered (at most one in flight). A
        failed broadcast stops the sending but not the gathering, so the other trainer ranks
        finish their part and all raise together."""
        tensors = nbytes = 0
        self.failure, self.in_flight = "", ([], None)
        try:
            for bucket in buckets:
                tensors, nbytes = tensors + bucket.tensors, nbytes + bucket.nbytes
                self._settle()
                if not self.failure:
                    try:
                        self.in_flight = (self._send_bucket(bucket.pairs), self.filling)
                    except Exception as err:  # noqa: BLE001 - reported on every trainer rank
                        self.failure = f"sending to the engines: {type(err).__name__}: {err}"
                del bucket
        except BaseException:
            if not self.failure:  # the gather itself failed on every rank: stop the engines waiting for buckets
                self._settle()
                self._try(lambda: self._wait(self._control(ABORT)))
            raise
        self._settle()
        failure = self.failure or self._try(lambda: self._wait(self._control(END, tensors, nbytes)))
        if failure:
            return tensors, nbytes, f"weight sync push {self.version}: {failure}"
        engines = self._try(lambda: self._verdicts(""))
        if isinstance(engines, str):
            return tensors, nbytes, f"weight sync push {self.version}: {engines}"
        errors = [f"engine {e - 1}: {text}" for e, text in enumerate(engines) if text]
        return tensors, nbytes, (f"weight sync push {self.version}: " + "; ".join(errors)) if errors else ""

    def _send_bucket(self, pairs: list[tuple[str, torch.Tensor]]) -> list:
        """One bucket to the engines: control, header, payload (its tensors where they lie when they
        lie together, else packed), checksums: four broadcasts in flight."""
        packing = None if lying_together(pairs, self.device) else kept_buffer(
            self.buffers, "packing", packed_bytes(pairs), self.device)
        header, payload = pack_bucket(pairs, self.device, packing)
        raw = json.dumps(header).encode()
        header_tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        works = [*self._control(BUCKET, len(raw), payload.numel()),
                 (self._broadcast(header_tensor), header_tensor), (self._broadcast(payload), payload)]
        sums = checksums(payload, header)  # while the payload is on its way
        return [*works, (self._broadcast(sums), sums)]

    @staticmethod
    def _wait(works: list) -> str:
        for work, _ in works:
            work.wait()
        return ""

    def _try(self, fn):
        """`fn()`, or the error it raised as a message (the connection is then broken)."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001
            return f"{type(err).__name__}: {err}"

    # -------------------------------------------------------------- engine side

    def pull(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
             wait_s: float | None = None) -> SyncReport:
        """Wait (up to `wait_s`, default without limit) for the trainer's next push and hand each
        bucket's `(name, tensor)` pairs to `load_weights`. Raises `WeightSyncError` naming the
        tensor when this or another engine's `load_weights` refused one, or a checksum failed."""
        if self.role != "engine":
            raise WeightSyncError("pull is an engine's side; the trainer calls push")
        if self.broken:
            raise WeightSyncError(f"the weight sync is broken since an earlier pull: {self.broken}")
        self.version += 1
        self.store.wait([f"{PREFIX}/push"], timedelta(seconds=wait_s if wait_s is not None else 10**8))
        self._wait_for_push(wait_s)
        self.store.set(f"{PREFIX}/ready/{self.version}/{self.rank - 1}", "1")
        started = time.perf_counter()
        try:
            tensors, nbytes, mine = self._receive(load_weights)
            verdicts = self._verdicts(mine)
        except WeightSyncError as err:
            self.broken = str(err)
            raise
        except Exception as err:  # noqa: BLE001 - a lost trainer or a timeout
            self.broken = f"{type(err).__name__}: {err}"
            raise WeightSyncError(f"engine {self.rank - 1}, push {self.version}: {self.broken}") from err
        errors = [f"engine {e - 1}: {text}" for e, text in enumerate(verdicts) if text]
        if errors:
            self.broken = "; ".join(errors)
            raise WeightSyncError(f"weight sync push {self.version}: {self.broken}")
        return SyncReport(self.version, tensors, nbytes, time.perf_counter() - started)

    def _wait_for_push(self, wait_s: float | None) -> None:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while int(self.store.get(f"{PREFIX}/push")) < self.version:
            if deadline is not None and time.monotonic() > deadline:
                raise WeightSyncError(f"engine {self.rank - 1}: no push {self.version} within {wait_s:g} s")
            time.sleep(0.01)

    def _receive(self, load_weights) -> tuple[int, int, str]:
        """Every bucket until the end mark; after a failure the rest are received and dropped, so
        the trainer's broadcasts complete, and the failure is this engine's verdict."""
        tensors = nbytes = 0
        failure = ""
        while True:
            control = torch.empty(4, dtype=torch.int64, device=self.device)
            self._broadcast(control).wait()
            kind, header_len, payload_len, version = control.tolist()
            if version != self.version:
                raise WeightSyncError(
                    f"engine {self.rank - 1} expected push {self.version}, the trainer sent {version}"
                )
            if kind == ABORT:
                raise WeightSyncError(
                    f"engine {self.rank - 1}: the trainer aborted push {self.version} (its gather failed)"
                )
            if kind == END:
                if not failure and (header_len, payload_len) != (tensors, nbytes):
                    failure = (
                        f"received {tensors} tensors / {nbytes} bytes, the trainer sent {header_len} / {payload_len}"
                    )
                return tensors, nbytes, failure
            header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
            payload = kept_buffer(self.buffers, "receiving", payload_len, self.device)
            self._broadcast(header).wait()
            header = json.loads(bytes(header.cpu().numpy()))
            sent = torch.empty(len(header["names"]), dtype=torch.int64, device=self.device)
            self._broadcast(payload).wait()
            self._broadcast(sent).wait()
            if failure:
                continue
            try:
                pairs = unpack_bucket(header, payload, sent.tolist())
                feed(load_weights, pairs)
                tensors += len(pairs)
                nbytes += sum(t.numel() * t.element_size() for _, t in pairs)
            except WeightSyncError as err:
                failure = str(err)
