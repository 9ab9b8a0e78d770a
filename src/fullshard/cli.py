"""The `fullshard` command: `train`, `plan` and `export`.

`fullshard train` checks the whole config in the launching process, then, when it was not
started by torchrun, starts itself under torchrun on `--nproc` local processes, so that a config
error is one message before any rank exists rather than N tracebacks after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

USAGE = """fullshard train [CONFIG.yaml] [--nproc N] [--section.key=value ...]
       fullshard plan MODEL_OR_CONFIG [--nproc N] [--micro-batch-size B] [--seq-len S]
       fullshard export CHECKPOINT_DIR OUTPUT_DIR [--dtype bf16|fp16|fp32]"""


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """One process per GPU, or 2 CPU processes where there is none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def fail(message: str) -> int:
    print(f"fullshard: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------- train


def split_train_args(argv: list[str]) -> tuple[str | None, int | None, list[str]]:
    config_path, nproc, overrides = None, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" or arg.startswith("--nproc="):
            raw = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"--nproc must be a positive integer, got {raw!r}")
            nproc = int(raw)
            continue
        if not arg.startswith("-") and config_path is None and not overrides:
            config_path = arg
        else:
            overrides.append(arg)
        i += 1
    return config_path, nproc, overrides


def cmd_train(argv: list[str]) -> int:
    from .train.config import ConfigError, load_config

    try:
        config_path, nproc, overrides = split_train_args(argv)
        config = load_config(config_path, overrides)
        if under_launcher():
            world = int(os.environ["WORLD_SIZE"])
        else:
            world = nproc or config.train.nproc or default_nproc()
        config.accumulation_steps(world)
    except (ConfigError, ValueError) as err:
        return fail(str(err))
    if under_launcher() or world == 1:
        from .train import train

        train(config)
        return 0
    # the ranks take their world size from torchrun, so --nproc is not passed on (torchrun's own
    # parser would also read it as an abbreviation of its --nproc-per-node)
    forwarded = ([config_path] if config_path else []) + overrides
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "fullshard.cli", "train", *forwarded]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[fullshard] launching {world} processes: torchrun --standalone --nproc_per_node={world} "
          f"-m fullshard.cli train {' '.join(forwarded)}", flush=True)
    return subprocess.call(command, env=env)


# ---------------------------------------------------------------------------------------------- plan


def build_meta_model(source: str):
    """A model on the meta device (no weights read) and the training settings that go with it.

    `source` is a YAML config (its model section and settings), a built-in model name, or a
    local HF directory.
    """
    from .loading import meta_init
    from .train.config import BUILTIN_MODELS, load_config
    from .train.data import byte_tokenizer

    if source.endswith((".yaml", ".yml")):
        config = load_config(source)
    else:
        config = load_config(None, {"model": {"name_or_path": source}})
    name = config.model.name_or_path
    with meta_init():
        if name in BUILTIN_MODELS:
            from transformers import LlamaConfig, LlamaForCausalLM

            hf_config = LlamaConfig(vocab_size=len(byte_tokenizer()), max_position_embeddings=config.data.seq_len,
                                    **BUILTIN_MODELS[name])
            model = LlamaForCausalLM(hf_config)
        else:
            from .loading import init_empty_model
            from transformers import AutoConfig

            model = init_empty_model(AutoConfig.from_pretrained(name))
    return model, config


def cmd_plan(argv: list[str]) -> int:
    from .dtypes import DTYPES
    from .plan import build_plan
    from .train.config import ConfigError
    from .train.memory import estimate_memory

    parser = argparse.ArgumentParser(prog="fullshard plan")
    parser.add_argument("source", help="a YAML config, a built-in model name, or a local HF directory")
    parser.add_argument("--nproc", type=int, default=None, help="ranks the model is sharded over")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        model, config = build_meta_model(args.source)
    except (ConfigError, ValueError, OSError) as err:
        return fail(str(err))
    nproc = args.nproc or config.train.nproc or default_nproc()
    dp_replicate = config.fsdp.dp_replicate
    if nproc % dp_replicate:
        return fail(f"--nproc {nproc} is not divisible by fsdp.dp_replicate={dp_replicate}")
    shard_size = nproc // dp_replicate
    plan = build_plan(model, config.fsdp.plan)
    precision = config.fsdp.mixed_precision
    compute = DTYPES[precision]
    micro = args.micro_batch_size or config.train.micro_batch_size
    seq_len = args.seq_len or config.data.seq_len
    estimate = estimate_memory(model, plan, shard_size, micro, seq_len, compute, config.fsdp.activation_checkpointing,
                               config.optim.name)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, sharded over {shard_size} "
          f"rank(s) x {dp_replicate} replica(s)\n")
    print(plan.describe(model, shard_size))
    print(f"\nper-rank memory estimate (micro batch {micro} x {seq_len} tokens, compute {precision}, "
          f"activation checkpointing {config.fsdp.activation_checkpointing}, {config.optim.name}):")
    print(estimate.describe())
    return 0


# ---------------------------------------------------------------------------------------------- export


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fullshard export")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a save directory (its newest complete checkpoint)")
    parser.add_argument("output", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    args = parser.parse_args(argv)
    from .checkpoint import export_checkpoint

    try:
        path = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)
    except (FileNotFoundError, ValueError, KeyError) as err:
        return fail(str(err))
    print(f"[fullshard] exported {args.checkpoint} to {path}")
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
