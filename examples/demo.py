"""Shard a tiny Llama on every rank torchrun started and train it a few steps.

    torchrun --nproc_per_node 2 examples/demo.py
"""

import torch
import torch.distributed as dist

from fullshard import FSDP2Engine, get_rank, get_world_size
from fullshard.testing import build_model, make_batch
from fullshard.testing.compare import data_slice, grad_norm


def main() -> None:
    engine = FSDP2Engine({"mixed_precision": "fp32", "activation_checkpointing": True})
    model = engine.prepare_model(build_model("llama"))
    if get_rank() == 0:
        print(engine.plan.describe(model, engine.shard_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = make_batch("llama", batch_size=4 * get_world_size(), seq_len=32)
    for step in range(10):
        loss = model(**data_slice(batch, get_rank(), get_world_size())).loss
        loss.backward()
        norm = grad_norm(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        if get_rank() == 0:
            print(f"step {step}  loss {loss.item() / get_world_size():.4f}  grad norm {norm.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
