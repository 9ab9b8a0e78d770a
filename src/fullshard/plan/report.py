"""What `fullshard plan` prints besides the unit table (`ShardingPlan.describe`): how tensor
parallelism splits each kind of parameter, and the per-rank memory estimate with what it assumed
and whether it fits the device."""

from __future__ import annotations

import re

from .memory import TensorParallelSplit


def stored_dtype(config) -> str | None:
    """The `torch_dtype` the model's config.json states (what its weights are stored in), if any."""
    from ..train.preflight import load_hf_config, resolve_model_dir

    directory = resolve_model_dir(config.model.name_or_path)
    if directory is None:
        return None
    dtype = getattr(load_hf_config(directory, config.model.trust_remote_code, config.model.name_or_path), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def print_estimate(config, run, device: str, capacity: int | None, micro: int, seq_len: int,
                   accumulation: int | None, largest_micro) -> None:
    """The estimate's header (what it assumed), each rank's (or stage's) rows, and whether it fits.
    `largest_micro()`: the largest micro batch that fits, or (a GRPO step) the line to print."""
    fsdp = config.fsdp
    stored = stored_dtype(config)
    grpo = config.train.objective == "grpo"
    batch = ("a GRPO step's phases" if grpo else
             f"micro batch {micro} x {seq_len} tokens over cp {config.parallel.cp_size}")
    print(f"\nper-rank memory estimate ({batch}, "
          f"activation checkpointing {fsdp.activation_checkpointing}"
          f"{f' (every {fsdp.ac_every})' if fsdp.activation_checkpointing == 'every_n' else ''}, "
          f"{'activation offload, ' if fsdp.activation_offload else ''}"
          f"{f'float8 {fsdp.float8}, ' if fsdp.float8 != 'none' else ''}"
          f"loss chunks of {config.train.loss_chunk_tokens or 'all the'} tokens, "
          + ("" if grpo else f"{accumulation or 'unknown'} micro-batch(es) per step, ")
          + f"{device}):\n"
          f"assumed: {run.assumptions} (model.dtype={config.model.dtype}, fsdp.mixed_precision={fsdp.mixed_precision}"
          + (f"; config.json's torch_dtype {stored} is only what is read from disk" if stored else "") + ")"
          + ("; LoRA: the frozen base has no gradients or optimizer state" if config.lora.enabled else "")
          + ("; offload_params: parameters, gradients and optimizer state in host memory, not counted on the device"
             if fsdp.offload_params and not device.startswith("cpu") else ""))
    for stage in run.stages:
        if len(run.stages) > 1:
            print(f"\n{stage.label}:")
        print(stage.estimate.describe())
    if len(run.stages) > 1:
        top = max(run.stages, key=lambda s: s.estimate.total)
        print(f"\nlargest per-rank total: {top.label.split(':')[0]}, {top.estimate.total / 2**20:,.2f} MiB")
    if capacity is not None:
        fits = run.per_rank <= capacity
        print(f"\nfits: {run.per_rank / 2**30:.1f} of {capacity / 2**30:.1f} GiB ({device})" if fits else
              f"\ndoes NOT fit: {run.per_rank / 2**30:.1f} of {capacity / 2**30:.1f} GiB ({device})")
        best = largest_micro()
        if grpo:
            print(best)
            return
        print(f"largest micro batch that fits at {seq_len} tokens: {best}" if best else
              f"no micro batch fits at {seq_len} tokens: shard over more ranks, checkpoint activations or offload")


def describe_tp(model, assignments: dict[str, str], tp_size: int) -> str:
    """One line per parameter kind the plan splits (layers folded): its style, whole shape and the
    slice tp rank r holds."""
    split, lines = TensorParallelSplit(model, assignments, tp_size), {}
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        if module not in assignments:
            continue
        dim, shape = split.split_dim(name), list(param.shape)
        if dim is None:
            held = "whole on every tp rank"
        else:
            part = shape[dim] // tp_size
            held = f"tp rank r holds dim {dim} [r*{part}:(r+1)*{part}] -> {list(split.local(name, param).shape)}"
        lines.setdefault(re.sub(r"\.\d+\.", ".*.", name), f"{assignments[module]:<8} {str(shape):<10} {held}")
    width = max(len(k) for k in lines)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in lines.items())
