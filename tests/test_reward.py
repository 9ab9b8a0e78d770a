"""Reward models (`train.objective=reward`) against TRL's `RewardTrainer`, packed and unpacked.

TRL runs in this process: fp32, the records in file order (a sequential sampler), constant learning
rate, no weight decay, AdamW (0.9, 0.999), clipping 1.0, its raw loss of each step read from
`compute_loss`; the records carry a `margin` and `center_rewards_coefficient` is set, so both terms
of its loss are compared. Both start from one sequence-classification checkpoint (a head TRL and
fullshard would otherwise draw apart). fullshard runs `fullshard.train.train` at world 2 in one
spawned group: one pair per row (exported, the export's scores read by transformers against TRL's
model), packed (two whole pairs per row), at tp 2, a learning run on held-out pairs, a causal-LM
checkpoint whose score head is new, and stage two (reward, DPO) from an SFT run's checkpoint
against the same from its export.
"""

import json
import random

import pytest
import torch
from harness.trl_peer import in_order

from fullshard.testing import run_distributed

PAIRS, STEPS, BATCH, CENTER = 12, 3, 4, 0.01
TOL = 1e-5


def write_pairs(path, n=PAIRS, seed=0, margin=True):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            record = {"prompt": f"{a}+{b}=", "chosen": str(a + b),
                      "rejected": "x" * rng.randint(4, 6)}
            if margin:
                record["margin"] = rng.choice([0.0, 0.5, 1.25])
            f.write(json.dumps(record) + "\n")


def write_bases(root):
    """A tiny Llama with the built-in byte tokenizer as a one-output sequence-classification
    checkpoint (`base`) and as a causal LM (`causal`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from fullshard.data.builtin import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, num_labels=1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    for name, cls in (("base", LlamaForSequenceClassification), ("causal", LlamaForCausalLM)):
        torch.manual_seed(0)
        cls(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)


def sequences(data) -> list[list[int]]:
    """Every record's prompt + chosen and prompt + rejected, tokenized as TRL does (EOS
    appended)."""
    from fullshard.data.builtin import byte_tokenizer

    tok = byte_tokenizer()
    out = []
    for line in open(data):
        record = json.loads(line)
        out += [tok(record["prompt"] + record[k] + tok.eos_token)["input_ids"]
                for k in ("chosen", "rejected")]
    return out


def scores_of(model, data) -> torch.Tensor:
    """transformers' score of each sequence alone."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([ids])).logits[:, 0] for ids in sequences(data)])


def trl_run(base, data, out) -> tuple[list[float], torch.Tensor]:
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    InOrder = in_order(RewardTrainer)

    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS,
                        learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                        optim="adamw_torch", bf16=False, fp16=False, gradient_checkpointing=False,
                        center_rewards_coefficient=CENTER, report_to=[], use_cpu=True,
                        logging_steps=1, save_strategy="no", seed=42, max_length=None,
                        dataloader_drop_last=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(base), dtype=torch.float32)
    records = load_dataset("json", data_files=str(data))["train"]
    trainer = InOrder(model=model, args=args, train_dataset=records,
                      processing_class=AutoTokenizer.from_pretrained(str(base)))
    trainer.losses = []
    trainer.train()
    return trainer.losses, scores_of(trainer.model.eval(), data)


def reward_argv(root, name: str, *extra) -> list[str]:
    return [f"--model.name_or_path={root}/base", f"--data.path={root}/pairs.jsonl",
            "--data.format=preference", "--train.objective=reward",
            f"--reward.center_coefficient={CENTER}", "--data.seq_len=48", f"--train.steps={STEPS}",
            "--train.micro_batch_size=1", f"--train.global_batch_size={BATCH}",
            f"--train.output_dir={root}/{name}", "--checkpoint.export=false", "--train.plot=false",
            f"--data.cache_dir={root}/cache", "--data.shuffle=false", "--data.eval_fraction=0",
            "--optim.lr=1e-3", "--optim.schedule=constant", "--optim.warmup_steps=0",
            "--optim.weight_decay=0", "--optim.eps=1e-8", "--optim.betas=[0.9,0.999]",
            "--train.max_norm=1.0", "--data.packing=false", *extra]


# stage two from the SFT run's checkpoint (the causal LM it started from as the model) and from
# that checkpoint's export, for the reward model (its score head new either way) and DPO
STAGE_TWO = {"reward": (), "dpo": ("--train.objective=dpo", "--reward.center_coefficient=0")}


def stage_two(root, objective: str, start: str) -> tuple[str, ...]:
    source = ((f"--model.name_or_path={root}/causal", f"--checkpoint.init_from={root}/sft")
              if start == "checkpoint" else (f"--model.name_or_path={root}/sft-hf",))
    return (*STAGE_TWO[objective], *source)


def _fullshard_runs(root: str) -> dict:
    from fullshard.train import load_config, train

    def run(name, *extra, summary=False):
        result = train(load_config(None, reward_argv(root, name, *extra)))
        return result if summary else [loss for _, loss in sorted(result["losses"].items())]

    out = {"plain": run("plain", "--checkpoint.export=true")}
    # packed: two whole pairs per row, two rows per step: the same pairs per step as one per row
    out["packed"] = run("packed", "--data.packing=true", "--data.seq_len=40",
                        f"--train.global_batch_size={BATCH // 2}")
    out["tp2"] = run("tp2", "--parallel.tp_size=2")  # dp 1: a step's four pairs one after another
    # learning: held-out pairs ranked, from a causal LM whose score head is new
    learned = run("learn", f"--model.name_or_path={root}/causal", f"--data.path={root}/learn.jsonl",
                  "--data.eval_fraction=0.25", "--train.steps=12", "--optim.lr=3e-3",
                  "--train.global_batch_size=8", "--data.packing=true",
                  "--reward.center_coefficient=0", summary=True)
    out["learn"] = {k: v for k, v in learned.items() if k.startswith("eval_")}
    out["new_head"] = _new_head(root)
    for objective in STAGE_TWO:
        for start in ("checkpoint", "export"):
            name = f"{objective}_from_{start}"
            out[name] = run(name, *stage_two(root, objective, start))
    return out


def sft_and_export(root) -> None:
    """Two SFT steps of the causal LM on the built-in corpus, in this process; its checkpoint
    exported as a Hub directory (`sft-hf`)."""
    from fullshard import export_hf
    from fullshard.train import load_config, train

    train(load_config(None, [f"--model.name_or_path={root}/causal", "--train.steps=2",
                             "--data.seq_len=48", f"--train.output_dir={root}/sft",
                             f"--data.cache_dir={root}/cache-sft", "--checkpoint.export=false",
                             "--train.plot=false", "--optim.lr=1e-2"]))
    export_hf(root / "sft" / "checkpoints", root / "sft-hf")


def _new_head(root: str) -> dict:
    """From the causal LM: the base's weights as stored, the score head drawn from the seed
    whole."""
    from torch.distributed.tensor import DTensor

    from fullshard.engine import FSDP2Engine
    from fullshard.objectives.reward import load_reward_model

    model = load_reward_model(f"{root}/causal", FSDP2Engine(), torch.float32, seed=7,
                              pad_token_id=256)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
            if k in ("score.weight", "model.embed_tokens.weight")}
    return {"full": full, "pad": model.config.pad_token_id, "class": type(model).__name__}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    write_bases(root)
    write_pairs(root / "pairs.jsonl")
    write_pairs(root / "learn.jsonl", n=128, seed=1, margin=False)
    sft_and_export(root)
    ours = run_distributed(_fullshard_runs, 2, str(root))[0]
    theirs = trl_run(root / "base", root / "pairs.jsonl", root / "trl")
    return root, ours, theirs


def test_reward_world_2_matches_trl_step_by_step(runs):
    _, ours, (losses, _) = runs
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(ours["plain"], losses)) <= TOL, (ours["plain"], losses)
    assert ours["plain"][-1] != ours["plain"][0]  # it trained


def test_export_loads_as_sequence_classification_with_trls_scores(runs):
    from transformers import AutoModelForSequenceClassification

    root, _, (_, trl_scores) = runs
    exported = AutoModelForSequenceClassification.from_pretrained(str(root / "plain" / "hf"),
                                                                  dtype=torch.float32)
    assert exported.config.num_labels == 1 and exported.config.pad_token_id == 256
    ours = scores_of(exported.eval(), root / "pairs.jsonl")
    assert torch.allclose(ours, trl_scores, atol=1e-4, rtol=0), (ours - trl_scores).abs().max()


@pytest.mark.parametrize("layout", ["packed", "tp2"])
def test_packed_and_tp_equal_the_plain_run(runs, layout):
    _, ours, _ = runs
    diffs = [abs(a - b) for a, b in zip(ours[layout], ours["plain"])]
    assert max(diffs) <= TOL, (ours[layout], ours["plain"])


def test_reward_model_separates_held_out_pairs(runs):
    _, ours, _ = runs
    assert ours["learn"]["eval_accuracy"] >= 0.9, ours["learn"]
    assert ours["learn"]["eval_margin"] > 0, ours["learn"]


def test_causal_lm_checkpoint_gets_a_new_score_head_from_the_seed(runs):
    from transformers import LlamaForCausalLM

    root, ours, _ = runs
    head = ours["new_head"]
    assert head["class"].endswith("LlamaForSequenceClassification") and head["pad"] == 256
    drawn = torch.empty(1, 32).normal_(0, 0.02, generator=torch.Generator().manual_seed(7))
    assert torch.equal(head["full"]["score.weight"], drawn)
    causal = LlamaForCausalLM.from_pretrained(str(root / "causal"), dtype=torch.float32)
    assert torch.equal(head["full"]["model.embed_tokens.weight"], causal.model.embed_tokens.weight)


@pytest.mark.parametrize("objective", list(STAGE_TWO))
def test_stage_two_from_an_sft_checkpoint_equals_it_from_the_export(runs, objective):
    """`checkpoint.init_from` an SFT run's checkpoint: a reward model reads its base (not its LM
    head) and draws the score head from the seed as from the export; DPO reads it whole (the
    reference being those weights). Both equal the run from the checkpoint's Hub export."""
    _, ours, _ = runs
    checkpoint, export = (ours[f"{objective}_from_{start}"] for start in ("checkpoint", "export"))
    assert len(checkpoint) == STEPS and checkpoint[-1] != checkpoint[0]
    assert max(abs(a - b) for a, b in zip(checkpoint, export)) <= 1e-6, (checkpoint, export)


def test_an_sft_checkpoint_into_a_reward_model_passes_preflight(runs):
    """What `fullshard train` checks before launch: the SFT checkpoint fits the reward model but
    for its LM head (not read) and the new score head; a checkpoint of another model still does
    not fit; its optimizer state, which has none for the new head, is refused in one line."""
    from fullshard.train import ConfigError, load_config
    from fullshard.train.preflight import check_before_launch

    root, _, _ = runs
    argv = reward_argv(root, "never", *stage_two(root, "reward", "checkpoint"))
    model = check_before_launch(load_config(None, argv), 2)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    other = reward_argv(root, "never", f"--checkpoint.init_from={root}/sft",
                        "--model.name_or_path=tiny-llama")  # wider: shapes differ
    with pytest.raises(ConfigError, match="does not fit"):
        check_before_launch(load_config(None, other), 2)
    with pytest.raises(ConfigError, match="set checkpoint.init_optimizer=false"):
        check_before_launch(load_config(None, [*argv, "--checkpoint.init_optimizer=true"]), 2)


@pytest.mark.parametrize("overrides, message", [
    (["--train.objective=reward"], "set data.format=preference"),
    (["--train.objective=reward", "--data.format=preference", "--parallel.pp_size=2"],
     "pp_size is not supported"),
    (["--train.objective=reward", "--data.format=preference", "--lora.r=4"],
     "lora.r is not supported"),
])
def test_reward_combinations_that_do_not_fit_are_one_line(overrides, message):
    from fullshard.train import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_classification_checkpoint_with_more_outputs_is_refused(tmp_path):
    from transformers import LlamaConfig

    from fullshard.train import ConfigError, load_config
    from fullshard.train.preflight import build_meta_model

    config = LlamaConfig(num_labels=3, architectures=["LlamaForSequenceClassification"])
    config.save_pretrained(tmp_path)
    config = load_config(None, [f"--model.name_or_path={tmp_path}", "--train.objective=reward",
                                "--data.format=preference"])
    with pytest.raises(ConfigError, match="SequenceClassification checkpoint with 3 outputs"):
        build_meta_model(config)


def test_a_bad_margin_names_file_and_line(tmp_path):
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.prepare import prepare
    from fullshard.train import ConfigError, load_config

    path = tmp_path / "pairs.jsonl"
    record = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path.write_text(json.dumps(record | {"margin": 1.0}) + "\n"
                    + json.dumps(record | {"margin": "high"}) + "\n")
    section = load_config(None, ["--data.format=preference", "--train.objective=reward",
                                 f"--data.path={path}"]).data
    with pytest.raises(ConfigError, match=r"pairs\.jsonl.*2.*margin that is not a finite number"):
        prepare(section, byte_tokenizer(), str(path), tmp_path / "cache")
