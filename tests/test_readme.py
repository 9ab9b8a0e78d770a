"""The README and docs/ are tested: every shell command and every Python block in them runs here, in a scratch
directory, with tiny sizes substituted where the README's sizes would take minutes. A README that
drifts from the code fails this test, not a user."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from harness.cli import commands_in_group

from fullshard.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# the README first, then docs/ by name: a page's commands may use what the README's left behind
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FULLSHARD = [sys.executable, "-m", "fullshard.cli"]

# what the README writes -> what runs here (the same command, tiny)
SHELL_SUBSTITUTIONS = [
    (r"^fullshard train$", "fullshard train --train.steps=3 --train.log_every=1"),
    (r"--train\.steps=1000", "--train.steps=2"),
    (r"--train\.steps=30", "--train.steps=4"),
    (r"--train\.(eval_every|log_every)=10", r"--train.\1=2"),
    (r"--data\.seq_len=256", "--data.seq_len=64"),
]
PYTHON_SUBSTITUTIONS = [
    ('"path/or/hub-id"', "TINY_MODEL_DIR"),
    ('"tp_size": 2', '"tp_size": 1'),  # one process here; the README's comment says 4 ranks
]


def code_blocks(language: str, pages: list[Path] = DOCS) -> list[str]:
    """The `language` blocks of the README and every docs/ page, in that order."""
    return [m.group(1) for page in pages
            for m in re.finditer(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)]


def test_readme_is_short_and_links_every_docs_page():
    assert len(README.splitlines()) <= 200
    for page in DOCS[1:]:
        assert f"(docs/{page.name})" in README, f"the README links no {page.name}"


def shell_commands() -> list[str]:
    """Every command line of the README's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def test_every_train_command_in_the_docs_has_its_own_run_directory():
    """A `fullshard train` line in any block (bash or text) writes where no other one does: one into
    `runs/demo` after `make demo` is refused (a directory holds one run)."""
    owners: dict[str, list[str]] = {}
    for block in code_blocks(r"\w*"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("  #")[0].strip(), comments=True) if "fullshard train" in line else []
            if words[:2] != ["fullshard", "train"] or {"--help", "--print-config"} & set(words):
                continue
            if any(w.endswith((".yaml", ".yml")) for w in words):
                continue  # its config names where it writes
            named = [w.split("=", 1)[1] for w in words if w.startswith("--train.output_dir=")]
            owners.setdefault(named[0] if named else "runs/demo", []).append(" ".join(words))
    assert "runs/demo" in owners and len(owners) >= 3, owners
    shared = {d: lines for d, lines in owners.items() if len(lines) > 1}
    assert not shared, shared


def test_the_two_setup_commands_are_what_ci_and_make_run():
    first = code_blocks("bash", [ROOT / "README.md"])[0]
    assert "make demo" in first and "make test" in first
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t.*fullshard train\s*$", makefile, re.M)
    assert re.search(r"^test:.*\n\t.*pytest.*tests", makefile, re.M)


def _tiny_model_dir(path: Path) -> Path:
    """A local HF directory: a tiny Llama over the byte tokenizer, whose tokenizer has a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.data.builtin import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))


def _chat_jsonl(path: Path) -> None:
    """Conversations in the README's own record format (its json block), varied so there is data to pack."""
    record = json.loads(code_blocks("json")[0])
    lines = []
    for i in range(200):
        user, answer = f"What is {i} plus {2 * i}?", f"{i} plus {2 * i} is {3 * i}."
        lines.append(json.dumps({"messages": [{**record["messages"][0], "content": user},
                                              {**record["messages"][1], "content": answer}]}))
    path.write_text("\n".join(lines) + "\n")


def _data_the_docs_write(work: Path) -> None:
    """Run, in `work`, the Python blocks that write a JSONL file a shell command then trains on
    (docs/preference.md's `pairs.jsonl`)."""
    for block in code_blocks("python"):
        if re.search(r'open\("[\w.-]+\.jsonl", "w"\)', block):
            subprocess.run([sys.executable, "-c", block], cwd=work, check=True, timeout=60, env=_env())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    (work / "run.yaml").write_text(
        "model: {name_or_path: micro-llama}\n"
        "data: {seq_len: 32}\n"
        "train: {steps: 1000, micro_batch_size: 2, global_batch_size: 4, log_every: 1, output_dir: runs/yaml}\n")
    _tiny_model_dir(work / "my-model")
    _chat_jsonl(work / "chat.jsonl")
    _data_the_docs_write(work)
    (work / "stage2.txt").write_text("".join(f"Stage two document {i}: {i} and {i} make {2 * i}.\n" for i in range(300)))
    return work


# `make demo`'s command: the one the docs' commands run for real, as a user's shell does (the launcher,
# torchrun and its ranks); the rest run in one spawned group
DEMO_COMMAND = "fullshard train"


def test_every_shell_command_in_the_readme_runs(scratch):
    """Every `fullshard` line of the docs runs, in the docs' order, after `make demo`'s command ran
    for real; the others through the command's own code in one group of 2 ranks
    (`harness.cli.commands_in_group`: all but the launch itself, which the demo's shows)."""
    commands = [c for c in shell_commands() if c.startswith("fullshard")]
    assert len(commands) >= 8 and DEMO_COMMAND in commands, commands
    demo = commands.index(DEMO_COMMAND)
    argvs = []
    for command in commands[:demo] + commands[demo + 1:]:
        for pattern, replacement in SHELL_SUBSTITUTIONS:
            command = re.sub(pattern, replacement, command)
        argvs.append(shlex.split(command)[1:])
    demo_argv = shlex.split(re.sub(SHELL_SUBSTITUTIONS[0][0], SHELL_SUBSTITUTIONS[0][1], DEMO_COMMAND))[1:]
    proc = subprocess.run(FULLSHARD + demo_argv, cwd=scratch, capture_output=True, text=True, timeout=600,
                          env=_env())
    assert proc.returncode == 0, f"{DEMO_COMMAND}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "launching 2 processes" in proc.stdout
    ran = run_distributed(commands_in_group, 2, str(scratch), argvs, timeout=900)
    for argv, done, other in zip(argvs, ran[0], ran[1]):
        assert done["code"] == 0, f"fullshard {shlex.join(argv)}\n{done['output'][-3000:]}\n----- rank 1\n" \
                                  f"{other['output'][-2000:]}"
    assert len(ran[0]) == len(argvs)
    assert sum(done["launched"] for done in ran[0]) >= 6  # the docs' runs and generate reached the ranks
    # what the README says these commands leave behind
    assert (scratch / "runs/demo/checkpoints").is_dir() and (scratch / "runs/demo/hf/config.json").is_file()
    assert (scratch / "runs/demo/metrics.jsonl").is_file()
    assert (scratch / "out/config.json").is_file()
    assert (scratch / "runs/chat/hf/config.json").is_file()
    assert (scratch / "runs/stage2/checkpoints/step_4").is_dir()  # stage 2: its own steps, from 0


# what the README's blocks take as given (its text says what `model` is); imports they must do themselves
PRELUDE = """
import fullshard
from fullshard.testing.zoo import build_model, make_batch
model = build_model("llama")
from fullshard.data.builtin import byte_tokenizer
tokenizer = byte_tokenizer()
window = [make_batch("llama", batch_size=2, seq_len=16, seed=i) for i in range(2)]
for b in window:
    b["labels"] = b["input_ids"]
scheduler, step, pos = None, 1, 0
engine = fullshard.FSDP2Engine()
del fullshard, build_model, make_batch, byte_tokenizer
"""


def test_every_python_block_in_the_readme_runs(scratch):
    blocks = code_blocks("python")
    assert len(blocks) >= 6
    (scratch / "py").mkdir(exist_ok=True)
    runner = ["import os, sys", "os.chdir(sys.argv[1])", f"TINY_MODEL_DIR = {str(scratch / 'my-model')!r}"]
    for i, block in enumerate(blocks):
        for old, new in PYTHON_SUBSTITUTIONS:
            block = block.replace(old, new)
        runner.append(f"ns = {{'TINY_MODEL_DIR': TINY_MODEL_DIR}}; exec({PRELUDE!r}, ns)")
        runner.append(f"print('--- python block {i}', flush=True); exec({block!r}, ns)")
    proc = subprocess.run([sys.executable, "-c", "\n".join(runner), str(scratch / "py")], capture_output=True, text=True,
                          timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("--- python block") == len(blocks)
    assert (scratch / "py/out/adapter").is_dir() and (scratch / "py/out/merged/config.json").is_file()
