"""The RL paths on a GPU (NCCL), one process: the weight stream equals the export bit for bit and
`generate` on the sharded model equals transformers' greedy `generate` on that export. The CPU suite
checks both over gloo at world 2 and 4; this is the same check on the device's own collectives.

    python bench/gpu_checks.py          # prints one line per check; exits 1 if any fails
    python bench/gpu_checks.py cpu      # the same on CPU / gloo, to check the script itself
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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
    model = FSDP2Engine({"mixed_precision": "bf16"}).prepare_model(LlamaForCausalLM(config).to(device))
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
    with torch.autocast(device.type, dtype=torch.bfloat16):
        expected = reference.generate(prompts, attention_mask=mask, **kwargs)
    ours = generate(model, prompts, attention_mask=mask, **kwargs)
    agree = torch.equal(ours, expected)
    # bf16 compute in both, but not the same kernels: report how many tokens agree when not all do
    print(f"generate == transformers' greedy generate (bf16 autocast): {agree} "
          f"({int((ours == expected).sum())} of {expected.numel()} tokens)")
    if not agree and (ours == expected).float().mean() < 0.9:
        failures.append("generate")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
