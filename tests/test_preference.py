"""Preference training (`train.objective=dpo`) against TRL's `DPOTrainer`, and across layouts.

TRL runs in this process: fp32, the records in file order (a sequential sampler), constant learning
rate, no weight decay, AdamW (0.9, 0.999) non-fused, clipping 1.0, no gradient checkpointing, its
raw loss of each step read from `compute_loss` (its log rounds to 4 digits). fullshard runs `fullshard.train.train` at world 2 in one spawned group, for
sigmoid, ipo and hinge (one pair per row), sigmoid packed (whole pairs per row), and under LoRA
the adapter-disabled reference against a frozen base copy (`reference=model`, the same weights).
"""

import json
import random

import pytest
import torch

from fullshard.testing import run_distributed

PAIRS, STEPS, BATCH = 12, 3, 4
TOL = 1e-5


def write_pairs(path, n=PAIRS, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b),
                                "rejected": "x" * rng.randint(4, 6)}) + "\n")


def write_base(directory):
    """A tiny Llama with the built-in byte tokenizer, as a Hub-layout directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.data.builtin import byte_tokenizer

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def trl_losses(base, data, out, loss_type: str) -> list[float]:
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        losses: list

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            self.losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                     lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                     adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", bf16=False, fp16=False,
                     gradient_checkpointing=False, loss_type=[loss_type], beta=0.1, report_to=[], use_cpu=True,
                     logging_steps=1, save_strategy="no", seed=42, max_length=None, dataloader_drop_last=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    trainer = InOrder(model=model, args=args, train_dataset=load_dataset("json", data_files=str(data))["train"],
                      processing_class=AutoTokenizer.from_pretrained(str(base)))
    trainer.losses = []
    trainer.train()
    return trainer.losses


def _fullshard_runs(root: str) -> dict:
    from fullshard.train import load_config, train

    def run(name, *extra):
        config = load_config(None, [
            f"--model.name_or_path={root}/base", f"--data.path={root}/pairs.jsonl", "--data.format=preference",
            "--train.objective=dpo", "--data.seq_len=48", f"--train.steps={STEPS}", "--train.micro_batch_size=1",
            f"--train.global_batch_size={BATCH}", f"--train.output_dir={root}/{name}", "--checkpoint.export=false",
            "--train.plot=false", f"--data.cache_dir={root}/cache", "--data.shuffle=false", "--data.eval_fraction=0",
            "--optim.lr=1e-3", "--optim.schedule=constant", "--optim.warmup_steps=0", "--optim.weight_decay=0",
            "--optim.eps=1e-8", "--optim.betas=[0.9,0.999]", "--train.max_norm=1.0", "--train.loss_chunk_tokens=16",
            "--data.packing=false",
            *extra])
        return [summary_loss for _, summary_loss in sorted(train(config)["losses"].items())]

    out = {loss: run(loss, f"--preference.loss_type={loss}") for loss in ("sigmoid", "ipo", "hinge")}
    # packed: two whole pairs per row, two rows per step: the same pairs per step as one per row
    out["packed"] = run("packed", "--data.packing=true", "--data.seq_len=40", f"--train.global_batch_size={BATCH // 2}")
    lora = ("--lora.r=4", "--lora.target_modules=[q_proj,v_proj]", "--lora.save_adapter=false")
    out["lora_adapter"] = run("lora_adapter", *lora, "--preference.reference=adapter")
    out["lora_model"] = run("lora_model", *lora, "--preference.reference=model")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    write_base(root / "base")
    write_pairs(root / "pairs.jsonl")
    ours = run_distributed(_fullshard_runs, 2, str(root))[0]
    theirs = {loss: trl_losses(root / "base", root / "pairs.jsonl", root / f"trl-{loss}", loss)
              for loss in ("sigmoid", "ipo", "hinge")}
    return ours, theirs


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_world_2_matches_trl_step_by_step(runs, loss_type):
    ours, theirs = runs
    assert len(theirs[loss_type]) == STEPS
    diffs = [abs(a - b) for a, b in zip(ours[loss_type], theirs[loss_type])]
    assert max(diffs) <= TOL, (ours[loss_type], theirs[loss_type])
    assert ours[loss_type][-1] != ours[loss_type][0]  # it trained


def test_packed_pairs_equal_one_pair_per_row(runs):
    ours, _ = runs
    assert max(abs(a - b) for a, b in zip(ours["packed"], ours["sigmoid"])) <= TOL, (ours["packed"], ours["sigmoid"])


def test_lora_adapter_reference_equals_a_frozen_base_copy(runs):
    ours, _ = runs
    assert max(abs(a - b) for a, b in zip(ours["lora_adapter"], ours["lora_model"])) <= TOL
    assert abs(ours["lora_adapter"][0] - 0.6931472) <= TOL  # step 1: policy = reference, loss log 2
