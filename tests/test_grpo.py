"""`fullshard train --train.objective=grpo`: one real launch that learns (the reward of the last 5
steps well above the first 5's on a task a random policy scores low on) with an engine process fed
by `WeightSync`; in one spawned group the same colocated, sampling the engine's completions step by
step, a resume in the middle equal to the uninterrupted run, a failing reward function as one line
on every rank, a trained reward model's scores against transformers' in one process and its run
weighted beside a function, engines (started by rank 0 in the group) under pp 2 and tp 2 equal to
a world-1 colocated run and under LoRA equal to LoRA colocated; beside the group, at world 1, the
same run and a run resumed at world 2, equal to it; the pieces (per-completion sampling streams,
rewards, prompts, rollout layout, refusals) in process."""

import json
import subprocess
import sys

import pytest
import torch

from fullshard.errors import ConfigError
from fullshard.testing import run_distributed
from fullshard.train.metrics import read_metrics

REWARDS = '''
def digit_share(prompts, completions, completion_ids, target, **columns):
    assert len(target) == len(completions) == len(prompts) == len(completion_ids), "one value per completion"
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversations: turns
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def boom(prompts, completions, completion_ids, **columns):
    raise ValueError("boom")


def too_few(prompts, completions, completion_ids, **columns):
    return [1.0]
'''
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def write_inputs(root):
    """Prompts half as text, half as conversations (a reference answer at the end), a reward file
    and a chat template for the byte tokenizer."""
    records = []
    for i in range(64):
        question = f"what comes after {i}?"
        record = {"prompt": question} if i % 2 else {"messages": [
            {"role": "user", "content": question}, {"role": "assistant", "content": str(i + 1)}]}
        records.append({**record, "target": "digits", "answer": str(i + 1)})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "rewards.py").write_text(REWARDS)
    (root / "template.jinja").write_text(TEMPLATE)


RM_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
               "{% endfor %}")


def write_reward_models(root):
    """test_reward's tiny one-output Llama reward model (`base`, no chat template) and causal LM
    (`causal`); `rm`: the reward model with a chat template of its own and a head scaled up (scores
    of order 1), as TRL would be given it."""
    from test_reward import write_bases
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    write_bases(root)
    model = AutoModelForSequenceClassification.from_pretrained(root / "base")
    with torch.no_grad():
        model.score.weight.mul_(20)
    model.save_pretrained(root / "rm")
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(root / "rm")


def common(root, out: str, *extra) -> list[str]:
    return [f"--data.path={root}/prompts.jsonl", f"--data.chat_template={root}/template.jinja",
            "--data.seq_len=48", "--train.objective=grpo", f"--train.output_dir={root}/{out}",
            "--rl.group_size=8", "--train.global_batch_size=16", "--rl.max_new_tokens=8", "--train.log_every=1",
            "--optim.warmup_steps=2", f"--data.cache_dir={root}/cache", *extra]


# ---------------------------------------------------------------------------------------------- one launch


def learning(root) -> list[str]:
    """The learning runs' reward: the digits' share (what the task asks for) and `format` (0)."""
    return ["--train.steps=24", f"--rl.reward=[{root}/rewards.py:digit_share,format]",
            "--rl.reward_weights=[1.0,0.5]"]


def test_cli_grpo_learns_with_a_reward_file_and_an_engine(tmp_path, group):
    """The real command with an engine process fed by `WeightSync` (the colocated run learns in
    the group below); the engine samples what the group's colocated run samples, step by step:
    every completion from its own stream, from the same weights."""
    write_inputs(tmp_path)
    args = common(tmp_path, "out", *learning(tmp_path), "--rl.rollout=engines")
    done = subprocess.run([sys.executable, "-m", "fullshard.cli", "train", *args, "--nproc", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, 25))
    first, last = (sum(r["reward"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert first < 0.15 and last > first + 0.2, (first, last)
    for name in ("reward_std", "rewards/digit_share/mean", "rewards/format/mean", "entropy", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "completions/mean_length", "completions/max_length",
                 "completions/clipped_ratio", "generation_s", "logprobs_s", "update_s", "sync_s"):
        assert all(name in r for r in rows), name
    assert all(r["completions"] == 16 and r["rewards/format/mean"] == 0 and r["sync_s"] > 0 for r in rows)
    assert all(r["completions/max_length"] <= 8 for r in rows)
    output = done.stdout + done.stderr
    assert "  reward " in output and "reward plot" in output
    assert (tmp_path / "out" / "hf" / "model.safetensors").exists()
    assert (tmp_path / "out" / "checkpoints" / "step_24" / "COMPLETE").exists()
    colocated = read_metrics(group[0] / "colocated" / "metrics.jsonl")
    assert_same_steps(rows, [r for r in colocated if r["kind"] == "train"])


# ---------------------------------------------------------------------------------------------- one group


def _run(argv: list[str]) -> dict:
    """`train()` on this rank (or in this process, at world 1), as `fullshard train` runs it: its
    summary, or its error line."""
    from fullshard.distributed import get_world_size
    from fullshard.launch import describe, error_line
    from fullshard.train import load_config, train

    try:
        config = load_config(None, argv)
        config.accumulation_steps(get_world_size())
        return {"summary": train(config)}
    except Exception as exc:  # noqa: BLE001 - the test asserts on the line
        return {"error": error_line(describe(exc))}


def _group_runs(root: str) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    root, out = Path(root), {}
    reward = [f"--rl.reward={root}/rewards.py:digit_share", "--model.name_or_path=micro-llama", "--train.steps=6"]
    whole = common(root, "whole", *reward, "--checkpoint.every=3")
    out["whole"] = _run(whole)
    resumed = common(root, "resumed", *reward, "--checkpoint.every=3")
    out["first_half"] = _run([*resumed, "--train.stop_after=3"])
    out["second_half"] = _run(resumed)
    if torch.distributed.get_rank() == 0 and "summary" in out["second_half"] and "summary" in out["whole"]:
        out["weights"] = [load_file(root / name / "hf" / "model.safetensors") for name in ("whole", "resumed")]
    kl = ("--rl.kl_coef=0.1", "--rl.epochs=2", "--rl.advantage=rloo", "--rl.loss_type=gspo", "--train.steps=2",
          "--checkpoint.export=false")
    out["kl"] = _run(common(root, "kl", *reward, *kl))
    out["resumed_1_to_2"] = _run(common(root, "resumed_1_to_2", *reward, "--checkpoint.every=3"))
    out["colocated"] = _run(common(root, "colocated", *learning(root), "--checkpoint.export=false",
                                   "--train.plot=false"))
    for name in ("boom", "too_few"):
        out[name] = _run(common(root, name, f"--rl.reward={root}/rewards.py:{name}", "--train.steps=2"))
    _reward_model_runs(root, out)
    out.update(_engine_runs(root))
    return out


# a short run with a reference model and two updates a step (old log-probs), as `short_1` runs it
SHORT = ("--model.name_or_path=micro-llama", "--train.steps=3", "--rl.kl_coef=0.1", "--rl.epochs=2")
# LoRA moving fast enough that stale or wrongly merged weights in the engine sample other
# completions from step 2 on (checked: an engine that drops the pushes fails the comparison)
LORA = ("--model.name_or_path=micro-llama", "--train.steps=3", "--lora.r=4", "--lora.alpha=32",
        "--optim.lr=0.1")


def _engine_runs(root) -> dict:
    """Engines started by rank 0 inside the group, as the CLI starts them: under pp 2 and tp 2
    (dp 1: the two ranks send the same prompts), and LoRA (merged weights) beside LoRA colocated;
    with each run's seconds."""
    import time

    reward, out = f"--rl.reward={root}/rewards.py:digit_share", {}
    runs = {"engines_pp": (*SHORT, "--parallel.pp_size=2"),
            "engines_tp": (*SHORT, "--parallel.tp_size=2"),
            "lora_engines": LORA, "lora_colocated": LORA}
    for name, extra in runs.items():
        started = time.perf_counter()
        rollout = "colocated" if name.endswith("colocated") else "engines"
        out[name] = _run(common(root, name, reward, f"--rl.rollout={rollout}", *extra))
        out[name]["seconds"] = time.perf_counter() - started
    return out


def _reward_model_runs(root, out: dict) -> None:
    """A reward model (sharded over both ranks) weighted with a function, each step's texts and
    scores recorded; a reward model whose tokenizer has no chat template under conversations."""
    from fullshard.rl.reward_model import RewardModel

    seen, encode, scores = [], RewardModel.encode, RewardModel.scores

    def recorded_encode(self, prompts, completions):
        seen.append({"prompts": prompts, "completions": completions})
        return encode(self, prompts, completions)

    def recorded_scores(self, encoded):
        values = scores(self, encoded)
        seen[-1]["scores"] = values.tolist()
        return values

    RewardModel.encode, RewardModel.scores = recorded_encode, recorded_scores
    try:  # a small token budget: several micro-batches, as many on each rank
        out["rm"] = _run(common(
            root, "rm", f"--rl.reward=[{root}/rm,{root}/rewards.py:digit_share]",
            "--rl.reward_weights=[0.5,1.0]", "--train.steps=2", "--checkpoint.export=false",
            "--train.plot=false", "--rl.max_tokens_per_micro_batch=160"))
    finally:
        RewardModel.encode, RewardModel.scores = encode, scores
    out["rm_scored"] = seen
    out["rm_alone"] = _rank_0_alone(root)
    out["no_template"] = _run(common(root, "no_template", f"--rl.reward={root}/base",
                                     "--train.steps=2", "--checkpoint.export=false",
                                     "--train.plot=false"))


UNEVEN = (["1+1=", "what comes after 3?", "a"], ["2", " 4", "bcdefghijklmnopqrstuvwxyz" * 3])


def _rank_0_alone(root) -> list[float]:
    """Scores from `fullshard.rl.reward_model` directly, texts on rank 0 only (two micro-batches of
    at most 64 tokens): rank 1, with none, takes part in each sharded forward."""
    from fullshard.engine import EngineConfig
    from fullshard.rl.reward_model import load_reward_model

    scorer = load_reward_model(f"{root}/rm", EngineConfig(), torch.float32, max_tokens=64)
    prompts, completions = UNEVEN if torch.distributed.get_rank() == 0 else ([], [])
    return scorer(prompts, completions)


def _world_1_runs(root) -> dict:
    """In the test's process: the group's 6-step run at world 1, and the first half of a run the
    group resumes at world 2."""
    reward = [f"--rl.reward={root}/rewards.py:digit_share", "--model.name_or_path=micro-llama",
              "--train.steps=6"]
    return {"world_1": _run(common(root, "world_1", *reward)),
            "first_1": _run(common(root, "resumed_1_to_2", *reward, "--checkpoint.every=3",
                                   "--train.stop_after=3")),
            "short_1": _run(common(root, "short_1", reward[0], *SHORT))}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    write_inputs(root)
    write_reward_models(root)
    single = _world_1_runs(root)
    results = run_distributed(_group_runs, 2, str(root), timeout=900)
    return root, results, single


# what a run logs per step that differs between layouts only by the order of fp32 sums
ROUNDING = {"loss": 1e-5, "grad_norm": 1e-5, "entropy": 1e-5, "reward": 1e-6, "reward_std": 1e-6}
SAMPLED = ("batch", "completions", "tokens", "completions/mean_length", "completions/max_length",
           "completions/clipped_ratio")


def assert_same_steps(rows: list[dict], reference: list[dict]) -> None:
    """The same completions (their lengths, clipping and count exactly; rewards within rounding)
    and the same updates (loss, grad norm, entropy within rounding, relative), step by step."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for ours, theirs in zip(rows, reference):
        assert {k: ours[k] for k in SAMPLED} == {k: theirs[k] for k in SAMPLED}, (ours, theirs)
        for key, tolerance in ROUNDING.items():
            bound = tolerance * max(1.0, abs(theirs[key]))
            assert abs(ours[key] - theirs[key]) <= bound, (key, ours, theirs)


def assert_close_exports(root, name: str, reference: str = "whole") -> None:
    """The runs' exported weights within fp32 rounding of the sums' order (1e-5)."""
    from safetensors.torch import load_file

    ours, theirs = (load_file(root / run / "hf" / "model.safetensors") for run in (name, reference))
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-5


def test_resume_in_the_middle_equals_the_uninterrupted_run(group):
    root, results, _ = group
    assert all("summary" in results[0][k] for k in ("whole", "first_half", "second_half")), results[0]
    whole = [r for r in read_metrics(root / "whole" / "metrics.jsonl") if r["kind"] == "train"]
    resumed = [r for r in read_metrics(root / "resumed" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    keys = ("reward", "loss", "grad_norm", "entropy", "completions/mean_length", "batch")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]
    assert results[0]["second_half"]["summary"]["start_step"] == 3
    ours, theirs = results[0]["weights"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_world_1_samples_and_updates_as_world_2(group):
    """Each completion's stream is keyed by its index in the step, not by the rank that samples it:
    the world-1 run equals the group's world-2 run step by step."""
    root, results, single = group
    assert "summary" in single["world_1"], single["world_1"]
    assert "summary" in results[0]["whole"], results[0]["whole"]
    rows = {name: [r for r in read_metrics(root / name / "metrics.jsonl") if r["kind"] == "train"]
            for name in ("world_1", "whole")}
    assert len(rows["whole"]) == 6
    assert_same_steps(rows["world_1"], rows["whole"])
    assert_close_exports(root, "world_1")


def test_resume_at_another_world_size_equals_the_uninterrupted_run(group):
    """Steps 1..3 at world 1, stopped; 4..6 resumed at world 2: the world-2 run's steps."""
    root, results, single = group
    assert "summary" in single["first_1"] and "summary" in results[0]["resumed_1_to_2"], results[0]
    assert results[0]["resumed_1_to_2"]["summary"]["start_step"] == 3
    resumed, whole = ([row for row in read_metrics(root / run / "metrics.jsonl")
                       if row["kind"] == "train"] for run in ("resumed_1_to_2", "whole"))
    assert_same_steps(resumed, whole)
    assert_close_exports(root, "resumed_1_to_2")


def train_rows(root, name: str) -> list[dict]:
    return [row for row in read_metrics(root / name / "metrics.jsonl") if row["kind"] == "train"]


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_engines_under_pp_and_tp_equal_world_1_colocated(group, layout):
    """rl.rollout=engines at pp 2 and at tp 2 (dp 1), with a reference model (pipelined or
    tensor-parallel as the policy) and two updates a step: the world-1 colocated run, step by step
    (completions, loss, grad norm, KL: counted once per pipeline and per tp group) and exported."""
    root, results, single = group
    name = f"engines_{layout}"
    assert "summary" in single["short_1"], single["short_1"]
    assert all("summary" in results[rank][name] for rank in (0, 1)), results[0][name]
    rows, reference = train_rows(root, name), train_rows(root, "short_1")
    assert len(rows) == 3 and rows[-1]["kl"] > 0
    assert_same_steps(rows, reference)
    assert all(abs(a["kl"] - b["kl"]) <= 1e-5 * max(1.0, b["kl"]) for a, b in zip(rows, reference))
    assert_close_exports(root, name, "short_1")


def test_lora_with_engines_equals_lora_colocated(group):
    """The engine samples from the merged weights `WeightSync` pushes under the base model's names:
    the colocated LoRA run's completions and updates, step by step, and its export."""
    root, results, _ = group
    names = ("lora_engines", "lora_colocated")
    assert all("summary" in results[0][name] for name in names), results[0]
    rows = train_rows(root, "lora_engines")
    assert len(rows) == 3
    assert_same_steps(rows, train_rows(root, "lora_colocated"))
    assert_close_exports(root, "lora_engines", "lora_colocated")


def test_kl_reference_epochs_rloo_gspo(group):
    root, results, _ = group
    assert "error" not in results[0]["kl"], results[0]["kl"]
    rows = [r for r in read_metrics(root / "kl" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2 and all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > 0  # two updates a step


def test_colocated_rollouts_learn(group):
    """rl.rollout=colocated: the trainer ranks sample, the optimizer state aside meanwhile."""
    root, results, _ = group
    assert "error" not in results[0]["colocated"], results[0]["colocated"]
    rows = [r for r in read_metrics(root / "colocated" / "metrics.jsonl") if r["kind"] == "train"]
    first, last = (sum(r["reward"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert first < 0.15 and last > first + 0.2, (first, last)


def test_a_failing_reward_function_is_one_line_on_every_rank(group):
    root, results, _ = group
    for rank in (0, 1):
        boom, few = results[rank]["boom"]["error"], results[rank]["too_few"]["error"]
        assert "\n" not in boom and "rewards.py:boom" in boom and "ValueError: boom" in boom, boom
        assert "\n" not in few and "rewards.py:too_few" in few and "returned 1 values for 8 completions" in few, few


@torch.no_grad()
def plain_score(model, tokenizer, text: str) -> float:
    """transformers' score of one text alone, tokenized as TRL tokenizes it for a reward model."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return model(torch.tensor([ids])).logits[0, 0].item()


def test_reward_model_scores_equal_a_plain_one_process_scoring(group):
    """The scores of a step's completions, from the reward model sharded over 2 ranks in token-
    budget micro-batches, equal transformers' `AutoModelForSequenceClassification` scoring each
    text alone in one process, the texts built as TRL's GRPOTrainer builds them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl.data_utils import apply_chat_template
    from trl.trainer.utils import get_config_model_id

    root, results, _ = group
    model = AutoModelForSequenceClassification.from_pretrained(str(root / "rm"),
                                                               dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(root / "rm"))
    scored = [call for rank in (0, 1) for call in results[rank]["rm_scored"]]
    # 2 steps x 2 ranks, 8 completions each
    assert len(scored) == 4 and all(len(call["scores"]) == 8 for call in scored)
    kinds, ours, theirs = set(), [], []
    for call in scored:
        for prompt, completion, score in zip(call["prompts"], call["completions"], call["scores"]):
            conversation = isinstance(prompt, list)
            kinds.add(conversation)
            text = (apply_chat_template({"messages": prompt + completion}, tokenizer)["text"]
                    if conversation else prompt + completion)
            theirs.append(plain_score(model, tokenizer, text))
            ours.append(score)
    assert kinds == {True, False}  # text prompts and conversations both scored
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    assert diff <= 1e-5 and len(set(theirs)) > 1 and max(map(abs, theirs)) > 0.1, (diff, theirs[:4])
    assert get_config_model_id(model.config).split("/")[-1] == "rm"  # TRL's metric name for it
    expected = [plain_score(model, tokenizer, p + c) for p, c in zip(*UNEVEN)]
    assert results[1]["rm_alone"] == [] and len(results[0]["rm_alone"]) == 3
    assert max(abs(a - b) for a, b in zip(results[0]["rm_alone"], expected)) <= 1e-5


def test_grpo_with_a_reward_model_weighted_with_a_function(group):
    root, results, _ = group
    assert "error" not in results[0]["rm"], results[0]["rm"]
    rows = [r for r in read_metrics(root / "rm" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    scored = [call["scores"] for rank in (0, 1) for call in results[rank]["rm_scored"]]
    for step, row in enumerate(rows):  # rank 0's and rank 1's calls of this step
        values = scored[step] + scored[2 + step]
        assert row["rewards/rm/mean"] == pytest.approx(sum(values) / len(values), abs=1e-6)
        total = 0.5 * row["rewards/rm/mean"] + row["rewards/digit_share/mean"]
        assert row["reward"] == pytest.approx(total, abs=1e-6), row


def test_a_reward_model_without_a_chat_template_is_one_line_on_every_rank(group):
    _, results, _ = group
    for rank in (0, 1):
        error = results[rank]["no_template"].get("error", "")
        assert "\n" not in error and "has no chat template" in error and "/base" in error, error


@pytest.mark.parametrize("entry, message", [
    ("empty", "is a directory without config.json"),
    ("causal", "is a LlamaForCausalLM checkpoint, not a sequence-classification model"),
    ("three", "checkpoint with 3 outputs"),
    ("untokenized", "holds no tokenizer"),
    ("accuracy", "is both a built-in and a directory here"),
    ("twice", "both log as rewards/rm/mean"),
])
def test_bad_reward_model_directories_are_one_line_before_launch(tmp_path, monkeypatch, entry,
                                                                  message):
    from transformers import LlamaConfig

    from fullshard.train.config import load_config

    classifier = "LlamaForSequenceClassification"
    for name, kind, labels in (("causal", "LlamaForCausalLM", 1), ("three", classifier, 3),
                               ("untokenized", classifier, 1), ("a/rm", classifier, 1),
                               ("b/rm", classifier, 1)):
        LlamaConfig(num_labels=labels, architectures=[kind]).save_pretrained(tmp_path / name)
    for name in ("a/rm", "b/rm"):
        (tmp_path / name / "tokenizer.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "accuracy").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = {"twice": "[a/rm,b/rm]", "accuracy": "accuracy"}.get(entry, str(tmp_path / entry))
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(None, ["--train.objective=grpo", f"--rl.reward={spec}"])
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------- in process


def test_builtin_rewards():
    from fullshard.rl.rewards import Rewards, accuracy, digits, format_

    completions = ["so it is \\boxed{12}", "the answer: 3, then 7", "nothing", "\\boxed{\\frac{1}{2}}"]
    assert accuracy([], completions, [], answer=["12", "7", "1", "\\frac{1}{2}"]) == [1.0, 1.0, 0.0, 1.0]
    assert accuracy([], completions[:1], [], solution=["... so \\boxed{12}."]) == [1.0]
    assert accuracy([], completions[:1], []) == [None]
    turns = [[{"role": "assistant", "content": "<think>x</think> <answer>4</answer>"}], "<answer>4</answer>"]
    assert format_([], turns, []) == [1.0, 0.0]
    assert digits([], ["a1", "", "22"], []) == [0.5, 0.0, 1.0]
    rewards = Rewards(["accuracy", "digits"], [2.0, 1.0])
    total, table = rewards.score(["p"] * 2, ["12", "x"], [[1], [2]], {"answer": [None, "5"]})
    assert total.tolist() == [1.0, 0.0] and torch.isnan(table[0, 0])  # None: left out of the sum


def test_reward_names_are_checked(tmp_path):
    from fullshard.rl.rewards import load_reward

    (tmp_path / "r.py").write_text("x = 1\n")
    for spec, message in (("nope", "no built-in"), (f"{tmp_path}/missing.py:f", "no file"),
                          (f"{tmp_path}/r.py:f", "has no function 'f'"), (f"{tmp_path}/r.py:x", "has no function"),
                          ("no_such_module_here:f", "importing module")):
        with pytest.raises(ConfigError, match=message):
            load_reward(spec)
    assert load_reward("json:dumps") is json.dumps


def test_prompts_keep_every_other_column(tmp_path):
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.prompts import load_prompts
    from fullshard.train.config import load_config

    write_inputs(tmp_path)
    config = load_config(None, common(tmp_path, "x", f"--rl.reward={tmp_path}/rewards.py:digit_share"))
    data = load_prompts(config.data, byte_tokenizer(), 8)
    assert data.prompt(0) == [{"role": "user", "content": "what comes after 0?"}]  # the answer turn left out
    assert data.prompt(1) == "what comes after 1?" and data.columns(1) == {"target": "digits", "answer": "2"}
    text = byte_tokenizer().decode(data.prompt_ids(1))
    assert text == "user: what comes after 1?\nassistant: "
    batches = [data.step_batches(16, 8, rank, 2, seed=0, shuffle=True) for rank in (0, 1)]
    rows = [b.micro_batches(5)[0] for b in batches]
    assert len(rows[0]) == len(rows[1]) == 1 and rows[0] + rows[1] == batches[0].global_rows(5)


def test_a_steps_prompts_are_in_one_order_at_any_world_size(tmp_path):
    """The step's prompts, in the order their completions are numbered (`rl.sampling`): the data
    ranks' shares one after another, the same at world 1, 2 and 4, and after a resume (a step's
    prompts follow from the step alone); a new epoch reshuffles."""
    from fullshard.data.builtin import byte_tokenizer
    from fullshard.data.prompts import load_prompts
    from fullshard.train.config import load_config

    write_inputs(tmp_path)
    reward = f"--rl.reward={tmp_path}/rewards.py:digit_share"
    data = load_prompts(load_config(None, common(tmp_path, "x", reward)).data, byte_tokenizer(), 8)

    def step_order(world: int, step: int) -> list[int]:
        shares = [data.step_batches(64, 8, r, world, seed=3, shuffle=True) for r in range(world)]
        return [row for share in shares for row in share.micro_batches(step)[0]]

    orders = {world: [step_order(world, step) for step in range(10)] for world in (1, 2, 4)}
    assert orders[1] == orders[2] == orders[4]
    assert all(len(set(order)) == 8 for order in orders[1])
    assert sorted(sum(orders[1][:8], [])) == list(range(64)) and orders[1][8] != orders[1][0]


def splitmix64_reference(seed: int, counter: int) -> int:
    """SplitMix64's `counter`-th output from `seed`, in Python's unbounded integers."""
    mask = (1 << 64) - 1
    z = (seed + counter * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_the_gumbel_sampler_draws_the_tempered_top_p_distribution():
    """Greedy decoding over `StreamSampler`'s scores is a categorical sample of softmax(logits / T)
    cut to its top-p nucleus: token frequencies over many streams and over one stream's steps
    match those probabilities; a row's draws follow its seed alone, SplitMix64's outputs (int64
    arithmetic in torch, wrapping, against Python's integers)."""
    from fullshard.rl.sampling import StreamSampler, completion_seeds, gumbel_noise, stream_uniforms

    logits, temperature, top_p = torch.tensor([1.0, 0.8, 0.5, 0.2, -0.2, -3.0]), 0.7, 0.95
    seeds = completion_seeds(5, 1, 0, 3)
    uniforms = stream_uniforms(torch.tensor(seeds), step=2, size=7)
    reference = [[(splitmix64_reference(s, 2 * 7 + v + 1) >> 11) * 2.0**-53 for v in range(7)]
                 for s in seeds]
    assert uniforms.tolist() == reference
    one = StreamSampler([7])

    def one_step(t: int) -> int:  # the sampler's t-th call on one row
        assert one.step == t
        return one(None, logits[None]).argmax(-1).item()

    probs = torch.softmax(logits / temperature, -1)
    ascending, order = probs.sort()
    kept = order[ascending.cumsum(0) > 1 - top_p]  # transformers' rule: the tail to 1 - top_p cut
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert 0 < expected[-2] and expected[-1] == 0  # a kept tail token and a cut one
    n = 20000
    many = StreamSampler(completion_seeds(0, 0, 0, n), temperature, top_p)
    across = many(None, logits.repeat(n, 1)).argmax(-1)
    # one stream's steps 0..n-1 (untempered, uncut): its counters run on across steps
    along = (logits + gumbel_noise(torch.tensor([7]), 0, n * len(logits)).view(n, -1)).argmax(-1)
    assert along[:3].tolist() == [one_step(t) for t in range(3)]
    for tokens, target in ((across, expected), (along, torch.softmax(logits, -1))):
        frequencies = torch.bincount(tokens, minlength=len(logits)) / n
        assert (frequencies - target).abs().max() < 0.012, (frequencies, target)  # 3.5 sigma at n
    assert (torch.bincount(across, minlength=len(logits)) > 0).tolist() == (expected > 0).tolist()
    seeds = completion_seeds(0, 0, 0, 4)
    batch = StreamSampler(seeds)(None, logits.repeat(4, 1)).argmax(-1)
    alone = [StreamSampler([s])(None, logits[None]).argmax(-1).item() for s in seeds]
    assert batch.tolist() == alone


def test_a_completion_draws_the_same_tokens_in_any_batch_and_in_an_engine():
    """`rollout.sample` (the trainer ranks' `generate`) and an engine's `_generate`: completion i
    draws from stream i whatever batch it is sampled in (all prompts at once, one at a time,
    reversed) and wherever (a trainer rank or an engine process)."""
    from fullshard.rl.engines import _generate
    from fullshard.rl.rollout import cut_completions, sample
    from fullshard.rl.sampling import completion_seeds
    from fullshard.testing import build_model

    model, group = build_model("llama"), 3
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    options = dict(max_new_tokens=6, temperature=0.8, top_p=0.9, pad_token_id=0, eos_token_id=1)
    seeds = completion_seeds(0, 4, 0, len(prompts) * group)
    whole = sample(model, prompts, group, seeds=seeds, **options).completion_ids
    by_prompt = [whole[i * group : (i + 1) * group] for i in range(len(prompts))]
    assert len({tuple(c) for c in whole}) > len(prompts)  # sampled: not one answer per prompt
    for i, prompt in enumerate(prompts):
        alone = sample(model, [prompt], group, seeds=seeds[i * group : (i + 1) * group], **options)
        assert alone.completion_ids == by_prompt[i]
    reversed_seeds = [s for i in reversed(range(len(prompts)))
                      for s in seeds[i * group : (i + 1) * group]]
    backwards = sample(model, prompts[::-1], group, seeds=reversed_seeds, **options).completion_ids
    assert backwards == [c for part in reversed(by_prompt) for c in part]
    request = dict(prompts=prompts[1:3], group_size=group, pad_token_id=0,
                   seeds=seeds[group : 3 * group], sampling=dict(options))
    engine = cut_completions(prompts[1:3], _generate(model, request), eos_token_id=1)
    assert engine.completion_ids == by_prompt[1] + by_prompt[2]


def test_rollout_layout_scores_the_completion_tokens():
    from fullshard.rl.rollout import Completions, as_rollouts, left_padded

    ids, mask = left_padded([[5, 6], [7]], pad_token_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    rollouts = as_rollouts(Completions([[5, 6], [7]], [[8, 9, 2], [3]], [False, True]), torch.tensor([1.0, -1.0]), 0)
    assert rollouts.input_ids.tolist() == [[5, 6, 8, 9, 2], [7, 3, 0, 0, 0]]
    # entry t scores token t + 1: the completion's tokens
    assert rollouts.response_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("extra, message", [
    (["--parallel.pp_size=2"], r"pp_size is not supported \(rl.rollout=colocated generates"),
    (["--rl.rollout=engines", "--model.name_or_path=tiny-qwen2-vl"], "engines holds a causal LM"),
    (["--data.path=x.jsonl"], "needs rl.reward"),
    (["--rl.reward=[digits,format]", "--rl.reward_weights=[1.0]"], "1 weights for 2 reward functions"),
    (["--rl.reference=none", "--rl.kl_coef=0.1"], "needs a reference"),
    (["--rl.reference=adapter"], "lora.r is unset"),
])
def test_what_grpo_refuses_is_one_line_before_launch(extra, message):
    from fullshard.train.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--train.objective=grpo", *extra])


def test_engines_take_pp_and_lora():
    from fullshard.train.config import load_config

    config = load_config(None, ["--train.objective=grpo", "--rl.rollout=engines",
                                "--parallel.pp_size=2", "--lora.r=4"])
    assert config.parallel.pp_size == 2 and config.lora.enabled


def test_global_batch_counts_completions():
    from fullshard.train.config import load_config

    config = load_config(None, ["--train.objective=grpo", "--train.global_batch_size=24", "--rl.group_size=8"])
    with pytest.raises(ConfigError, match="train.global_batch_size=24 is not divisible by rl.group_size=8 x "
                                          "data-parallel size 2"):
        config.accumulation_steps(2)
    assert config.accumulation_steps(1) == 3
