"""The RL and VLM paths on a GPU (NCCL), one process: the weight stream equals the export bit for bit,
`generate` on the sharded model equals transformers' greedy `generate` on that export, and a sharded
Qwen2-VL trains like the plain model on the device (fp32: equal losses; bf16 with its vision tower
frozen: the tower's fp32 weights meet bf16 compute without a dtype error and stay bit-identical).
The CPU suite checks these over gloo at world 2 and 4; this is the same on the device's kernels.

    python bench/gpu_checks.py          # prints one line per check; exits 1 if any fails
    python bench/gpu_checks.py cpu      # the same on CPU / gloo, to check the script itself
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harnesses (harness/)


def main(device_type: str = "cuda") -> int:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fullshard import FSDP2Engine, export_hf, generate, hf_weights
    from fullshard.distributed import init_distributed

    device = init_distributed(device_type)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = FSDP2Engine({"mixed_precision": "fp32"}).prepare_model(LlamaForCausalLM(config).to(device))
    failures = []
    with tempfile.TemporaryDirectory() as out:
        export_hf(model, out, dtype=torch.float32)
        files = {}
        for path in Path(out).glob("*.safetensors"):
            files.update(load_file(path))
        streamed = {name: tensor.cpu() for name, tensor in hf_weights(model, dtype=torch.float32, bucket_bytes=2**20)}
        same = set(streamed) == set(files) and all(torch.equal(streamed[k], files[k]) for k in files)
        print(f"hf_weights == export_hf on {torch.distributed.get_backend()}: {same} ({len(files)} tensors)")
        if not same:
            failures.append("stream")
        reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    prompts = torch.randint(0, config.vocab_size, (3, 12), device=device)
    mask = torch.ones_like(prompts)
    mask[0, :4] = 0  # one left-padded prompt
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = reference.generate(prompts, attention_mask=mask, **kwargs)
    ours = generate(model, prompts, attention_mask=mask, **kwargs)
    agree = torch.equal(ours, expected)  # fp32 both: the same kernels on the same weights
    print(f"generate == transformers' greedy generate (fp32): {agree} "
          f"({int((ours == expected).sum())} of {expected.numel()} tokens)")
    if not agree:
        failures.append("generate")
    failures += vlm_checks(device)
    return 1 if failures else 0


def vlm_checks(device: torch.device) -> list[str]:
    from harness.vlm_parity import token_loss_sum

    from fullshard import FSDP2Engine
    from fullshard.testing.vlm_zoo import VLMInputs, build_vlm

    reference = build_vlm("qwen2_vl")
    inputs = VLMInputs(reference)
    batches = [inputs.batch(flags, seed=step) for step, flags in
               enumerate([[True, False], [False, False], [True, True]])]

    def train(model, steps=batches):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for batch in steps:
            loss, tokens = token_loss_sum(model, {k: v.to(device) for k, v in batch.items()})
            (loss / tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()) / tokens)
        return losses

    failures = []
    plain = train(reference.to(device))
    sharded = train(FSDP2Engine({"mixed_precision": "fp32", "freeze": "none"}).prepare_model(build_vlm("qwen2_vl").to(device)))
    worst = max(abs(a - b) for a, b in zip(plain, sharded))
    print(f"Qwen2-VL sharded == plain on {device.type} (fp32, 3 steps, images on some rows): {worst <= 1e-4} "
          f"(largest loss difference {worst:.2e})")
    if worst > 1e-4:
        failures.append("vlm fp32")
    model = FSDP2Engine({"mixed_precision": "bf16"}).prepare_model(build_vlm("qwen2_vl").to(device))
    frozen = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = train(model)
    kept = bool(frozen) and all(torch.equal(p.full_tensor(), frozen[n]) for n, p in model.named_parameters()
                                if n in frozen)
    finite = all(loss == loss and abs(loss) < float("inf") for loss in losses)
    print(f"Qwen2-VL bf16, vision tower frozen: finite losses {finite}, {len(frozen)} frozen tensors unchanged "
          f"{kept} (losses {', '.join(f'{loss:.3f}' for loss in losses)})")
    if not (finite and kept):
        failures.append("vlm bf16")
    return failures


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
