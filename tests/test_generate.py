"""fullshard.generate at world 2 against transformers' generate on the export, in one spawned group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from harness.cli import commands_in_group

from fullshard.cli import main
from fullshard.testing import build_model, run_distributed
from fullshard.testing.zoo import VOCAB

NAME = "llama"
PAD = 0


def left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


PROMPTS = {0: ([5], 1), 1: ([3, 7, 4], 2)}  # rank -> (prompt lengths, seed): counts and lengths differ


def _generate_checks(out: str) -> dict:
    from transformers import AutoModelForCausalLM

    from fullshard import FSDP2Engine, export_hf, generate

    rank, result = dist.get_rank(), {}
    model = FSDP2Engine().shard_model(build_model(NAME))
    export_hf(model, Path(out) / "export")
    plain = AutoModelForCausalLM.from_pretrained(Path(out) / "export").eval()
    greedy = dict(do_sample=False, pad_token_id=PAD)

    # an EOS rank 0's only prompt reaches at its third new token, so rank 0 is done long before rank 1
    ids0, mask0 = left_padded(*PROMPTS[0])
    eos = int(plain.generate(ids0, attention_mask=mask0, max_new_tokens=3, min_new_tokens=3, **greedy)[0, -1])
    ids, mask = left_padded(*PROMPTS[rank])
    ours = generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos, **greedy)
    theirs = plain.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, **greedy)
    result["equal"] = torch.equal(ours, theirs)
    result["length"] = ours.shape[1] - ids.shape[1]
    result["training_after"] = model.training

    # the all-gathers of one call do not grow with the number of new tokens
    counts, original = [], dist.all_gather_single

    def counting(*args, **kwargs):
        counts[-1] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    try:
        for new in (2, 10):
            counts.append(0)
            generate(model, ids, mask, max_new_tokens=new, min_new_tokens=new, **greedy)
    finally:
        dist.all_gather_single = original
    result["all_gathers"] = counts

    # a rank with no prompts takes part; the other's output is still transformers'
    ids, mask = (ids[:0], mask[:0]) if rank == 0 else (ids, mask)
    ours = generate(model, ids, mask, max_new_tokens=6, **greedy)
    result["empty_shape"] = tuple(ours.shape)
    result["empty_other_equal"] = rank == 0 or torch.equal(ours, plain.generate(ids, attention_mask=mask, max_new_tokens=6,
                                                                                  **greedy))
    # after generating, the model trains as before: sharded again, a step's gradients as in one process
    batch = {"input_ids": ids0, "labels": ids0}
    model.train()
    loss = model(**batch).loss
    plain.train()
    result["loss_after"] = (float(loss), float(plain(**batch).loss))
    return result


def test_generate_greedy_at_world_2_equals_transformers(tmp_path):
    results = run_distributed(_generate_checks, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["equal"], f"rank {rank}: greedy output differs from transformers' generate"
        assert result["training_after"], "generate left the model in eval mode"
        a, b = result["all_gathers"]
        assert a == b and a > 0, result["all_gathers"]
        assert result["empty_other_equal"]
        assert abs(result["loss_after"][0] - result["loss_after"][1]) < 1e-5, result["loss_after"]
    assert results[0]["length"] == 3 < results[1]["length"], (results[0]["length"], results[1]["length"])
    assert results[0]["empty_shape"][0] == 0


TEMPLATE = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
            "{% if add_generation_prompt %}<bot>{% endif %}")
PROMPTS_CLI = ["1 plus 2 is", "counting: 3 4", "hi"]


def _save_checkpoint(model_dir: str, save_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fullshard import CheckpointManager, FSDP2Engine

    model = FSDP2Engine().shard_model(AutoModelForCausalLM.from_pretrained(model_dir))
    CheckpointManager(save_dir).save(1, model, tokenizer=AutoTokenizer.from_pretrained(model_dir))


def _plain_completions(model_dir: str) -> list[str]:
    """What one process of plain transformers completes for each prompt, chat template applied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completions = []
    for prompt in PROMPTS_CLI:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        completions.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return completions


def test_fullshard_generate_command_from_a_directory_and_a_checkpoint(tmp_path):
    import os
    import subprocess
    import sys

    from fullshard.data.builtin import byte_tokenizer, special_token_ids

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = build_model(NAME, vocab_size=len(tokenizer), **special_token_ids(tokenizer)).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    run_distributed(_save_checkpoint, 1, str(tmp_path / "model"), str(tmp_path / "ckpts"))
    # in a fresh process set up as the command's ranks are (one thread): this process's state after
    # other tests could round a near tie of the random model's logits the other way
    expected = run_distributed(_plain_completions, 1, str(tmp_path / "model"))[0]

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    prompts = [a for prompt in PROMPTS_CLI for a in ("--prompt", prompt)]
    # from the directory through a real launch; from the checkpoint through the command's own code in
    # one spawned group (harness.cli.commands_in_group: all but the launch, which the first shows)
    args = [sys.executable, "-m", "fullshard.cli", "generate", str(tmp_path / "model"), "--nproc", "2",
            "--max-new-tokens", "6", *prompts]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    from_checkpoint = run_distributed(commands_in_group, 2, str(tmp_path), [
        ["generate", str(tmp_path / "ckpts"), "--nproc", "2", "--max-new-tokens", "6", *prompts]])[0][0]
    assert from_checkpoint["code"] == 0 and from_checkpoint["launched"], from_checkpoint["output"][-3000:]
    for source, printed in (("model", done.stdout), ("ckpts", from_checkpoint["output"])):
        for prompt, completion in zip(PROMPTS_CLI, expected):
            assert f"### {prompt}\n{completion}\n" in printed, (source, prompt, completion, printed[-2000:])


VLM_PROMPTS = [("What is in the pictures?", ["a.png", "b.png"]), ("Say something.", [])]


def _plain_vlm_completions(model_dir: str, image_dir: str) -> list[str]:
    """transformers' own generate in one process on each prompt alone: its processor (image-only
    without torchvision) with the prompt's images before its text in a user turn, every output of
    the processor (`mm_token_type_ids` included) handed to generate."""
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    from fullshard.data.vision import load_processor

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir)
    completions = []
    for prompt, files in VLM_PROMPTS:
        parts = [{"type": "image"} for _ in files] + [{"type": "text", "text": prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                             add_generation_prompt=True)
        images = [Image.open(Path(image_dir) / f).convert("RGB") for f in files] or None
        inputs = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id)
        completions.append(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return completions


def test_fullshard_generate_with_images_equals_transformers(tmp_path, monkeypatch, capsys):
    """`fullshard generate --image` on the built-in tiny Qwen2-VL at world 2: a prompt with two images
    on one rank, one without on the other (the ranks agree on the vision path), greedy, token for
    token what transformers' own generate gives; a missing image is one line before launch."""
    import os
    import random
    import subprocess
    import sys

    from fullshard.data.builtin import builtin_model_config, draw_shape, tiny_vlm_processor

    processor = tiny_vlm_processor()
    config, model_class = builtin_model_config("tiny-qwen2-vl", processor, 256, {})
    torch.manual_seed(0)
    model_class._from_config(config).save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    for name, shape, colour in (("a.png", "circle", "red"), ("b.png", "square", "blue")):
        draw_shape(shape, colour, rng).save(tmp_path / name)
    expected = run_distributed(_plain_vlm_completions, 1, str(tmp_path / "model"), str(tmp_path))[0]

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    args = [sys.executable, "-m", "fullshard.cli", "generate", str(tmp_path / "model"), "--nproc", "2",
            "--max-new-tokens", "8"]
    for prompt, files in VLM_PROMPTS:
        args += ["--prompt", prompt, *(a for f in files for a in ("--image", f))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for (prompt, _), completion in zip(VLM_PROMPTS, expected):
        assert f"### {prompt}\n{completion}\n" in done.stdout, (prompt, completion, done.stdout[-2000:])

    # refused before launch, in the command's own process: here
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([*args[3:7], "--prompt", "x", "--image", "nowhere.png"]) != 0
    refused = capsys.readouterr().err
    assert "--image " in refused and "nowhere.png: no such file" in refused
    assert len(refused.strip().splitlines()) == 1, refused


USER_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import fullshard

engine = fullshard.FSDP2Engine({"mixed_precision": "fp32"})
model = fullshard.from_pretrained(sys.argv[1], engine=engine)
prompts = torch.tensor([[5, 6, 7, 8]])
out = fullshard.generate(model, prompts, torch.ones_like(prompts), max_new_tokens=4, do_sample=False)
# collectives still queued at the end, their tensors already dropped (a metric all-reduce never
# waited for): what gloo's worker threads are still releasing while the interpreter shuts down
for _ in range(3000):
    dist.all_reduce(torch.ones(64), async_op=True)
print("done", flush=True)
"""


def test_a_script_from_the_readme_exits_cleanly_under_torchrun_without_teardown(tmp_path):
    """README's snippets as a user's script (FSDP2Engine, from_pretrained, generate, then collectives left in
    flight), under torchrun, no destroy_process_group: every rank exits 0, run after run (before: a gloo
    worker freed a tensor during interpreter shutdown and the rank died in C++'s terminate, SIGABRT)."""
    import os
    import subprocess
    import sys

    build_model(NAME).save_pretrained(tmp_path / "model")
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    for attempt in range(4):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "user.py", str(tmp_path / "model")], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in output, (attempt, output[-3000:])
        assert done.stdout.count("done") == 2, (attempt, output[-3000:])
