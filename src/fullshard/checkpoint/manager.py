"""`CheckpointManager`: sharded save / resume of the whole training state, atomic and rotating.

Model and optimizer go through torch.distributed.checkpoint (DCP) with `get_state_dict` /
`set_state_dict`, so a checkpoint written by N ranks loads on M. A save is written under a
temporary name, marked COMPLETE once every rank has finished, then renamed; only marked
directories are ever loaded, and rotation runs only after the new checkpoint is complete.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..distributed import get_rank, get_world_size
from ..engine import reshard_all
from . import layout
from .agree import broadcast_from_rank0, run_agreed
from ..dtypes import dtype_name
from .export import config_json, generation_config_json, source_dtype, tied_alias_keys
from .rng import capture_rng_state, rederive_rng_state, restore_rng_state

logger = logging.getLogger(__name__)
MB = 2**20


@dataclass
class _PendingSave:
    future: object
    tmp: Path
    final: Path
    step: int


class CheckpointManager:
    """Saves and resumes training under `save_dir`, keeping at most `max_num` checkpoints and
    `max_mem` MB (the newest complete one is always kept, whatever its size).

    `async_save=True` returns from `save` once the state is copied to host memory and writes in
    the background; the save is committed by `wait()`, which the next `save`/`load` call first.
    Every method is collective: call it on every rank.
    """

    def __init__(self, save_dir: str | os.PathLike, max_num: int | None = 3, max_mem: float | None = None,
                 async_save: bool = False, save_latest: bool = True):
        if max_num is not None and max_num < 1:
            raise ValueError(f"max_num must be >= 1 (or None for no limit), got {max_num}")
        if max_mem is not None and max_mem <= 0:
            raise ValueError(f"max_mem must be a positive number of MB (or None for no limit), got {max_mem}")
        self.save_dir = Path(save_dir)
        self.max_num = max_num
        self.max_mem = max_mem
        self.async_save = async_save
        self.save_latest = save_latest
        self.last_load_info: dict | None = None
        self._pending: _PendingSave | None = None
        self._async_group = None

    # ------------------------------------------------------------------ finding

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = layout.complete_checkpoints(self.save_dir)
        return found[0] if found else None

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        return layout.complete_checkpoints(self.save_dir)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None, scaler=None,
             extra_state: dict | None = None, tag: str | None = None) -> Path:
        """Save everything training needs to continue from `step`; returns the checkpoint's path.

        extra_state must be JSON-serialisable (data position, run config); rank 0's is kept.
        """
        self.wait()
        tag = f"step_{step}" if tag is None else str(tag)
        extra_state = dict(extra_state or {})

        def check_arguments():
            if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == layout.LATEST:
                raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', no leading '.', not 'latest')")
            try:
                json.dumps(extra_state)
            except TypeError as err:
                raise TypeError(f"extra_state must be JSON-serialisable: {err}") from None

        run_agreed(check_arguments)
        final = self.save_dir / tag
        tmp = Path(broadcast_from_rank0(run_agreed(lambda: str(self._begin_save(tag)), on_rank=0)))
        try:
            state = run_agreed(lambda: self._write_side_files(tmp, step, model, optimizer, scheduler, scaler, extra_state))
            if self.async_save:
                if self._async_group is None and dist.is_initialized():
                    # DCP's background thread runs collectives; on its own group they cannot
                    # interleave with the training loop's collectives on the default group
                    self._async_group = dist.new_group(backend="gloo")
                future = dcp.async_save(state, checkpoint_id=str(tmp / layout.STATE_DIR), process_group=self._async_group)
                self._pending = _PendingSave(future, tmp, final, step)
                atexit.register(self._wait_at_exit)
                return final
            dcp.save(state, checkpoint_id=str(tmp / layout.STATE_DIR))
        except CheckpointException as err:
            self._abandon(tmp)
            raise RuntimeError(f"saving checkpoint {final} failed; nothing already on disk was changed: {err}") from None
        except BaseException:
            self._abandon(tmp)
            raise
        self._commit(tmp, final, step)
        return final

    def wait(self) -> None:
        """Finish and commit a pending async save (collective; a no-op when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        atexit.unregister(self._wait_at_exit)
        try:
            run_agreed(pending.future.result)
        except RuntimeError as err:
            self._abandon(pending.tmp)
            raise RuntimeError(f"async save of {pending.final} failed; nothing already on disk was changed: {err}") from None
        except BaseException:
            self._abandon(pending.tmp)
            raise
        self._commit(pending.tmp, pending.final, pending.step)

    def _wait_at_exit(self) -> None:
        """A script that ends without `wait()` still commits its last async save (rank 0 commits
        alone once the process group is gone: its DCP future finishing means every rank wrote)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - nothing left to raise to at exit
            logger.exception("the async checkpoint save pending at exit failed; it was not committed")

    def _begin_save(self, tag: str) -> Path:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self._clean_debris()
        tmp = self.save_dir / f"{layout.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
        (tmp / layout.RNG_DIR).mkdir(parents=True)
        return tmp

    def _write_side_files(self, tmp: Path, step: int, model, optimizer, scheduler, scaler, extra_state) -> dict:
        """Everything but the DCP shards; returns the state dict DCP writes."""
        rank = get_rank()
        layout.write_durably(layout.rng_file(tmp, rank), _torch_bytes(capture_rng_state()))
        reshard_all(model)
        model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
        if rank == 0:
            trainer_state = {"format": layout.FORMAT_VERSION, "step": step, "world_size": get_world_size(),
                             "base_seed": torch.initial_seed(), "has_optimizer": optimizer is not None,
                             "extra_state": extra_state}
            layout.write_durably(tmp / layout.TRAINER_STATE, json.dumps(trainer_state, indent=2))
            aliases = tied_alias_keys(model)
            meta = {"format": layout.FORMAT_VERSION, "class_name": type(model).__name__,
                    "dtype": dtype_name(source_dtype(model)), "tied_aliases": aliases,
                    "state_keys": [k for k in model_state if k not in aliases]}
            layout.write_durably(tmp / layout.MODEL_META, json.dumps(meta, indent=2))
            for name, text in ((layout.CONFIG, config_json(model)), (layout.GENERATION_CONFIG, generation_config_json(model))):
                if text is not None:
                    layout.write_durably(tmp / name, text)
            if scheduler is not None:
                layout.write_durably(tmp / layout.SCHEDULER, _torch_bytes(scheduler.state_dict()))
            if scaler is not None:
                layout.write_durably(tmp / layout.SCALER, _torch_bytes(scaler.state_dict()))
        state = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        return state

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        def commit():
            if not (tmp / layout.STATE_DIR / ".metadata").is_file():
                raise RuntimeError(f"{tmp} has no DCP index after the save returned; not committing it")
            marker = {"time_ns": time.time_ns(), "step": step, "world_size": get_world_size()}
            layout.write_durably(tmp / layout.COMPLETE, json.dumps(marker))
            layout.fsync_dir(tmp)
            if final.exists():
                # the old checkpoint of this tag leaves only once the new one is complete;
                # a crash between the two renames is repaired by _clean_debris
                self._discard(final)
            os.rename(tmp, final)
            layout.fsync_dir(self.save_dir)
            if self.save_latest:
                latest_tmp = self.save_dir / f"{layout.TMP_PREFIX}latest"
                latest_tmp.write_text(final.name + "\n")
                os.replace(latest_tmp, self.save_dir / layout.LATEST)
            self._rotate()

        run_agreed(commit, on_rank=0)

    def _abandon(self, tmp: Path) -> None:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self, checkpoint: Path) -> None:
        """Delete a checkpoint by renaming it out of sight first, so a crash mid-delete never
        leaves a marked directory with missing shards."""
        trash = self.save_dir / f"{layout.TRASH_PREFIX}{checkpoint.name}-{uuid.uuid4().hex[:8]}"
        os.rename(checkpoint, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _rotate(self) -> None:
        """Keep the newest checkpoints while they fit max_num and max_mem; the newest always stays,
        and once one does not fit, every older one goes too (no gaps in the history)."""
        kept, total, dropping = 0, 0, False
        for index, checkpoint in enumerate(self.checkpoints()):
            size = layout.dir_size(checkpoint)
            fits = (self.max_num is None or kept < self.max_num) and (self.max_mem is None or total + size <= self.max_mem * MB)
            if index == 0 and not fits:
                logger.warning("checkpoint %s alone is %.1f MB, over max_mem=%s MB; kept as the only one",
                               checkpoint, size / MB, self.max_mem)
            if index == 0 or (fits and not dropping):
                kept, total = kept + 1, total + size
                continue
            dropping = True
            logger.info("rotating out checkpoint %s", checkpoint)
            self._discard(checkpoint)

    def _clean_debris(self) -> None:
        """Remove what interrupted saves and deletes left behind (rank 0 only).

        A temporary directory that already carries its marker crashed between the marker and the
        rename: it is complete, so it is finished (renamed) rather than removed.
        """
        if not self.save_dir.is_dir():
            return
        for child in sorted(self.save_dir.iterdir()):
            if child.name.startswith(layout.TMP_PREFIX) and child.is_dir():
                tag = child.name[len(layout.TMP_PREFIX):].rsplit("-", 1)[0]
                if layout.is_complete(child) and not (self.save_dir / tag).exists():
                    os.rename(child, self.save_dir / tag)
                else:
                    logger.warning("removing incomplete checkpoint %s (its save was interrupted)", child)
                    shutil.rmtree(child, ignore_errors=True)
        for child in self.save_dir.iterdir():
            if child.name.startswith(layout.TRASH_PREFIX):
                shutil.rmtree(child, ignore_errors=True)

    # ------------------------------------------------------------------ loading

    def load(self, model: torch.nn.Module, optimizer=None, scheduler=None, scaler=None, path: str | os.PathLike = "auto",
             load_optimizer: bool = True, load_scheduler: bool = True, strict: bool = True) -> dict | None:
        """Restore a checkpoint into `model` (and optimizer, scheduler, scaler, RNG); returns its
        extra_state with "step" added, or None when `path="auto"` finds no complete checkpoint.

        `path` is "auto" (newest complete checkpoint under save_dir), a checkpoint, or a save dir.
        A checkpoint from another world size loads resharded; per-rank RNG is then re-derived.
        """
        self.wait()

        def resolve():
            if str(path) == "auto":
                self._clean_debris()
                latest = self.latest()
                return None if latest is None else str(latest)
            return str(layout.resolve_checkpoint(path))

        resolved = broadcast_from_rank0(run_agreed(resolve, on_rank=0))
        if resolved is None:
            return None
        checkpoint = Path(resolved)
        want_optimizer = optimizer is not None and load_optimizer
        reshard_all(model)

        def prepare():
            trainer_state = layout.read_json(checkpoint / layout.TRAINER_STATE)
            state_dir = checkpoint / layout.STATE_DIR
            metadata = layout.read_dcp_metadata(state_dir)
            layout.check_storage_files(state_dir, metadata)
            model_state, optim_state = get_state_dict(model, optimizer if want_optimizer else [])
            model_state = _check_against_index(checkpoint, metadata, model_state, optim_state if want_optimizer else None, strict)
            return trainer_state, model_state, optim_state

        trainer_state, model_state, optim_state = run_agreed(prepare)
        state = {"model": model_state}
        if want_optimizer:
            state["optim"] = optim_state
        try:
            dcp.load(state, checkpoint_id=str(checkpoint / layout.STATE_DIR))
        except (Exception, CheckpointException) as err:
            raise RuntimeError(f"reading checkpoint {checkpoint} failed: {err}") from None
        options = StateDictOptions(strict=strict)
        set_model_state_dict(model, state["model"], options=options)
        if want_optimizer:
            set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
        run_agreed(lambda: self._load_side_files(checkpoint, trainer_state, scheduler if load_scheduler else None, scaler))
        extra = dict(trainer_state.get("extra_state") or {})
        extra.setdefault("step", trainer_state["step"])
        return extra

    def _load_side_files(self, checkpoint: Path, trainer_state: dict, scheduler, scaler) -> None:
        for obj, name in ((scheduler, layout.SCHEDULER), (scaler, layout.SCALER)):
            if obj is None:
                continue
            file = checkpoint / name
            if not file.is_file():
                raise FileNotFoundError(f"{file} is missing: the checkpoint was saved without a {name.split('.')[0]}")
            obj.load_state_dict(torch.load(file, weights_only=True))
        rank, world, saved_world = get_rank(), get_world_size(), trainer_state["world_size"]
        if saved_world == world:
            restore_rng_state(torch.load(layout.rng_file(checkpoint, rank), weights_only=True))
            rng = "restored"
        else:
            rederive_rng_state(trainer_state["base_seed"], trainer_state["step"], rank, saved_world, world)
            rng = "re-derived"
        self.last_load_info = {"path": str(checkpoint), "step": trainer_state["step"], "saved_world_size": saved_world,
                               "world_size": world, "rng": rng}


def _check_against_index(checkpoint: Path, metadata, model_state: dict, optim_state: dict | None, strict: bool) -> dict:
    """Compare what the model (and optimizer) expect with what the checkpoint holds, by key and
    shape, and say exactly which keys differ. Returns the model state to load (without the keys
    the checkpoint lacks when not strict)."""
    index = metadata.state_dict_metadata
    saved_model_keys = {k[len("model."):] for k in index if k.startswith("model.")}
    missing = sorted(k for k in model_state if k not in saved_model_keys)
    unexpected = sorted(saved_model_keys - set(model_state))
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_few(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the model: {_few(unexpected)}")
    if not strict:
        model_state = {k: v for k, v in model_state.items() if k in saved_model_keys}
    to_check = {"model": model_state}
    if optim_state is not None:
        if not any(k.startswith("optim.") for k in index):
            problems.append("no optimizer state in the checkpoint (saved without an optimizer): pass load_optimizer=False")
        else:
            to_check["optim"] = optim_state
    flat, _ = flatten_state_dict(to_check)
    mismatched = []
    for key, value in flat.items():
        saved = index.get(key)
        if isinstance(value, torch.Tensor) and saved is not None and hasattr(saved, "size"):
            if tuple(value.shape) != tuple(saved.size):
                mismatched.append(f"{key}: checkpoint {tuple(saved.size)} vs model {tuple(value.shape)}")
        elif key.startswith("optim.") and saved is None and "optim" in to_check:
            mismatched.append(f"{key}: not in the checkpoint")
    if mismatched:
        problems.append(f"shape mismatch: {_few(mismatched)}")
    if problems:
        raise ValueError(f"checkpoint {checkpoint} does not fit this model: " + "; ".join(problems))
    return model_state


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
