"""The GPU benchmark in one command: a ~1B-parameter Llama trained in bf16 on one GPU by fullshard
(eager and compiled) and by its peers, side by side in one run.

    python bench/gpu.py                 # on a GPU machine: writes the "train-gpu" section of BENCHMARKS.md
    python bench/gpu.py --dry-run       # anywhere: a tiny model on CPU, every peer end to end, nothing written

Peers, each on the same model size, sequence length, batch and optimizer (AdamW, clip 1.0):
- fullshard: `FSDP2Engine({"mixed_precision": "bf16"})`, the path `fullshard train` takes;
- fullshard compiled: the same with `compile=True` (each block compiled before sharding);
- fully_shard: transformers' model with plain `fully_shard` per decoder layer and on the root, the
  loop a user writes by hand from the FSDP2 tutorial; also with each layer compiled first;
- torchtitan: its llama3 model with its own FSDP2 wrapping, when torchtitan can be imported
  (installed from PyPI first when missing; a machine with no registry reports why it is absent);
- the speed levers, compiled, each against the hand-written loop with the same levers: float8
  tensorwise and rowwise (torchao's recipes: `fsdp.float8` against `convert_to_float8_training`
  with torchao's float8 all-gather and scale precompute by hand) with no, selective or full
  activation checkpointing (`fsdp.activation_checkpointing` against torch's `checkpoint_wrapper`
  per layer, selective with torchtitan's per-op policy); `fullshard-compiled-float8-tensorwise-ac-
  selective` and `fully_shard-compiled-float8-tensorwise-ac-selective`, say. MFU stays against the
  bf16 peak. The dry run compiles with `aot_eager` (no C++ toolchain needed on CPU).

MFU is tokens/s x (6N + 12 L H S) / peak bf16 FLOP/s (`fullshard.train.metrics`). Each peer runs in
the same process one after another, with the allocator's peak reset between them. For fullshard's rows
the memory plan's per-rank estimate (`fullshard.train.memory.estimate_rank_bytes`, what `fullshard plan`
prints) stands beside `torch.cuda.max_memory_allocated` over the timed steps.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402

FULL = dict(model=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
                       tie_word_embeddings=False),
            micro=4, seq=2048, warmup=3, steps=10)
DRY = dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False),
           micro=2, seq=32, warmup=1, steps=2)
BASE_PEERS = ("fullshard", "fullshard-compiled", "fully_shard", "fully_shard-compiled", "torchtitan")
LEVERS = [(recipe, ac) for recipe in ("none", "tensorwise", "rowwise") for ac in ("none", "selective", "full")
          if (recipe, ac) != ("none", "none")]  # ("none", "none") is the compiled row above


def lever_peer(who: str, recipe: str, ac: str) -> str:
    return f"{who}-compiled" + (f"-float8-{recipe}" if recipe != "none" else "") + f"-ac-{ac}"


PEERS = BASE_PEERS + tuple(lever_peer(who, recipe, ac) for recipe, ac in LEVERS
                           for who in ("fullshard", "fully_shard"))
COMPILE_BACKEND = {"backend": "inductor"}  # the dry run sets aot_eager


def _llama(shape: dict, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # built on the host, then moved: every buffer lands on the device, whatever the version
    model = LlamaForCausalLM(LlamaConfig(**shape["model"], attn_implementation="sdpa", use_cache=False))
    return model.to(device)


def _fullshard(shape: dict, device: torch.device, compile: bool, float8: str = "none", ac: str = "none"):
    from fullshard import FSDP2Engine, create_optimizer

    engine = FSDP2Engine({"mixed_precision": "bf16", "float8": float8, "activation_checkpointing": ac,
                          **({"compile": COMPILE_BACKEND["backend"]} if compile else {})})
    model = _llama(shape, device)
    estimate = _memory_estimate(model, engine, shape, device)
    model = engine.prepare_model(model)
    return model, create_optimizer(model, lr=1e-4, fused=device.type == "cuda"), estimate


def _memory_estimate(model, engine, shape: dict, device: torch.device) -> int:
    """The plan's per-rank bytes for this loop: one micro-batch per step, the model's own (unchunked) loss."""
    from fullshard.train.memory import estimate_rank_bytes

    return estimate_rank_bytes(model, engine.config, 1, shape["micro"], shape["seq"], accumulation_steps=1,
                               device_type=device.type, loss_chunk_tokens=0)


def _plain_fully_shard(shape: dict, device: torch.device, compile: bool, float8: str = "none", ac: str = "none"):
    """The loop by hand: torchao's float8 conversion (torchtitan's filter: the decoder's Linears whose
    dimensions divide by 16, not the head), torch's checkpoint wrapper per layer, compile, fully_shard."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _llama(shape, device)
    if float8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if float8 == "tensorwise"
                  else Float8LinearConfig.from_recipe_name(float8))
        convert_to_float8_training(model.model.layers, config=config, module_filter_fn=lambda m, name: (
            isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index, layer in enumerate(model.model.layers):
        if ac != "none":
            from fullshard.fsdp import selective_context  # torchtitan's per-op policy

            layer = checkpoint_wrapper(layer, **({"context_fn": selective_context} if ac == "selective" else {}))
            model.model.layers[index] = layer
        if compile:
            layer.compile(**COMPILE_BACKEND)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if float8 == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return model, optimizer, None


def _torchtitan(shape: dict, device: torch.device, compile: bool):
    """torchtitan's llama3 at the same shape, wrapped the way its parallelize step does for FSDP only."""
    titan = _import_torchtitan(install=device.type == "cuda")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = shape["model"]
    args = titan.TransformerModelArgs(dim=m["hidden_size"], n_layers=m["num_hidden_layers"],
                                      n_heads=m["num_attention_heads"], n_kv_heads=m["num_key_value_heads"],
                                      vocab_size=m["vocab_size"], max_seq_len=shape["seq"],
                                      ffn_dim_multiplier=None, multiple_of=256)
    args.hidden_dim_override = m["intermediate_size"]  # ignored by versions that derive it; noted in the table
    torch.manual_seed(0)
    with device:
        model = titan.Transformer(args)
        model.init_weights()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    class Wrapped(torch.nn.Module):  # the loop below calls model(input_ids=, labels=).loss, as for HF models
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, labels):
            logits = self.inner(input_ids).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return type("Out", (), {"loss": loss})

    return Wrapped(), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda"), None


def _import_torchtitan(install: bool):
    try:
        module = importlib.import_module("torchtitan.models.llama3")
    except ImportError:
        if not install:
            raise
        # a bare GPU machine: fetch the peer from PyPI with torch pinned to the installed build
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        # (no retries: a machine with no registry says so in seconds, not minutes)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--retries", "0", "--timeout", "10", torch_pin,
                        "torchtitan"], check=False, timeout=900)
        module = importlib.import_module("torchtitan.models.llama3")
    return module


BUILDERS = {
    "fullshard": lambda s, d: _fullshard(s, d, compile=False),
    "fullshard-compiled": lambda s, d: _fullshard(s, d, compile=True),
    "fully_shard": lambda s, d: _plain_fully_shard(s, d, compile=False),
    "fully_shard-compiled": lambda s, d: _plain_fully_shard(s, d, compile=True),
    "torchtitan": lambda s, d: _torchtitan(s, d, compile=False),
}
for _recipe, _ac in LEVERS:
    for _who, _build in (("fullshard", _fullshard), ("fully_shard", _plain_fully_shard)):
        BUILDERS[lever_peer(_who, _recipe, _ac)] = functools.partial(_build, compile=True, float8=_recipe, ac=_ac)


def measure(peer: str, shape: dict, device: torch.device) -> dict:
    """Warm up, then time `steps` optimizer steps of one micro-batch each; tokens/s, MFU, peak memory."""
    from fullshard.optim import clip_grad_norm
    from fullshard.train.metrics import flops_per_token, peak_device_flops

    model, optimizer, estimate = BUILDERS[peer](shape, device)
    ids = torch.randint(0, shape["model"]["vocab_size"], (shape["micro"], shape["seq"]), device=device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(shape["warmup"]):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(shape["steps"]):
        loss = step()
    _sync(device)
    tokens_per_s = shape["steps"] * shape["micro"] * shape["seq"] / (time.perf_counter() - start)
    m = shape["model"]
    params = sum(p.numel() for p in model.parameters())
    embedding = m["vocab_size"] * m["hidden_size"]
    peak = peak_device_flops()
    result = {"peer": peer, "params": params, "tokens_per_s": tokens_per_s, "loss": loss,
              "mfu": tokens_per_s * flops_per_token(params - embedding, m["num_hidden_layers"], m["hidden_size"],
                                                    shape["seq"]) / peak if peak else None,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "estimate_gib": estimate / 2**30 if estimate is not None else None}
    model = optimizer = None  # the closure above holds them: drop both before collecting
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(peers: list[str], dry_run: bool) -> list[dict]:
    from fullshard.distributed import init_distributed

    shape = DRY if dry_run else FULL
    device = init_distributed("cpu" if dry_run else None)
    results = []
    for peer in peers:
        try:
            results.append(measure(peer, shape, device))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a row saying why, not a crash
            results.append({"peer": peer, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
        print(results[-1], flush=True)
    return results


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["peer"] == "fullshard" and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["peer"], "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        rows.append([r["peer"], f"{r['params'] / 1e9:.2f}B", f"{r['tokens_per_s']:,.0f}", ratio,
                     _against_hand_written(r, results),
                     f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a",
                     f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a", _estimate_cell(r), ""])
    return markdown_table(["peer", "params", "tokens/s", "x fullshard", "x by hand", "MFU", "peak GiB",
                           "plan's estimate GiB (/ peak)", "note"], rows)


def _against_hand_written(r: dict, results: list[dict]) -> str:
    """A fullshard row's tokens/s over the hand-written loop's with the same levers (same run)."""
    if not r["peer"].startswith("fullshard"):
        return "-"
    twin = next((t for t in results if t["peer"] == "fully_shard" + r["peer"][len("fullshard"):]
                 and "error" not in t), None)
    return f"{r['tokens_per_s'] / twin['tokens_per_s']:.2f}" if twin else "-"


def _estimate_cell(r: dict) -> str:
    if r.get("estimate_gib") is None:
        return "-"
    if not r.get("peak_mem_gib"):
        return f"{r['estimate_gib']:.1f}"
    return f"{r['estimate_gib']:.1f} ({r['estimate_gib'] / r['peak_mem_gib']:.2f})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of the peers above")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers {unknown}; known: {list(PEERS)}")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (use --dry-run to check it end to end on CPU)")
    if args.dry_run:
        COMPILE_BACKEND["backend"] = "aot_eager"
    results = run(peers, args.dry_run)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.dry_run:
        s = FULL
        import torch.distributed as dist

        body = (f"One {torch.cuda.get_device_name()} (torch {torch.__version__}, process group "
                f"{dist.get_backend() if dist.is_initialized() else 'none'}), Llama-shaped model (random weights), micro batch {s['micro']} x "
                f"{s['seq']} tokens, bf16 compute, fp32 master weights, AdamW (fused), clip 1.0, {s['steps']} timed "
                f"steps after {s['warmup']} warm-up. Ratios are tokens/s against fullshard (eager) in the same run.\n\n")
        write_section("train-gpu", body + table(results))
    return results


if __name__ == "__main__":
    main()
