"""The `fullshard` command: `train`, `plan` and `export`.

`fullshard train` reads and checks the whole config in the launching process (`train.preflight`),
then starts the ranks under torchrun (`fullshard.launch`), which also turns Ctrl-C into a clean
stop and a failing rank into one `fullshard: error:` line. Under torchrun (started by us or by the
user) the same command is one rank. Every FullshardError is one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import FullshardError
from .launch import LAUNCHED_ENV, LOG_DIR_ENV, debug_enabled, describe, die_with_parent, error_line, launch, run_rank

USAGE = """fullshard train [CONFIG.yaml] [--section.key=value ...] [--nproc N] [--print-config] [--debug]
       fullshard plan MODEL_OR_CONFIG [--section.key=value ...] [--nproc N] [--micro-batch-size B] [--seq-len S]
       fullshard export CHECKPOINT_DIR OUTPUT_DIR [--dtype bf16|fp16|fp32]
       fullshard --version"""

TRAIN_HELP = """usage: fullshard train [CONFIG.yaml] [--section.key=value ...] [--nproc N] [--print-config] [--debug]

Train a model with FSDP2 on N local processes (torchrun is started for you; under torchrun each
process is one rank). CONFIG.yaml holds any of the sections below and may stand anywhere on the
line; --section.key=value (or --section.key value) overrides it. Values are YAML: 1e-4, 10, null,
[0.9, 0.95]. ~ and $VARS are expanded in paths. Ctrl-C stops after the current step and saves a
checkpoint (again: at once); the same command resumes. A directory holds one run: a second run
into it while it lives is refused, and so is a new run into another run's checkpoints unless
--checkpoint.overwrite=true (which deletes that run first).

options:
  --nproc N        processes to start (default: train.nproc, else one per GPU, else 2)
  --print-config   print the merged config as YAML and exit
  --debug          on failure print every rank's traceback (also FULLSHARD_DEBUG=1)
  --help           this text
"""


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """One process per GPU, or 2 CPU processes where there is none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def fail(message: str) -> int:
    print(error_line(message), file=sys.stderr)
    return 2


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        return package_version("fullshard")
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------- train


@dataclass
class TrainArgs:
    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    nproc: int | None = None
    print_config: bool = False
    debug: bool = False
    help: bool = False


def parse_train_args(argv: list[str]) -> TrainArgs:
    """The config path (anywhere on the line), `--section.key=value` or `--section.key value`
    overrides, and the launcher's own options."""
    from .train.config import ConfigError

    args, i = TrainArgs(), 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        takes_next = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if name == "--nproc":
            raw = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if takes_next else "")
            if not raw.isdigit() or int(raw) < 1:
                raise ConfigError(f"--nproc must be a positive integer, got {raw!r}")
            args.nproc, i = int(raw), i + (1 if "=" in arg else 2)
            continue
        if arg in ("--print-config", "--debug", "--help", "-h"):
            setattr(args, {"-h": "help"}.get(arg, arg[2:].replace("-", "_")), True)
        elif arg.startswith("--") and "." in name:
            args.overrides.append(arg if "=" in arg or not takes_next else f"{arg}={argv[i + 1]}")
            i += 0 if "=" in arg or not takes_next else 1
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; options are --nproc, --print-config, --debug, --help and "
                              "--section.key=value")
        elif args.config_path is not None:
            raise ConfigError(f"two config files given: {args.config_path!r} and {arg!r}")
        else:
            args.config_path = arg
        i += 1
    return args


def cmd_train(argv: list[str]) -> int:
    from .train.config import describe_keys, load_config

    args = parse_train_args(argv)
    if args.help:
        print(TRAIN_HELP + describe_keys())
        return 0
    config = load_config(args.config_path, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if under_launcher():
        return run_as_rank(config, args)
    from .train.preflight import check_before_launch
    from .train.rundir import RunLock, check_output_paths, claim_run_directory

    world = args.nproc or config.train.nproc or default_nproc()
    check_output_paths(config)
    with RunLock(config.output_dir) as lock:  # one live run per directory, until the ranks are gone
        check_before_launch(config, world)
        claim_run_directory(config)
        rank_args = ["train", *([args.config_path] if args.config_path else []), *args.overrides]
        return launch(world, rank_args, config.log_dir, config.checkpoint.on_stop_timeout_s, debug=args.debug,
                      lock_file=lock.path)


def run_as_rank(config, args: TrainArgs) -> int:
    """One rank under torchrun: train, and report a failure through the log directory."""
    from .train import train

    if os.environ.get(LAUNCHED_ENV) == "1":
        die_with_parent()
    config.accumulation_steps(int(os.environ["WORLD_SIZE"]))
    return run_rank(lambda: train(config), os.environ.get(LOG_DIR_ENV, config.log_dir), debug=args.debug)


# ---------------------------------------------------------------------------------------------- plan


def cmd_plan(argv: list[str]) -> int:
    from .distributed import detect_device_type
    from .dtypes import DTYPES
    from .plan import build_plan
    from .strategy import batch_arithmetic, describe_mesh
    from .parallel.ep import describe_expert_parallel
    from .train.memory import estimate_memory

    parser = argparse.ArgumentParser(prog="fullshard plan")
    parser.add_argument("source", help="a YAML config, a built-in model name, a local HF directory or a Hub id")
    parser.add_argument("--nproc", type=int, default=None, help="ranks the model is sharded over")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own code")
    parser.epilog = "--section.key=value overrides the config as for `fullshard train`"
    args, args.overrides = parser.parse_known_args(argv)
    config, model = plan_config_and_model(args)
    nproc = args.nproc or config.train.nproc or default_nproc()
    dims = config.parallel_dims(nproc)
    plan = build_plan(model, config.fsdp.plan)
    assignments = tp_assignments(model, config.fsdp.tp_plan, dims.tp)
    precision, fsdp = config.fsdp.mixed_precision, config.fsdp
    micro = args.micro_batch_size or config.train.micro_batch_size
    seq_len = args.seq_len or config.data.seq_len
    try:
        accumulation = batch_arithmetic(config.train.global_batch_size, micro, dims.dp_size,
                                        names=("train.global_batch_size", "--micro-batch-size"))
    except FullshardError as err:  # the model's plan is still worth showing; the estimate assumes accumulation
        print(f"note: {err}")
        accumulation = None
    device_type = detect_device_type()
    estimate = estimate_memory(model, plan, dims.dp_shard, micro, seq_len, DTYPES[precision],
                               fsdp.activation_checkpointing, config.optim.name, accumulation_steps=accumulation,
                               device_type=device_type, reduce_dtype=DTYPES[fsdp.reduce_dtype],
                               tp_assignments=assignments, tp_size=dims.tp, cp_size=dims.cp, ep_size=dims.ep,
                               loss_chunk_tokens=config.train.loss_chunk_tokens)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, {describe_mesh(dims)}\n")
    print(plan.describe(model, dims.fsdp_shard_size))
    if dims.tp > 1:
        print(f"\ntensor parallel (tp {dims.tp}; the table above counts whole parameters, each tp rank holds its "
              "slice of the split ones):\n" + describe_tp(model, assignments, dims.tp))
    if dims.ep > 1:
        print("\n" + describe_expert_parallel(model, dims.ep, dims.efsdp))
    print(f"\nper-rank memory estimate (micro batch {micro} x {seq_len} tokens over cp {dims.cp}, compute {precision}, "
          f"activation checkpointing {fsdp.activation_checkpointing}, {config.optim.name}, "
          f"loss chunks of {config.train.loss_chunk_tokens or 'all the'} tokens, "
          f"{accumulation or 'unknown'} micro-batch(es) per step, {device_type}):")
    print(estimate.describe())
    if dims.pp > 1:
        print(f"\npipeline (pp {dims.pp}, {fsdp.pp_schedule}): each stage's layers and per-rank memory estimate")
        for line, stage in describe_pipeline(model, fsdp):
            stage_plan = build_plan(stage, fsdp.plan)
            stage_estimate = estimate_memory(
                stage, stage_plan, dims.dp_shard, micro, seq_len, DTYPES[precision], fsdp.activation_checkpointing,
                config.optim.name, accumulation_steps=accumulation, device_type=device_type,
                reduce_dtype=DTYPES[fsdp.reduce_dtype], tp_assignments=tp_assignments(stage, fsdp.tp_plan, dims.tp),
                tp_size=dims.tp, cp_size=dims.cp, loss_chunk_tokens=config.train.loss_chunk_tokens)
            print(f"{line}\n" + "\n".join(f"    {row}" for row in stage_estimate.describe().splitlines()))
    return 0


def describe_pipeline(model, fsdp):
    """Each pipeline stage of `model` (on meta) with its one-line description."""
    from .parallel.pp import build_stage, decoder_parts, held_ends, stage_layers

    parts = decoder_parts(model)
    ranges = stage_layers(model, parts, fsdp.pp_size * fsdp.pp_virtual_stages, fsdp.pp_layers_per_stage)
    for index, layers in enumerate(ranges):
        ends = [name for name, held in held_ends(parts, index, len(ranges)).items() if held]
        stage = build_stage(model, parts, ranges, index)
        params = sum(p.numel() for p in stage.parameters())
        yield (f"stage {index} (pp rank {index % fsdp.pp_size}): layers {layers.start}-{layers.stop - 1}"
               + (f" + {', '.join(ends)}" if ends else "") + f", {params:,} parameters"), stage


def plan_config_and_model(args):
    """The config `fullshard plan` was given (a YAML file or a model name, then `--section.key=value`
    overrides as `fullshard train` takes them) and its model on meta."""
    from .train.config import load_config, parse_overrides
    from .train.preflight import build_meta_model

    overrides = parse_overrides(args.overrides)
    model = overrides.setdefault("model", {})
    if args.trust_remote_code:
        model["trust_remote_code"] = True
    if args.source.endswith((".yaml", ".yml")):
        config = load_config(args.source, overrides)
    else:
        model.setdefault("name_or_path", args.source)
        config = load_config(None, overrides)
    from .towers import freeze

    model = build_meta_model(config)
    freeze(model, config.freeze)  # the table shows frozen towers as the run will have them
    return config, model


def tp_assignments(model, tp_plan, tp_size: int) -> dict[str, str]:
    """Module name -> TP style, validated as the engine does (a `PlanError` naming the entry); none at tp 1."""
    if tp_size == 1:
        return {}
    from .parallel.tp import plan_assignments, resolve_tp_plan

    return plan_assignments(model, resolve_tp_plan(model, tp_plan), tp_size)


def describe_tp(model, assignments: dict[str, str], tp_size: int) -> str:
    """One line per parameter kind the plan splits (layers folded): its style, whole shape and the
    slice tp rank r holds."""
    import re

    from .train.memory import TensorParallelSplit

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


# ---------------------------------------------------------------------------------------------- export


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fullshard export")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest complete checkpoint)")
    parser.add_argument("output", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="the dtype written (default: the dtype the fine-tuned source checkpoint is stored in)")
    args = parser.parse_args(argv)
    from .checkpoint import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)
    written = json.loads((Path(path) / "config.json").read_text()).get("dtype")
    print(f"[fullshard] exported {args.checkpoint} to {path} ({written})")
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        print(f"fullshard {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        return fail(f"unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} (fullshard --help)")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except FullshardError as err:  # bad input: the message names it
        return fail(describe(err))
    except Exception as err:  # noqa: BLE001 - a library's error or a bug: one line, the traceback on demand
        if debug_enabled():
            raise
        print(error_line(f"{describe(err)} (FULLSHARD_DEBUG=1 shows the traceback)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
