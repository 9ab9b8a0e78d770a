"""Reading torch Distributed Checkpoints without ever running code from them.

torch's `FileSystemReader.read_metadata` unpickles `.metadata` without restriction and
`DefaultLoadPlanner.load_bytes` loads non-tensor entries with `weights_only=False`: a crafted
checkpoint runs arbitrary code the moment it is opened. Here metadata goes through an unpickler
that knows only the types DCP itself writes, byte entries through `weights_only=True`, and every
failure names the checkpoint file it came from. Loading and resuming both read through this module.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType

# (module, name) pairs DCP's own metadata pickles refer to; anything else is refused
_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused {module}.{name}: not a type DCP metadata holds")


def read_dcp_metadata(path: str | Path, error_type: type[Exception] = RuntimeError) -> Metadata:
    """The DCP `Metadata` of checkpoint directory `path`, read without running code from it."""
    file = Path(path) / ".metadata"
    if not file.is_file():
        raise error_type(f"{str(path)!r} is not a DCP checkpoint: no .metadata file")
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise error_type(f"DCP metadata {str(file)!r} was refused or is corrupt: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled file fails in many ways
        raise error_type(f"DCP metadata {str(file)!r} is corrupt or truncated: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise error_type(f"DCP metadata {str(file)!r} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `read_dcp_metadata` and whose read failures
    name the shard file (`__0_0.distcp`) they happened in."""

    def __init__(self, path: str | Path, error_type: type[Exception] = RuntimeError) -> None:
        super().__init__(str(path))
        self.error_type = error_type

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(self.path, self.error_type)
        metadata.storage_meta = metadata.storage_meta or _storage_meta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in by_file.items():
            try:
                rest = self._read_whole_chunks(Path(str(self.path)) / relative_path, items, planner)
                if rest:
                    super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
            except self.error_type:
                raise
            except Exception as exc:  # noqa: BLE001 - name the shard, whatever broke in it
                file = Path(str(self.path)) / relative_path
                raise self.error_type(f"checkpoint shard {str(file)!r} is corrupt or truncated: "
                                      f"{type(exc).__name__}: {exc}") from None
        return _done()

    def _read_whole_chunks(self, file: Path, items: list, planner) -> list:
        """Read each tensor item that is a whole stored chunk straight from the file into its
        destination; return the items left for DCP's reader.

        DCP's reader `torch.load`s every record into a new tensor and then copies it into the
        destination: two copies and a fresh allocation per tensor. Here the record is opened with
        `map_location="meta"` (its pickle only, `weights_only`: shape, strides, dtype and where
        its bytes sit) and the bytes are read into the destination's memory: one copy. Byte
        entries, parts of a chunk (loading at another world size), compressed or non-contiguous
        records go to DCP's reader.
        """
        rest = []
        with open(file, "rb") as handle:
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                info = self.storage_data[item.storage_index]
                if item.type != LoadItemType.TENSOR or info.transform_descriptors or any(item.storage_offsets):
                    rest.append(item)
                    continue
                stored = torch.load(self._slice_file(handle, info), map_location="meta", weights_only=True)
                target = planner.resolve_tensor(item).detach()
                offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
                if (offset is None or tuple(stored.shape) != tuple(item.lengths) or stored.shape != target.shape
                        or stored.dtype != target.dtype or target.device.type != "cpu" or stored.storage_offset()
                        or not stored.is_contiguous() or not target.is_contiguous()):
                    rest.append(item)
                    continue
                handle.seek(info.offset + offset)
                _read_into(handle, target)
                planner.commit_tensor(item, target)
        return rest


def _read_into(handle, tensor: torch.Tensor) -> None:
    """Fill contiguous CPU `tensor` with the next bytes of `handle`."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        count = handle.readinto(view[done:])
        if not count:
            raise EOFError(f"the record ends {nbytes - done} bytes early")
        done += count


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads DCP's non-tensor entries (ints, strings, containers) with `weights_only=True`."""

    def __init__(self, *args, error_type: type[Exception] = RuntimeError, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.error_type = error_type

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise self.error_type(f"checkpoint entry {fqn!r} was refused: it holds objects other than tensors and "
                                  f"plain values, and loading it could run code: {_refusal_reason(exc)}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_pt(path: str | Path, error_type: type[Exception] = RuntimeError, **kwargs):
    """`torch.load(path, weights_only=True)` for side files (scheduler, RNG, trainer state): a file
    holding anything but tensors and plain values is refused, and every failure names the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise error_type(f"{str(path)!r} was refused: it holds objects other than tensors and plain values "
                         f"(loading it could run code): {_refusal_reason(exc)}") from None
    except Exception as exc:  # noqa: BLE001
        raise error_type(f"{str(path)!r} is unreadable: {type(exc).__name__}: {exc}") from None


def _refusal_reason(exc: Exception) -> str:
    """The line of a `weights_only` refusal that names what was refused; torch's first line only
    advises weights_only=False, the wrong advice for a crafted file."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return next((line for line in lines if "unsupported" in line.lower() or "WeightsUnpickler" in line), lines[0])


def _storage_meta():
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


def _done():
    from torch.futures import Future

    future: Future = Future()
    future.set_result(None)
    return future
