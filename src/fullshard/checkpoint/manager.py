"""`CheckpointManager`: sharded save / resume of the whole training state, atomic and rotating.

Model and optimizer go through torch.distributed.checkpoint (DCP) with `get_state_dict` /
`set_state_dict`, so a checkpoint written by N ranks loads on M; other training state (the
strategy's step counter and loss scaler, ...) rides in the same DCP state as `states`, a mapping
of Stateful objects, as torchtitan's checkpointer does. A save is written under a temporary name,
marked COMPLETE once every rank has finished, then renamed; only marked directories are ever
loaded, and rotation runs only after the new checkpoint is complete. Nothing read back runs code
(`fullshard.safe_dcp`), and every failure is one `CheckpointError` naming the path, on every rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import time
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..distributed import agreed, broadcast_from_rank0, get_rank, get_world_size, run_agreed
from ..errors import CheckpointError, ConfigError
from ..fsdp import reshard_all
from ..hf.export import config_json, every_rank_part, generation_config_json
from ..hf.lora import is_peft_model, write_adapter_config
from ..hf.offline import model_meta
from ..log import log_rank0, logger, warn_rank0
from ..tensors import holds_part
from . import async_exit, layout
from .checksums import SummingWriter, write_manifest
from .fit import few, fit_to_index
from .read import CheckpointReader, UnreadableCheckpoint, failure_summary, read_side_file
from .rng import capture_rng_state, rederive_rng_state, restore_rng_state

MB = 2**20


def agreed_run_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names (a checkpoint, save directory or run directory), as the first
    rank resolves it, on every rank; a `CheckpointError` on every rank if it names none."""
    return Path(broadcast_from_rank0(run_agreed(lambda: str(layout.resolve_run_checkpoint(path)), on_rank=0,
                                                error_type=CheckpointError)))


class CheckpointManager:
    """Saves and resumes training under `save_dir`, keeping at most `max_num` checkpoints and
    `max_mem` MB (the newest complete one is always kept, whatever its size).

    `async_save=True` returns from `save` at once: the state is copied to host memory in a
    background thread while training goes on, then written in the background. Given an
    optimizer, its next `step()` first waits for that copy (a step pre-hook), so the checkpoint
    holds the state of the step it names; until then, change parameters only through that
    optimizer. Without one, `save` copies before it returns. The host copy is kept and reused by
    the next async save (one more copy of the rank's state in host memory, pinned on CUDA), so
    a save copies into memory already mapped instead of faulting in fresh pages. The save is
    committed by `wait()`, which the next `save`/`load` call first, as
    does `dist.destroy_process_group()`; a save still pending at exit is committed or the process
    exits non-zero naming the step lost (`async_exit`). Every method is collective: call it on every rank.
    """

    def __init__(self, save_dir: str | os.PathLike, max_num: int | None = 3, max_mem: float | None = None,
                 async_save: bool = False, save_latest: bool = True):
        if max_num is not None and max_num < 1:
            raise ConfigError(f"max_num must be >= 1 (or None for no limit), got {max_num}")
        if max_mem is not None and max_mem <= 0:
            raise ConfigError(f"max_mem must be a positive number of MB (or None for no limit), got {max_mem}")
        self.save_dir = Path(save_dir)
        self.max_num = max_num
        self.max_mem = max_mem
        self.async_save = async_save
        self.save_latest = save_latest
        self.last_load_info: dict | None = None
        self._pending: async_exit.PendingSave | None = None
        self._async_group = None
        self._stager = None  # DCP's stager, kept so its host buffers are reused by every async save
        self._staging = None  # the background copy to host memory of the pending async save
        self._guarded = weakref.WeakSet()  # optimizers whose step waits for that copy

    # ------------------------------------------------------------------ finding

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest step first (a save interrupted while committing is finished first)."""
        def find():
            layout.finish_interrupted(self.save_dir)
            return [str(p) for p in layout.complete_checkpoints(self.save_dir)]

        return [Path(p) for p in broadcast_from_rank0(run_agreed(find, on_rank=0, error_type=CheckpointError))]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[0] if found else None

    # ------------------------------------------------------------------ saving

    def save(self, step: int, model: torch.nn.Module, optimizer=None, scheduler=None, states: dict | None = None,
             extra_state: dict | None = None, tag: str | None = None, tokenizer=None) -> Path:
        """Save everything training needs to continue from `step`; returns the checkpoint's path.

        `states` maps names to Stateful objects (`state_dict` / `load_state_dict`) saved in the DCP
        state; extra_state must be JSON-serialisable (data position, run config), rank 0's is kept;
        `tokenizer` is saved beside the weights so an offline export carries it.
        """
        self.wait()
        tag = f"step_{step}" if tag is None else str(tag)
        extra_state = dict(extra_state or {})
        run_agreed(lambda: _check_save_arguments(tag, extra_state, states), error_type=ConfigError)
        final = self.save_dir / tag
        tmp = Path(broadcast_from_rank0(run_agreed(lambda: str(self._begin_save(tag)), on_rank=0,
                                                   error_type=CheckpointError)))
        try:
            with agreed(CheckpointError, f"saving checkpoint {final}"):
                state = self._write_side_files(tmp, step, model, optimizer, scheduler, states, extra_state, tokenizer)
            writer = SummingWriter(str(tmp / layout.STATE_DIR))
            if self.async_save:
                self._start_async(state, tmp, final, step, optimizer, writer)
                return final
            with _without_zip_crc():
                metadata = dcp.save(state, checkpoint_id=str(tmp / layout.STATE_DIR), storage_writer=writer,
                                    planner=_planner())
        except CheckpointException as err:
            self._abandon(tmp)
            raise CheckpointError(f"saving checkpoint {final} failed; nothing already on disk was changed: "
                                  f"{failure_summary(err)}") from None
        except BaseException:
            self._abandon(tmp)
            raise
        self._commit(async_exit.PendingSave(None, tmp, final, step, get_rank(), get_world_size(), metadata, writer))
        return final

    def _start_async(self, state: dict, tmp: Path, final: Path, step: int, optimizer, writer) -> None:
        if self._async_group is None and dist.is_initialized():
            # DCP's background thread runs collectives; on its own group they cannot interleave
            # with the training loop's collectives on the default group
            self._async_group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = _reusing_stager()
        if torch.cuda.is_available():  # the stager copies on its own stream: the last step's writes must be done
            torch.cuda.current_stream().synchronize()
        response = dcp.async_save(state, checkpoint_id=str(tmp / layout.STATE_DIR), storage_writer=writer,
                                  process_group=self._async_group, planner=_planner(), async_stager=self._stager)
        self._pending = async_exit.PendingSave(response.upload_completion, tmp, final, step, get_rank(),
                                               get_world_size(), writer=writer)
        async_exit.track(self)
        self._staging = response.staging_completion
        if hasattr(optimizer, "register_step_pre_hook"):
            if optimizer not in self._guarded:
                optimizer.register_step_pre_hook(lambda *_: self.wait_for_staging())
                self._guarded.add(optimizer)
        else:  # nothing would tell us before the state changes: copy now
            self.wait_for_staging()

    def wait_for_staging(self) -> None:
        """Block until the pending async save's copy to host memory is done (its failure, if
        any, is raised by `wait()`); after this the live state may change."""
        staging, self._staging = self._staging, None
        if staging is not None:
            concurrent.futures.wait([staging])

    def wait(self) -> None:
        """Finish and commit a pending async save (collective; a no-op when none is pending)."""
        self.wait_for_staging()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        async_exit.untrack(self)
        try:
            with agreed(CheckpointError, f"async save of {pending.final}"):
                try:
                    pending.metadata = pending.future.result()
                except CheckpointException as err:
                    raise CheckpointError(f"async save of {pending.final} failed: {failure_summary(err)}") from None
        except BaseException:
            self._abandon(pending.tmp)
            raise
        self._commit(pending)

    def _begin_save(self, tag: str) -> Path:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        layout.remove_debris(self.save_dir)
        tmp = self.save_dir / f"{layout.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
        (tmp / layout.RNG_DIR).mkdir(parents=True)
        return tmp

    def _write_side_files(self, tmp: Path, step: int, model, optimizer, scheduler, states, extra_state,
                          tokenizer) -> dict:
        """Everything but the DCP shards, not yet fsynced (`commit_files` does that); returns the
        state dict DCP writes."""
        layout.write_file(layout.rng_file(tmp, get_rank()), _torch_bytes(capture_rng_state()))
        reshard_all(model)
        model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [],
                                                  options=_options())
        shapes = [(k, tuple(v.shape)) for k, v in model_state.items()]
        # the recipe names all
        shapes = dict(every_rank_part(shapes, lambda item: item[0]) if holds_part(model) else shapes)
        meta = model_meta(model, shapes)  # on every rank: a LoRA recipe asks every pipeline stage for its layers
        if get_rank() == 0:
            trainer_state = {"format": layout.FORMAT_VERSION, "step": step, "world_size": get_world_size(),
                             "base_seed": torch.initial_seed(), "has_optimizer": optimizer is not None,
                             "states": sorted(states or {}), "extra_state": extra_state}
            layout.write_file(tmp / layout.TRAINER_STATE, json.dumps(trainer_state, indent=2))
            layout.write_file(tmp / layout.MODEL_META, json.dumps(meta, indent=2))
            _write_model_files(tmp, model, tokenizer)
            if scheduler is not None:
                layout.write_file(tmp / layout.SCHEDULER, _torch_bytes(scheduler.state_dict()))
        state = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        if states:
            state["states"] = {name: obj.state_dict() for name, obj in states.items()}
        return state

    def _commit(self, pending: async_exit.PendingSave) -> None:
        run_agreed(lambda: self.commit_files(pending), on_rank=0, error_type=CheckpointError)

    def commit_files(self, pending: async_exit.PendingSave) -> None:
        """Mark, rename into place and rotate: rank 0's part of a commit, after every rank wrote."""
        tmp, final = pending.tmp, pending.final
        if pending.metadata is None or not (tmp / layout.STATE_DIR / ".metadata").is_file():
            raise CheckpointError(f"{tmp} has no DCP index after the save returned; not committing it")
        gaps = layout.index_gaps(pending.metadata)
        if gaps:
            raise CheckpointError(f"the DCP index of {tmp} does not cover {', '.join(gaps[:4])}: not every rank's "
                                  "shards were written; not committing it")
        layout.fsync_side_files(tmp)
        write_manifest(tmp, pending.writer.files if pending.writer is not None else {})
        marker = {"time_ns": time.time_ns(), "step": pending.step, "world_size": pending.world_size}
        layout.write_durably(tmp / layout.COMPLETE, json.dumps(marker))
        layout.fsync_dir(tmp)
        if final.exists():
            # the old checkpoint of this tag leaves only once the new one is complete; a crash
            # between the two renames is finished by layout.finish_interrupted
            layout.discard(final, background=True)
        os.rename(tmp, final)
        layout.fsync_dir(self.save_dir)
        if self.save_latest:
            latest_tmp = self.save_dir / f"{layout.TMP_PREFIX}latest"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, self.save_dir / layout.LATEST)
        self._rotate()

    def _abandon(self, tmp: Path) -> None:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _rotate(self) -> None:
        """Keep the newest checkpoints while they fit max_num and max_mem; the newest always stays,
        and once one does not fit, every older one goes too (no gaps in the history)."""
        kept, total, dropping = 0, 0, False
        for index, checkpoint in enumerate(layout.complete_checkpoints(self.save_dir)):
            size = layout.dir_size(checkpoint)
            fits = (self.max_num is None or kept < self.max_num) and (
                self.max_mem is None or total + size <= self.max_mem * MB
            )
            if index == 0 and not fits:
                logger.warning("checkpoint %s alone is %.1f MB, over max_mem=%s MB; kept as the only one",
                               checkpoint, size / MB, self.max_mem)
            if index == 0 or (fits and not dropping):
                kept, total = kept + 1, total + size
                continue
            dropping = True
            logger.info("rotating out checkpoint %s", checkpoint)
            layout.discard(checkpoint, background=True)

    # ------------------------------------------------------------------ loading

    def load(self, model: torch.nn.Module, optimizer=None, scheduler=None, states: dict | None = None,
             path: str | os.PathLike = "auto", load_optimizer: bool = True, load_scheduler: bool = True,
             strict: bool = True) -> dict | None:
        """Restore a checkpoint into `model` (and optimizer, scheduler, `states`, RNG); returns its
        extra_state with "step" added, or None when `path="auto"` finds no complete checkpoint.

        `path` is "auto" (newest complete checkpoint under save_dir, falling back to the next older
        one, with a warning naming both, when it is unreadable), a checkpoint, or a save dir.
        A checkpoint from another world size loads resharded; per-rank RNG is then re-derived.
        """
        self.wait()
        auto = str(path) == "auto"

        def resolve():
            if auto:
                layout.remove_debris(self.save_dir)
                return [str(p) for p in layout.complete_checkpoints(self.save_dir)]
            return [str(layout.resolve_checkpoint(path))]

        candidates = [Path(p) for p in broadcast_from_rank0(run_agreed(resolve, on_rank=0, error_type=CheckpointError))]
        for index, checkpoint in enumerate(candidates):
            try:
                return self._load_from(checkpoint, model, optimizer if load_optimizer else None,
                                       scheduler if load_scheduler else None, states or {}, strict)
            except UnreadableCheckpoint as err:
                if index + 1 == len(candidates):
                    raise
                warn_rank0(f"checkpoint {checkpoint} is unreadable, resuming from the next older one, "
                           f"{candidates[index + 1]}, instead: {err}")
        return None

    def init_from(self, path: str | os.PathLike, model: torch.nn.Module, optimizer=None,
                  strict: bool = True) -> dict:
        """Start a new run from another run's checkpoint (a checkpoint, save directory or run
        directory): its weights and, given `optimizer`, each parameter's optimizer state (moments and
        step counts; the optimizer's own settings, lr included, stay this run's). Nothing else
        carries over: no scheduler, counters, RNG or data position. Any world size or layout, as a
        resume. `strict=False` reads the weights the checkpoint holds, the model's others keep
        their values (the caller has checked which). Returns the checkpoint's extra_state with
        "step" added."""
        self.wait()
        checkpoint = agreed_run_checkpoint(path)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] \
            if optimizer is not None else []
        extra = self._load_from(checkpoint, model, optimizer, None, {}, strict=strict,
                                side_files=False)
        for group, own in zip(optimizer.param_groups if optimizer is not None else [], settings):
            group.update(own)
        self.last_load_info = {"path": str(checkpoint), "step": extra["step"], "init_only": True}
        return extra

    def _load_from(self, checkpoint: Path, model, optimizer, scheduler, states: dict, strict: bool, side_files=True):
        reshard_all(model)

        def prepare():
            trainer_state = layout.read_json(checkpoint / layout.TRAINER_STATE, UnreadableCheckpoint)
            if (found := trainer_state.get("format")) != layout.FORMAT_VERSION:
                raise CheckpointError(f"checkpoint {checkpoint} has format {found}; this fullshard reads format "
                                      f"{layout.FORMAT_VERSION} (export it with the fullshard that wrote it)")
            reader = CheckpointReader(checkpoint, share=(get_rank(), get_world_size()))
            options = _options(reader.metadata)
            if optimizer is not None and holds_part(model) and not options.flatten_optimizer_state_dict:
                raise CheckpointError(f"checkpoint {checkpoint} keeps its optimizer groups by index (an older "
                                      "fullshard's format), which the groups of a model split over ranks (pp stages, "
                                      "per-expert modules under ep) do not match: load its weights alone "
                                      "(load_optimizer=False) or resume it without pp / ep")
            model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [],
                                                      options=options)
            state = {"model": model_state}
            if optimizer is not None:
                state["optim"] = optim_state
            if states:
                state["states"] = {name: obj.state_dict() for name, obj in states.items()}
            groups = None  # keyed by name, each parameter's group settings are read as its own
            if optimizer is not None and not options.flatten_optimizer_state_dict:
                groups = _read_every_saved_group(state["optim"], reader.metadata.state_dict_metadata)
            fit = fit_to_index(checkpoint, reader.metadata, state, strict, model)
            state["model"] = fit.model_state
            if optimizer is not None:
                fit.drop_fresh_params(state["optim"])
            return trainer_state, reader, state, fit, groups

        with agreed(CheckpointError, f"loading checkpoint {checkpoint}"):
            trainer_state, reader, state, fit, groups = prepare()
        with agreed(CheckpointError, f"reading checkpoint {checkpoint}"):
            reader.read(state, partial=bool(fit.absent_states))  # what a state lacks keeps its current value
        set_model_state_dict(model, state["model"], options=_options(reader.metadata, strict=strict))
        if optimizer is not None:
            if groups is not None:
                state["optim"]["param_groups"] = regroup(state["optim"]["param_groups"], groups)
            # torch refuses a parameter without saved state when strict; `fit` has told the
            # legitimately absent (left fresh) from the missing (refused)
            set_optimizer_state_dict(model, optimizer, _nested(state["optim"], model),
                                     options=_options(reader.metadata, strict=False))
            if fit.fresh_params:
                log_rank0(f"{len(fit.fresh_params)} parameter(s) had no optimizer state when {checkpoint} was saved "
                          f"(no gradient yet), so they have none now, as in the run that saved it: "
                          f"{few(fit.fresh_params)}")
        for name, obj in states.items():
            if name in fit.unsaved_states:
                warn_rank0(f"checkpoint {checkpoint} holds no {name!r} state; {name} keeps its current state")
                continue
            if name in fit.absent_states:
                warn_rank0(f"checkpoint {checkpoint} lacks {few(fit.absent_states[name])}; "
                           "those keep their current values")
            obj.load_state_dict(state["states"][name])
        if side_files:
            run_agreed(lambda: self._load_side_files(checkpoint, trainer_state, scheduler), error_type=CheckpointError)
        extra = dict(trainer_state.get("extra_state") or {})
        extra.setdefault("step", trainer_state["step"])
        return extra

    def _load_side_files(self, checkpoint: Path, trainer_state: dict, scheduler) -> None:
        if scheduler is not None:
            file = checkpoint / layout.SCHEDULER
            if file.is_file():
                saved = read_side_file(file)
                own = scheduler.state_dict()
                per_group = {k: v for k, v in own.items() if isinstance(v, list)}
                if any(len(saved.get(k, [])) != len(v) for k, v in per_group.items()):
                    # saved with the parameters grouped otherwise (see `regroup`): the per-group lists
                    # stay this run's, built from the same settings; the position in the schedule is restored
                    saved = {**saved, **per_group}
                scheduler.load_state_dict(saved)
            else:
                warn_rank0(f"{file} is missing (the checkpoint was saved without a scheduler); "
                           "the scheduler keeps its current state")
        rank, world, saved_world = get_rank(), get_world_size(), trainer_state["world_size"]
        rng_file = layout.rng_file(checkpoint, rank)
        if saved_world == world and rng_file.is_file():
            restore_rng_state(read_side_file(rng_file))
            rng = "restored"
        else:
            reason = None if saved_world != world else f"{rng_file} is missing"
            rederive_rng_state(trainer_state["base_seed"], trainer_state["step"], rank, saved_world, world, reason)
            rng = "re-derived"
        self.last_load_info = {"path": str(checkpoint), "step": trainer_state["step"], "saved_world_size": saved_world,
                               "world_size": world, "rng": rng}


def _options(metadata=None, **kwargs) -> StateDictOptions:
    """The optimizer state keyed by parameter name throughout, groups too (torch's flattened form),
    for every save: a pipeline stage's groups hold other parameters than the whole model's, so only
    names let a checkpoint move between pp sizes. A checkpoint being read is read in its own form:
    older ones keep their groups by index."""
    by_index = metadata is not None and any(_INDEXED_GROUP.fullmatch(k) for k in metadata.state_dict_metadata)
    return StateDictOptions(flatten_optimizer_state_dict=not by_index, **kwargs)


_INDEXED_GROUP = re.compile(r"optim\.param_groups\.\d+\.params")  # the flattened form has no "params" entry


def _nested(optim_state: dict, model) -> dict:
    """torch's flattened optimizer state (`state.<name>.<key>`, `param_groups.<name>.<key>`) in the
    nested form, keyed by parameter name with one group per parameter (torch matches groups by the
    names they list). Unflattened by torch, a parameter saved without state (`Fit.fresh_params`)
    would get empty placeholders for the live optimizer's entries instead of none."""
    if "state" in optim_state:
        return optim_state
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for key, value in optim_state.items():
        section, _, rest = key.partition(".")
        parts = rest.split(".")
        # a parameter is a leaf: only one prefix of the key is a parameter's name
        cut = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names), None)
        if cut is None:
            raise CheckpointError(f"optimizer state entry {key!r} names no parameter of {type(model).__name__}")
        name, path = ".".join(parts[:cut]), parts[cut:]
        if section == "param_groups":
            groups.setdefault(name, {"params": [name]})[path[0]] = value
            continue
        entry = state.setdefault(name, {})
        for part in path[:-1]:
            entry = entry.setdefault(part, {})
        entry[path[-1]] = value
    return {"state": state, "param_groups": list(groups.values())}


def _planner():
    """DCP's planner with its save plans cached: from the second save on, ranks whose plan did not
    change send none, and the coordinator reuses the global plan."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(enable_plan_caching=True)


def _reusing_stager():
    """DCP's default stager, copying to host memory in its own thread, held by the manager: it
    keeps each staged storage keyed by the original and copies into it again on the next save.
    `save` waits for the previous write first, so a buffer is never overwritten while it is
    being written."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=cuda))


@contextlib.contextmanager
def _without_zip_crc():
    """DCP writes each tensor as a torch.save zip record; torch.load never checks the records'
    CRC32 (a flipped data byte loads silently), so computing it only costs time (a third of
    serialising, measured). Scoped to a synchronous save: the setting is process-global."""
    from torch.utils.serialization import config

    saved, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        yield
    finally:
        config.save.compute_crc32 = saved


def _check_save_arguments(tag: str, extra_state: dict, states: dict | None) -> None:
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == layout.LATEST:
        raise ConfigError(
            f"checkpoint tag {tag!r} must be a plain directory name (no '/', no leading '.', not 'latest')"
        )
    try:
        json.dumps(extra_state)
    except TypeError as err:
        raise ConfigError(f"extra_state must be JSON-serialisable: {err}") from None
    for name, obj in (states or {}).items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"states[{name!r}] is a {type(obj).__name__}, not Stateful (state_dict / load_state_dict)"
            )


def _write_model_files(tmp: Path, model, tokenizer) -> None:
    """Config, generation config, a LoRA run's adapter config and the tokenizer: what an offline
    export writes beside the weights."""
    base = model.get_base_model() if is_peft_model(model) else model
    for name, text in ((layout.CONFIG, config_json(base)), (layout.GENERATION_CONFIG, generation_config_json(base))):
        if text is not None:
            layout.write_file(tmp / name, text)
    if base is not model:
        write_adapter_config(model, tmp / layout.ADAPTER_DIR, model.active_adapter)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / layout.TOKENIZER_DIR))


def _read_every_saved_group(optim_state: dict, index) -> list[dict]:
    """Groups kept by index (an older checkpoint): every saved one is read, however many this
    optimizer has; returns this optimizer's own groups, for `regroup`."""
    groups = optim_state["param_groups"]
    count = len({key.split(".")[2] for key in index if key.startswith("optim.param_groups.")})
    optim_state["param_groups"] = [dict(groups[min(i, len(groups) - 1)]) for i in range(count)]
    return groups


def regroup(saved: list[dict], current: list[dict]) -> list[dict]:
    """The optimizer's own parameter groups, each with the settings of the saved group that held its
    first parameter (its own where none did). Groups follow the parameters' mesh and placement, so
    a run saved under another layout (MoE experts on their own mesh under expert parallelism)
    groups the same parameters differently, and the saved groups cannot be loaded as they are."""
    owner = {name: group for group in saved for name in group.get("params", [])}
    return [{**owner.get(group["params"][0], group), "params": group["params"]} if group["params"] else group
            for group in current]


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
