"""The `fullshard` command: `train`, `plan`, `export` and `generate`.

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
       fullshard plan [MODEL_OR_CONFIG] [--section.key=value ...] [--nproc N] [--micro-batch-size B] [--seq-len S]
                      [--device h100|h200|a100-80g|a100-40g|cpu|cuda]
       fullshard export CHECKPOINT_DIR OUTPUT_DIR [--dtype bf16|fp16|fp32]
       fullshard generate MODEL_DIR_OR_CHECKPOINT --prompt TEXT [--image PATH ...] [--prompt TEXT ...]
                          [--nproc N] [--max-new-tokens N]
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
    config = load_config(args.config_path, args.overrides, note=False)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if under_launcher():
        return run_as_rank(config, args)
    from .train.config import say_renamed_keys
    from .train.preflight import check_before_launch, check_resumed_checkpoint
    from .train.rundir import RunLock, check_output_paths, claim_run_directory, made_only_if_accepted

    world = args.nproc or config.train.nproc or default_nproc()
    check_output_paths(config)
    model = check_before_launch(config, world)  # writes nothing: a refused run leaves nothing behind
    with made_only_if_accepted(config.output_dir), RunLock(config.output_dir) as lock:  # one live run per directory
        claim_run_directory(config)
        check_resumed_checkpoint(config, model)
        del model
        say_renamed_keys(config)
        rank_args = ["train", *([args.config_path] if args.config_path else []), *args.overrides]
        return launch(world, rank_args, config.log_dir, config.checkpoint.on_stop_timeout_s, debug=args.debug,
                      lock_file=lock.path)


def run_as_rank(config, args: TrainArgs) -> int:
    """One rank under torchrun: train, and report a failure through the log directory."""
    from .train import train
    from .train.config import say_renamed_keys

    if os.environ.get(LAUNCHED_ENV) == "1":
        die_with_parent()
    config.accumulation_steps(int(os.environ["WORLD_SIZE"]))
    say_renamed_keys(config)
    return run_rank(lambda: train(config), os.environ.get(LOG_DIR_ENV, config.log_dir), debug=args.debug)


# ---------------------------------------------------------------------------------------------- plan


def cmd_plan(argv: list[str]) -> int:
    from .parallel.ep import describe_expert_parallel
    from .plan.build import build_plan
    from .plan.memory import DEVICES, device_capacity, estimate_run, largest_micro_batch, tp_assignments
    from .plan.report import describe_tp, print_estimate
    from .train.session import batch_arithmetic, describe_mesh

    parser = argparse.ArgumentParser(prog="fullshard plan")
    parser.add_argument("source", nargs="?", default=None,
                        help="a YAML config, a built-in model name, a local HF directory or a Hub id "
                             "(or --model.name_or_path=...)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks the model is sharded over")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--device", choices=sorted(DEVICES), default=None,
                        help="the device to plan for (its allocator and capacity); cuda: this machine's GPU; "
                             "default: this machine's device")
    parser.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own code")
    parser.epilog = "--section.key=value overrides the config as for `fullshard train`"
    args, args.overrides = parser.parse_known_args(joined_overrides(argv))
    unknown = [a for a in args.overrides if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    device, capacity = device_capacity(args.device)
    config, model = plan_config_and_model(args)
    nproc = args.nproc or config.train.nproc or default_nproc()
    dims = config.parallel_dims(nproc)
    engine = config.engine_config()
    plan = build_plan(model, engine.plan)
    assignments = tp_assignments(model, engine.tp_plan, dims.tp)
    micro = args.micro_batch_size or config.train.micro_batch_size
    seq_len = args.seq_len or config.data.seq_len
    try:
        accumulation = batch_arithmetic(config.train.global_batch_size, micro, dims.dp_size,
                                        names=("train.global_batch_size", "--micro-batch-size"))
    except FullshardError as err:  # the model's plan is still worth showing; the estimate assumes accumulation
        print(f"note: {err}")
        accumulation = None
    options = dict(optimizer=config.optim.name, accumulation_steps=accumulation, device_type=DEVICES[device][0],
                   loss_chunk_tokens=config.train.loss_chunk_tokens, reference=planned_reference(config))
    if config.train.objective == "grpo":
        run, largest = planned_grpo(config, model, engine, nproc, dims, seq_len,
                                    DEVICES[device][0], capacity)
    else:
        run = estimate_run(model, engine, nproc, micro, seq_len, **options)

        def largest():
            return largest_micro_batch(model, engine, nproc, seq_len, capacity, **options)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, {describe_mesh(dims)}\n")
    print(plan.describe(model, dims.fsdp_shard_size))
    if dims.tp > 1:
        print(f"\ntensor parallel (tp {dims.tp}; the table above counts whole parameters, each tp rank holds its "
              "slice of the split ones):\n" + describe_tp(model, assignments, dims.tp))
    if dims.ep > 1:
        print("\n" + describe_expert_parallel(model, dims.ep, dims.efsdp))
    print_estimate(config, run, device, capacity, micro, seq_len, accumulation, largest)
    return 0


def planned_grpo(config, model, engine, nproc: int, dims, seq_len: int, device_type: str, capacity):
    """`train.objective=grpo`'s estimate, phase by phase (`plan.rl`), as a one-stage run, and the
    line on the most completions per rank that fit."""
    from .errors import ConfigError
    from .plan.memory import RunEstimate, StageEstimate, dtype_assumptions
    from .plan.rl import describe_setup, estimate_grpo, largest_completions, rl_setup

    pp_why = ("the plan does not estimate a pipelined GRPO step yet" if config.rl.rollout == "engines"
              else "generate does not run a pipelined model: use rl.rollout=engines")
    for key, size, why in (("pp_size", dims.pp, pp_why),
                           ("cp_size", dims.cp, "rollouts are not split over cp ranks")):
        if size > 1:
            raise ConfigError(f"train.objective=grpo: {config.key(key)} is not supported ({why})")
    setup = rl_setup(config, dims.dp_size, seq_len, dims.tp)
    kwargs = dict(optimizer=config.optim.name, device_type=device_type)
    phased = estimate_grpo(model, engine, nproc, setup, **kwargs)
    assumed = f"{dtype_assumptions(model, engine, config.optim.name)}; {describe_setup(setup)}"
    run = RunEstimate([StageEstimate("every rank", phased)], assumed)

    def largest() -> str:
        best = largest_completions(model, engine, nproc, setup, capacity, config.rl.group_size,
                                   **kwargs)
        if not best:
            return ("no group of completions fits: shard over more ranks, shorten "
                    "rl.max_new_tokens, or lower rl.max_tokens_per_micro_batch")
        return (f"most completions per rank that fit: {best} "
                f"(train.global_batch_size {best * dims.dp_size})")

    return run, largest


def planned_reference(config) -> str | None:
    """The reference strategy a preference run holds (`plan.memory.REFERENCES`); None for SFT."""
    if config.train.objective != "dpo":
        return None
    strategy = config.preference.resolved_reference(config.lora.enabled)
    return "offloaded" if strategy == "model" and config.preference.offload_reference else strategy


def plan_config_and_model(args):
    """The config `fullshard plan` was given (a YAML file or a model name, or only `--section.key=value`
    overrides, as `fullshard train` takes them) and its model on meta, in `model.dtype`, LoRA applied
    where the config trains with it."""
    from .train.config import load_config, parse_overrides
    from .train.preflight import build_meta_model

    overrides = parse_overrides(args.overrides)
    model = overrides.setdefault("model", {})
    if args.trust_remote_code:
        model["trust_remote_code"] = True
    if args.source is not None and args.source.endswith((".yaml", ".yml")):
        config = load_config(args.source, overrides)
    else:
        if args.source is not None:
            model.setdefault("name_or_path", args.source)
        config = load_config(None, overrides)
    from .plan.towers import freeze

    meta = build_meta_model(config)
    freeze(meta, config.freeze)  # the table shows frozen towers as the run will have them
    if config.lora.enabled:
        from .lora import apply_lora

        meta = apply_lora(meta, config.lora.peft_fields())
    return config, meta


def joined_overrides(argv: list[str]) -> list[str]:
    """`--section.key value` as `--section.key=value`, so the value is not taken for the positional source."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "." in arg and "=" not in arg and i + 1 < len(argv)
                and not argv[i + 1].startswith("--")):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


# ---------------------------------------------------------------------------------------------- export


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fullshard export")
    parser.add_argument(
        "checkpoint", help="a checkpoint directory, or a save directory (its newest complete checkpoint)"
    )
    parser.add_argument("output", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="the dtype written (default: the dtype the fine-tuned source checkpoint is stored in)")
    args = parser.parse_args(argv)
    from .hf.offline import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)
    written = json.loads((Path(path) / "config.json").read_text()).get("dtype")
    print(f"[fullshard] exported {args.checkpoint} to {path} ({written})")
    return 0


# ---------------------------------------------------------------------------------------------- generate


def generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard generate", description=(
        "Complete prompts with a model sharded over --nproc ranks (fullshard.generate): a Hugging Face "
        "directory, or a training checkpoint (or a save directory: its newest complete checkpoint). The "
        "tokenizer's chat template, when it has one, wraps each prompt as a user turn."))
    parser.add_argument("path", help="a Hugging Face model directory or a training checkpoint")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--image", action=ImageOfPrompt, default=[], metavar="PATH", help=(
        "an image file for the --prompt before it (repeat for several; a vision-language model: read "
        "with its processor and chat template)"))
    parser.add_argument("--nproc", type=int, default=None, help="ranks the model is sharded over (default: one "
                        "per GPU, else 2)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser


class ImageOfPrompt(argparse.Action):
    """`--image PATH` belongs to the `--prompt` before it: (prompt index, absolute path)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if not getattr(namespace, "prompt", None):
            parser.error(f"--image {value}: give it after the --prompt it belongs to")
        namespace.image = [*namespace.image, (len(namespace.prompt) - 1, os.path.abspath(value))]


def cmd_generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        return fail(f"--nproc must be a positive integer, got {args.nproc}")
    missing = [path for _, path in args.image if not os.path.isfile(path)]
    if missing:
        return fail(f"--image {missing[0]}: no such file")
    images = [[path for index, path in args.image if index == i] for i in range(len(args.prompt))]
    if under_launcher():
        from .generation import generate_text

        log_dir = os.environ.get(LOG_DIR_ENV, os.path.join(os.getcwd(), ".fullshard-generate-logs"))
        return run_rank(lambda: generate_text(args.path, args.prompt, images=images,
                                              max_new_tokens=args.max_new_tokens,
                                              do_sample=args.sample, temperature=args.temperature,
                                              seed=args.seed), log_dir)
    import tempfile

    # the ranks get the line without --nproc, which torchrun's own parser would take for its option
    rank_args = ["generate", args.path, "--max-new-tokens", str(args.max_new_tokens), "--temperature",
                 str(args.temperature), "--seed", str(args.seed), *(["--sample"] if args.sample else [])]
    for prompt, files in zip(args.prompt, images):
        rank_args += [f"--prompt={prompt}", *(f"--image={file}" for file in files)]
    with tempfile.TemporaryDirectory(prefix="fullshard-generate-") as log_dir:
        return launch(args.nproc or default_nproc(), rank_args, log_dir, stop_timeout_s=5.0)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export, "generate": cmd_generate}


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
