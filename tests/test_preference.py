"""Preference training (`train.objective=dpo`) against TRL's `DPOTrainer` and `ORPOTrainer`, and across layouts.

TRL runs in this process: fp32, the records in file order (a sequential sampler), constant learning
rate, no weight decay, AdamW (0.9, 0.999) non-fused, clipping 1.0, no gradient checkpointing, its
raw loss of each step read from `compute_loss` (its log rounds to 4 digits). fullshard runs
`fullshard.train.train` at world 2 in one spawned group (one pair per row, two micro-batches per
rank: ORPO's and RPO's token means span them), against TRL for sigmoid, ipo, hinge, RPO (sigmoid
plus DPOTrainer's `sft` loss weighted), ORPO, and LoRA with the adapters disabled as the reference
(TRL given the adapters fullshard initialises); sigmoid packed (whole pairs per row), with the
reference offloaded to the host, with it precomputed, and at tp 2, against the plain run; under
LoRA the adapter-disabled reference against a frozen base copy (`reference=model`). World 1 runs in
the test's process: the first step of runs the group resumes at world 2 (the reference a frozen
copy, or precomputed), a tiny Qwen3-MoE that the group trains at ep 2, and the built-in tiny
Qwen2-VL on pairs with images in some prompts."""

import json
import random
from pathlib import Path

import pytest
import torch
from harness.trl_peer import in_order

from fullshard.testing import run_distributed

PAIRS, STEPS, BATCH = 12, 3, 4
TOL = 1e-5
# fullshard's run name -> TRL's trainer arguments: DPOTrainer's losses, its `sft` term weighted (RPO),
# ORPOTrainer, and LoRA with the adapters disabled as the reference (fullshard's `adapter` default)
TRL_RUNS = {"sigmoid": dict(loss_type="sigmoid"), "ipo": dict(loss_type="ipo"), "hinge": dict(loss_type="hinge"),
            "rpo": dict(loss_type="sigmoid", sft_weight=0.5), "orpo": dict(loss_type="orpo"),
            "lora_adapter": dict(loss_type="sigmoid", lora=dict(r=4, lora_alpha=16.0, lora_dropout=0.0,
                                                                target_modules=["q_proj", "v_proj"]))}


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


def trl_losses(base, data, out, loss_type: str, sft_weight: float = 0.0, lora: dict | None = None) -> list[float]:
    """TRL's raw loss of each step: `DPOTrainer` (`sft_weight`: its `sft` loss added with that weight;
    `lora`: PEFT LoRA fields, the adapters disabled as the reference), or `ORPOTrainer` for orpo."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                  lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                  max_grad_norm=1.0, optim="adamw_torch", bf16=False, fp16=False, gradient_checkpointing=False,
                  beta=0.1, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=42,
                  dataloader_drop_last=True)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if loss_type == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer_cls, args = ORPOTrainer, ORPOConfig(**common, max_length=64)
        tokenizer.bos_token = None  # the byte tokenizer's BOS is its EOS: ORPO would prepend it to every prompt
    else:
        from trl import DPOConfig, DPOTrainer

        losses = [loss_type, "sft"] if sft_weight else [loss_type]
        trainer_cls = DPOTrainer
        args = DPOConfig(**common, loss_type=losses, loss_weights=[1.0, sft_weight] if sft_weight else None,
                         max_length=None)

    InOrder = in_order(trainer_cls)

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if lora is not None:  # the adapters fullshard initialises: PEFT's draws after seeding with train.seed
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)
        model = get_peft_model(model, LoraConfig(**lora, task_type="CAUSAL_LM"))
    trainer = InOrder(model=model, args=args, train_dataset=load_dataset("json", data_files=str(data))["train"],
                      processing_class=tokenizer)
    trainer.losses = []
    trainer.train()
    return trainer.losses


def dpo_run(root: str, name: str, *extra, summary: bool = False):
    """`fullshard.train.train` on the pairs (every rank of a group calls it): the per-step losses, or the summary."""
    from fullshard.train import load_config, train

    config = load_config(None, [
        f"--model.name_or_path={root}/base", f"--data.path={root}/pairs.jsonl", "--data.format=preference",
        "--train.objective=dpo", "--data.seq_len=48", f"--train.steps={STEPS}", "--train.micro_batch_size=1",
        f"--train.global_batch_size={BATCH}", f"--train.output_dir={root}/{name}", "--checkpoint.export=false",
        "--train.plot=false", f"--data.cache_dir={root}/cache", "--data.shuffle=false", "--data.eval_fraction=0",
        "--optim.lr=1e-3", "--optim.schedule=constant", "--optim.warmup_steps=0", "--optim.weight_decay=0",
        "--optim.eps=1e-8", "--optim.betas=[0.9,0.999]", "--train.max_norm=1.0", "--train.loss_chunk_tokens=16",
        "--data.packing=false",
        *extra])
    result = train(config)
    return result if summary else [loss for _, loss in sorted(result["losses"].items())]


def write_moe(directory):
    """A tiny Qwen3-MoE (8 experts) with the byte tokenizer, as a Hub-layout directory."""
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.testing import build_model

    tokenizer = byte_tokenizer()
    model = build_model("ep_qwen3_moe", vocab_size=len(tokenizer), max_position_embeddings=64,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_vlm_pairs(directory, n=PAIRS, images=(0, 3, 4, 5, 10)):
    """Image-text pairs for the built-in tiny Qwen2-VL: the records in `images` ask about a picture,
    the others are text only; chosen names the picture's colour, rejected another. With 2 ranks, one
    pair per micro-batch and 4 per step: step 1's ranks each have one micro-batch without an image
    while the other's has one, step 2's images are all on rank 0, step 3 has one image."""
    import random

    from fullshard.data.builtin import COLOURS, draw_shape

    directory.mkdir(parents=True, exist_ok=True)
    rng, colours = random.Random(2), sorted(COLOURS)
    with open(directory / "pairs.jsonl", "w") as f:
        for i in range(n):
            colour, wrong = rng.sample(colours, 2)
            question = [{"type": "text", "text": "what colour?"}]
            if i in images:
                draw_shape("circle", colour, rng).save(directory / f"{i}.png")
                question = [{"type": "image", "image": f"{i}.png"}, *question]
            prompt = [{"role": "user", "content": question}]
            record = {"prompt": prompt, "chosen": _answer(colour), "rejected": _answer(wrong)}
            f.write(json.dumps(record) + "\n")


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


# world 1 in the test's process, against the group's world 2: resumed runs (step 1 here, 2..3
# there; their own caches, so that the group's precompute run computes its table at world 2, and
# the resumed half's empty, as on other nodes: the table comes from the run directory),
# Qwen3-MoE at ep 2, the tiny Qwen2-VL
RESUMED = {"sigmoid": (), "precompute": ("--preference.reference=precompute",)}
FIRST_HALF, SECOND_HALF = "--data.cache_dir={root}/cache-resume", "--data.cache_dir={root}/cache-resumed"
MOE = ("--model.name_or_path={root}/moe", "--data.cache_dir={root}/cache-moe")
VLM = ("--model.name_or_path=tiny-qwen2-vl", "--data.path={root}/vlm/pairs.jsonl",
       "--data.cache_dir={root}/cache-vlm", "--data.seq_len=256")


def _fullshard_runs(root: str) -> dict:
    def run(name, *extra, summary=False):
        return dpo_run(root, name, *(e.format(root=root) for e in extra), summary=summary)

    out = {loss: run(loss, f"--preference.loss_type={loss}") for loss in ("sigmoid", "ipo", "hinge", "orpo")}
    out.update({f"resumed_{name}": run(f"resume-{name}", *extra, SECOND_HALF)
                for name, extra in RESUMED.items()})
    out["moe_ep2"] = run("moe_ep2", *MOE, "--fsdp.ep_size=2")
    out["vlm_2"] = run("vlm_2", *VLM)
    out["rpo"] = run("rpo", f"--preference.sft_weight={TRL_RUNS['rpo']['sft_weight']}")
    # packed: two whole pairs per row, two rows per step: the same pairs per step as one per row
    out["packed"] = run("packed", "--data.packing=true", "--data.seq_len=40", f"--train.global_batch_size={BATCH // 2}")
    out["offloaded_reference"] = run("offloaded", "--preference.offload_reference=true")
    out["precompute"] = run("precompute", "--preference.reference=precompute")
    out["resumed_precompute_tables"] = {
        place: len(list(Path(root, folder).glob("reference-logps-*.json")))
        for place, folder in (("run", "resume-precompute/reference"), ("first half's cache", "cache-resume"),
                              ("second half's cache", "cache-resumed"))}
    out["tp2"] = run("tp2", "--fsdp.tp_size=2")  # dp 1: each step's four pairs one after another
    # learning: held-out pairs' implicit rewards rank chosen above rejected
    learned = run("learn", f"--data.path={root}/learn.jsonl", "--data.eval_fraction=0.25", "--train.steps=12",
                  "--optim.lr=3e-3", "--train.global_batch_size=8", "--data.packing=true", summary=True)
    out["learn"] = {k: v for k, v in learned.items() if k.startswith("eval_")}
    lora = ("--lora.r=4", "--lora.target_modules=[q_proj,v_proj]", "--lora.alpha=16", "--lora.save_adapter=false")
    out["lora_adapter"] = run("lora_adapter", *lora, "--preference.reference=adapter")
    out["lora_model"] = run("lora_model", *lora, "--preference.reference=model")
    # pp 2 (dp 1): micro-batches of two rows, each row one pipeline micro-batch (its pairs whole)
    pp = ("--fsdp.pp_size=2", "--fsdp.pp_schedule=GPipe", "--train.micro_batch_size=2")
    out["pp2"] = run("pp2", *pp)
    out["pp2_packed_precompute"] = run("pp2_packed", *pp, "--data.packing=true",
                                       "--data.seq_len=40",
                                       f"--train.global_batch_size={BATCH // 2}",
                                       "--preference.reference=precompute")
    out["pp2_lora_adapter"] = run("pp2_lora", *pp, *lora, "--preference.reference=adapter")
    out["pp2_orpo"] = run("pp2_orpo", *pp, "--preference.loss_type=orpo")  # its prompt scored too
    # cp 2 (dp 1): each sequence's parts summed over the cp ranks, one pair's chosen start counted once
    out["cp2"] = run("cp2", "--fsdp.cp_size=2")
    out["cp2_packed"] = run("cp2_packed", "--fsdp.cp_size=2", "--data.packing=true", "--data.seq_len=40",
                            f"--train.global_batch_size={BATCH // 2}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    write_base(root / "base")
    write_pairs(root / "pairs.jsonl")
    write_pairs(root / "learn.jsonl", n=128, seed=1)
    write_moe(root / "moe")
    first = {f"first_{name}": dpo_run(str(root), f"resume-{name}", "--train.stop_after=1",
                                      *(e.format(root=root) for e in (*extra, FIRST_HALF)))
             for name, extra in RESUMED.items()}
    first["moe_1"] = dpo_run(str(root), "moe_1", *(e.format(root=root) for e in MOE))
    write_vlm_pairs(root / "vlm")
    first["vlm_1"] = dpo_run(str(root), "vlm_1", *(e.format(root=root) for e in VLM))
    from datasets import Dataset

    rows = Dataset.from_file(str(next((root / "cache-vlm").glob("*/packed.arrow"))))
    first["vlm_rows_with_images"] = sum(any(len(blob) for blob in row) for row in rows["images"])
    ours = {**run_distributed(_fullshard_runs, 2, str(root))[0], **first}
    theirs = {name: trl_losses(root / "base", root / "pairs.jsonl", root / f"trl-{name}", **kwargs)
              for name, kwargs in TRL_RUNS.items()}
    return ours, theirs


@pytest.mark.parametrize("name", list(TRL_RUNS))
def test_dpo_world_2_matches_trl_step_by_step(runs, name):
    ours, theirs = runs
    assert len(theirs[name]) == STEPS
    diffs = [abs(a - b) for a, b in zip(ours[name], theirs[name])]
    assert max(diffs) <= TOL, (ours[name], theirs[name])
    assert ours[name][-1] != ours[name][0]  # it trained


@pytest.mark.parametrize("layout", ["packed", "offloaded_reference", "precompute", "tp2"])
def test_layouts_and_reference_placement_equal_the_plain_run(runs, layout):
    ours, _ = runs
    assert max(abs(a - b) for a, b in zip(ours[layout], ours["sigmoid"])) <= TOL, (ours[layout], ours["sigmoid"])


@pytest.mark.parametrize("name", list(RESUMED))
def test_resumed_at_another_world_size_equals_the_uninterrupted_run(runs, name):
    """Step 1 at world 1, stopped; resumed at world 2: the reference (a frozen copy of the starting
    weights, or the precomputed table) comes back with the run, and steps 2..3 are the plain run's."""
    ours, _ = runs
    assert len(ours[f"first_{name}"]) == 1 and len(ours[f"resumed_{name}"]) == STEPS - 1
    resumed = ours[f"first_{name}"] + ours[f"resumed_{name}"]
    assert max(abs(a - b) for a, b in zip(resumed, ours["sigmoid"])) <= TOL, (resumed, ours["sigmoid"])
    if name == "precompute":  # the resumed half's own cache never held the table: it came from the run
        assert ours["resumed_precompute_tables"] == {"run": 1, "first half's cache": 1, "second half's cache": 1}


def test_dpo_on_qwen3_moe_at_ep_2_equals_one_process(runs):
    ours, _ = runs
    assert len(ours["moe_ep2"]) == STEPS
    diffs = [abs(a - b) for a, b in zip(ours["moe_ep2"], ours["moe_1"])]
    assert max(diffs) <= TOL, (ours["moe_ep2"], ours["moe_1"])


def test_vlm_dpo_with_images_on_some_ranks_equals_one_process(runs):
    """Tiny Qwen2-VL, images in some prompts: micro-batches without images beside ones with them."""
    ours, _ = runs
    assert ours["vlm_rows_with_images"] == 5  # the pairs whose prompts show a picture
    assert len(ours["vlm_2"]) == STEPS and ours["vlm_2"][-1] != ours["vlm_2"][0]
    diffs = [abs(a - b) for a, b in zip(ours["vlm_2"], ours["vlm_1"])]
    assert max(diffs) <= TOL, (ours["vlm_2"], ours["vlm_1"])


def test_dpo_learns_held_out_preferences(runs):
    ours, _ = runs
    assert ours["learn"]["eval_rewards/accuracies"] >= 0.9, ours["learn"]


def test_lora_adapter_reference_equals_a_frozen_base_copy(runs):
    ours, _ = runs
    assert max(abs(a - b) for a, b in zip(ours["lora_adapter"], ours["lora_model"])) <= TOL
    assert abs(ours["lora_adapter"][0] - 0.6931472) <= TOL  # step 1: policy = reference, loss log 2


@pytest.mark.parametrize("layout, plain", [("pp2", "sigmoid"), ("pp2_packed_precompute", "packed"),
                                           ("pp2_lora_adapter", "lora_adapter"),
                                           ("pp2_orpo", "orpo"), ("cp2", "sigmoid"),
                                           ("cp2_packed", "packed")])
def test_dpo_under_pipeline_parallelism_equals_the_plain_run(runs, layout, plain):
    """pp 2: the reference first (a pipelined frozen copy, the precomputed table, the adapters
    off), then the policy's log-probs and the loss on the last stage, per pipeline micro-batch."""
    ours, _ = runs
    gap = max(abs(a - b) for a, b in zip(ours[layout], ours[plain]))
    assert gap <= TOL, (ours[layout], ours[plain])


# ---------------------------------------------------------------------------------------------- data, refusals

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tokenize(records: list[dict], **section):
    from types import SimpleNamespace

    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.preference import PreferenceTokenize

    defaults = dict(seq_len=512, prompt_field="prompt", tools_field="tools", chat_template=TEMPLATE)
    tokenize = PreferenceTokenize(byte_tokenizer(), SimpleNamespace(**{**defaults, **section}))
    batch = {k: [r.get(k) for r in records] for k in ("prompt", "chosen", "rejected")}
    return tokenize(batch, list(range(len(records)))), byte_tokenizer()


def test_preference_formats_label_only_the_completions():
    user, good, bad = ({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                       {"role": "assistant", "content": "5"})
    out, tok = _tokenize([{"prompt": [user], "chosen": [good], "rejected": [bad]},
                          {"chosen": [user, good], "rejected": [user, bad]},  # implicit prompt
                          {"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    assert out["input_ids"][0] == out["input_ids"][1]  # the shared leading turns are the prompt
    for ids, labels, roles in zip(out["input_ids"], out["labels"], out["pair_role"]):
        trained = [tok.decode([t]) for t, label in zip(ids, labels) if label != -100]
        assert set(roles) == {1, 2} and roles.index(2) > 0  # chosen, then rejected
        assert "".join(trained).replace("<|endoftext|>", "").replace("\n", "") in ("45", "45")
    assert out["input_ids"][2][-1] == tok.eos_token_id  # plain text: EOS after each completion


def test_bad_preference_records_name_file_and_line(tmp_path):
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.prepare import prepare
    from fullshard.train import ConfigError, load_config

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b", "rejected": ""}) + "\n")
    section = load_config(None, ["--data.format=preference", "--train.objective=dpo", f"--data.path={path}"]).data
    with pytest.raises(ConfigError, match=r"pairs\.jsonl.*2.*no rejected completion"):
        prepare(section, byte_tokenizer(), str(path), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*tmp*"))  # nothing left behind


@pytest.mark.parametrize("overrides, message", [
    (["--train.objective=dpo"], "set data.format=preference"),
    (["--data.format=preference"], "not sft"),
    (["--train.objective=dpo", "--data.format=preference", "--preference.loss_type=simpo",
      "--preference.reference=model"], "reference-free"),
    (["--train.objective=dpo", "--data.format=preference", "--preference.reference=adapter"], "lora.r is unset"),
    (["--train.objective=dpo", "--data.format=preference", "--preference.loss_type=orpo",
      "--preference.sft_weight=1"], "built in"),
    (["--train.objective=dpo", "--data.format=preference", "--fsdp.cp_size=2",
      "--preference.reference=precompute"], "preference.reference=precompute is not supported"),
])
def test_combinations_that_do_not_fit_are_one_line(overrides, message):
    from fullshard.train import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_vlm_pairs_hold_images_per_sequence_and_refuse_assistant_turns_in_prompts(tmp_path):
    import random

    from fullshard.data.builtin import draw_shape, tiny_vlm_processor
    from fullshard.data.chat import RecordError
    from fullshard.data.preference import ROLE, VisionPreferenceTokenize
    from fullshard.data.vision import decode_images
    from fullshard.train import load_config

    draw_shape("square", "red", random.Random(0)).save(tmp_path / "pic.png")
    section = load_config(None, ["--data.format=preference", "--train.objective=dpo",
                                 "--data.seq_len=512"]).data
    processor = tiny_vlm_processor()
    tokenize = VisionPreferenceTokenize(processor, section, tmp_path, None)
    user = {"role": "user", "content": [{"type": "image", "image": "pic.png"},
                                        {"type": "text", "text": "colour?"}]}
    pair = tokenize.pair(0, [user], _answer("red"), _answer("blue"))
    assert decode_images([pair["images"]])["image_grid_thw"].shape[0] == 2  # once per sequence
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    roles = pair[ROLE]
    for role, text in ((1, "red"), (2, "blue")):
        ids = [t for t, r in zip(pair["input_ids"], roles) if r == role]
        labelled = [t for t, label, r in zip(pair["input_ids"], pair["labels"], roles)
                    if r == role and label != -100]
        assert image_id in ids and processor.tokenizer.decode(labelled).startswith(text)
    with pytest.raises(RecordError, match="assistant turns in its prompt"):
        tokenize.pair(3, [user, *_answer("red"), user], _answer("red"), _answer("blue"))
