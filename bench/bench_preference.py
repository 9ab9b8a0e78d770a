"""A DPO step on a Llama with a 128K vocabulary: fullshard against TRL's `DPOTrainer`, and the
memory of fullshard's reference strategies.

Side by side in one run, fp32 on CPU (gloo, one thread per rank), the same pairs (a prompt of
PROMPT tokens, two completions of COMPLETION tokens, the byte tokenizer's ids), ROWS pairs per
rank and step, sigmoid loss, AdamW:

- TRL 1.16's `DPOTrainer` at world 1: its `compute_loss` (the policy and its reference copy
  through TRL's fused head, which projects only the completion positions, in tiles), backward,
  the optimizer's step; the reference a second model that TRL loads;
- fullshard at world 1, `preference.reference` = `model` (a frozen sharded copy), `precompute`
  (the reference's log-probs computed before the step), and under LoRA `adapter` (the adapters
  off) against `model`; the step is `Preference.loss_sum` (`token_logprobs`' path, the head a
  chunk of 1,024 tokens at a time over every position), backward, the optimizer's step;
- fullshard at world 2 with `reference=model`: each rank its own ROWS pairs.

Peak memory is torch's MemTracker's peak of live tensor bytes (FSDPMemTracker for fullshard's
sharded models; the optimizer tracked too) over one step after a warm-up step, plus the frozen
reference's weights (a rank's shards), resident all step: exact whatever the machine's load.
tokens/s: the median of interleaved timed steps, the pairs'
tokens (both sequences, prompts included) over all ranks.

    .venv/bin/python bench/bench_preference.py      # a few minutes on 2 CPU cores; writes BENCHMARKS.md
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import markdown_table, write_section  # noqa: E402
from bench.variants import peak_and_speed_cells, run_variants, time_interleaved  # noqa: E402

MODEL = dict(vocab_size=128_256, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
ROWS, PROMPT, COMPLETION, ROUNDS, PAIRS = 4, 200, 40, 3, 16
SEQ = 2 * (PROMPT + COMPLETION)  # one pair per row, both sequences
LORA = dict(r=8, lora_alpha=16.0, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def write_inputs(root: Path) -> None:
    """The model (random weights, saved: TRL loads its reference from the path) and the pairs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.data.builtin import byte_tokenizer

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefghij ") for _ in range(n))  # noqa: E731
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(PAIRS):  # EOS ends each completion: COMPLETION tokens
            f.write(json.dumps({"prompt": text(PROMPT), "chosen": text(COMPLETION - 1),
                                "rejected": text(COMPLETION - 1)}) + "\n")


def _fullshard_batch(root: Path, rank: int):
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.prepare import prepare
    from fullshard.data.rows import Rows
    from fullshard.train import load_config

    section = load_config(None, ["--data.format=preference", "--train.objective=dpo", f"--data.seq_len={SEQ}",
                                 "--data.packing=false", f"--data.path={root}/pairs.jsonl"]).data
    prepared = prepare(section, byte_tokenizer(), str(root / "pairs.jsonl"), root / "cache")
    return Rows(prepared.dataset).take(range(rank * ROWS, (rank + 1) * ROWS))


def _peak(model, optimizer, step, reference=None) -> int:
    """The peak of live tensor bytes over `step()`: FSDPMemTracker on a sharded model, MemTracker on
    a plain one; plus the frozen reference's weights (this rank's shards), resident all step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        step()
    weights = [p.to_local() if hasattr(p, "to_local") else p for p in (reference.parameters() if reference else ())]
    resident = sum(t.untyped_storage().nbytes() for t in weights)
    return resident + max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def _fullshard_variant(root: Path, reference: str, lora: bool) -> dict:
    import torch

    from fullshard import FSDP2Engine, create_optimizer, from_pretrained
    from fullshard.fsdp import reshard_all
    from fullshard.objectives.preference import AdapterReference, ModelReference, Preference, pair_count
    from fullshard.train.config import PreferenceSection

    engine = FSDP2Engine({"mixed_precision": "fp32"})
    torch.manual_seed(0)
    model = from_pretrained(str(root / "model"), engine=engine, lora=dict(LORA) if lora else None).train()
    batch = _fullshard_batch(root, torch.distributed.get_rank())
    frozen = None
    if reference == "model":
        frozen = from_pretrained(str(root / "model"), engine=engine)
        ref = ModelReference(frozen)
    elif reference == "adapter":
        ref = AdapterReference()
    else:  # precompute: the starting weights' log-probs, computed before training
        with torch.no_grad():
            table = Preference(PreferenceSection(), None).sequence_logps(model, batch)[0].detach()
        reshard_all(model)  # a no-grad forward leaves the root unit gathered
        ref = lambda policy, batch, objective, t=table: t  # noqa: E731
    objective = Preference(PreferenceSection(), ref)
    optimizer = create_optimizer(model, lr=1e-6, eps=1e-8)
    pairs = pair_count(batch)

    def step(seed):
        loss, _ = objective.loss_sum(model, batch)
        (loss / pairs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) / pairs

    step(0)  # warm-up: the optimizer state exists from here on
    return {"step": step, "times": [], "tokens": int((batch["pair_role"] > 0).sum()),
            "measure": lambda: _peak(model, optimizer, lambda: step(1), frozen)}


def _trl_variant(root: Path) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=ROWS, learning_rate=1e-6, beta=0.1,
                     loss_type=["sigmoid"], report_to=[], use_cpu=True, bf16=False, fp16=False, max_length=None,
                     gradient_checkpointing=False, save_strategy="no", optim="adamw_torch", adam_epsilon=1e-8)
    model = AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(str(root / "model")),
                         train_dataset=load_dataset("json", data_files=str(root / "pairs.jsonl"))["train"])
    optimizer = trainer.create_optimizer()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    model.train()

    def step(seed):
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step(0)
    return {"step": step, "times": [], "tokens": int(batch["attention_mask"].sum()),
            "measure": lambda: _peak(model, optimizer, lambda: step(1), trainer.ref_model)}


VARIANTS_1 = {"TRL DPOTrainer (reference model)": ("trl",), "fullshard, reference=model": ("model", False),
              "fullshard, reference=precompute": ("precompute", False),
              "fullshard LoRA, reference=model": ("model", True), "fullshard LoRA, reference=adapter": ("adapter", True)}


def _world_1(root: str) -> dict:
    runs = {name: _trl_variant(Path(root)) if spec == ("trl",) else _fullshard_variant(Path(root), *spec)
            for name, spec in VARIANTS_1.items()}
    return time_interleaved(runs, ROUNDS, lambda run, out: run.update(last=out))


def _world_2(root: str) -> dict:
    runs = {"fullshard world 2, reference=model": _fullshard_variant(Path(root), "model", False)}
    return time_interleaved(runs, ROUNDS, lambda run, out: run.update(last=out))


def main() -> None:
    from functools import partial

    root = Path(tempfile.mkdtemp(prefix="bench_preference-"))
    write_inputs(root)
    one, load_before, _ = run_variants(partial(_world_1, str(root)), 1)
    two, _, load_after = run_variants(partial(_world_2, str(root)), 2)
    trl = one["TRL DPOTrainer (reference model)"]
    rows = []
    for world, runs in ((1, one), (2, two)):
        for name, run in runs.items():
            peak, speed = peak_and_speed_cells(run, trl, run["tokens"] * world, trl["tokens"])
            rows.append([name, world, *peak, *speed, f"{run['last']:.6f}"])
            print(rows[-1], flush=True)
    logits_mib = ROWS * SEQ * MODEL["vocab_size"] * 4 / 2**20
    body = (f"One DPO step (sigmoid, beta 0.1, AdamW) of a Llama with a {MODEL['vocab_size']:,}-token vocabulary, "
            f"hidden size {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, fp32 on CPU (gloo, one "
            f"thread per rank): {ROWS} pairs per rank, each a {PROMPT}-token prompt with two {COMPLETION}-token "
            f"completions ({ROWS * SEQ:,} tokens a rank; their whole fp32 logits would be {logits_mib:,.0f} MiB). "
            "TRL 1.16's `DPOTrainer` (its `compute_loss`, backward, optimizer step; its reference a second "
            "loaded model; its fused head projects only completion positions) against fullshard's "
            "`Preference` objective on FSDP2 (the head over every position, 1,024-token chunks) with each "
            "reference strategy. Peak = MemTracker's peak of live tensor bytes on a rank (FSDPMemTracker "
            "for sharded models, the optimizer state counted) over a step after a warm-up step, plus the "
            "frozen reference's weights (the rank's shards), resident all step. "
            f"tokens/s: median of {ROUNDS} steps per variant, taking turns, all ranks' pair tokens. "
            "The last column is the last timed step's loss (the same weights and pairs at world 1; world 2 "
            "trains on other pairs too).\n\n"
            f"Load average (1, 5, 15 min): {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} "
            f"before, {load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after, on {os.cpu_count()} "
            "cores shared with other work: the memory columns are exact, the speed ratios are noisy.\n\n")
    body += markdown_table(["step", "world", "peak MiB", "x TRL", "tokens/s", "x TRL", "loss"], rows)
    write_section("preference", body)


if __name__ == "__main__":
    main()
