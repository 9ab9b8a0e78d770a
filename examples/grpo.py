"""GRPO on CPU in minutes: the training half of an RL framework on fullshard.

    python examples/grpo.py --out runs/grpo        # 2 trainer ranks + 1 engine process, CPU / gloo

Three processes: two trainer ranks train the actor with `FSDPStrategy` (sharded over both), and
hold a frozen reference model (sharded, no optimizer, offloaded to the host while the actor
trains, with the strategy's offload calls); one engine process holds a plain transformers model
that receives the actor's weights through `fullshard.WeightSync` after every optimizer step and
samples the next rollouts from them. The trainers and the engine meet only at the sync's TCP
rendezvous and a queue of rollouts (a framework would use its own transport).

The task is a verifiable toy: after a prompt of random tokens, a completion scores the fraction of
its tokens that belong to a 20-token answer alphabet (a random policy scores about 0.2, the best 1). The
update is `fullshard.rl`'s: GRPO advantages within each prompt's group (`group_advantages`), the
reference's log-probs (`reference_logprobs`), and one `policy_update` (the clipped policy-gradient
term per token plus the k3 KL estimate, globally aggregated over both ranks). The mean reward of every step
goes to `rewards.json` and `rewards.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HOST = "127.0.0.1"
VOCAB, PROMPT_LEN, COMPLETION_LEN = 101, 6, 8
ALPHABET = 20  # a completion should use token ids 0..19 only


def policy_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_policy(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(policy_config())


def reward(prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """Per sequence: the fraction of completion tokens in the answer alphabet (ids below ALPHABET)."""
    return (completion < ALPHABET).float().mean(dim=1)


def rollouts(sequences: torch.Tensor, rewards: torch.Tensor, group: int, reference):
    """The update's input: whole sequences, the completion positions scored (entry t of the log-probs
    scores token t + 1), GRPO advantages within each prompt's group, the reference's log-probs (its
    weights brought from the host for the call and sent back)."""
    from fullshard import rl

    attention = torch.ones_like(sequences)
    response = (torch.arange(sequences.shape[1] - 1) >= PROMPT_LEN - 1).float().expand(len(sequences), -1)
    return rl.Rollouts(sequences, attention, response, rl.group_advantages(rewards, group),
                       ref_logprobs=rl.reference_logprobs(reference, sequences, attention))


# ----------------------------------------------------------------------------------------- the engine


def engine_main(args, sync_port: int, queues) -> None:
    """Pull the weights, sample every prompt's group, send each trainer rank its prompts' groups."""
    from fullshard import WeightSync, weight_loader

    torch.set_num_threads(1)
    model = build_policy(seed=1234).eval()  # its own random weights: the first pull replaces them all
    load_weights = weight_loader(model)
    sync = WeightSync.engine(HOST, sync_port, engine_rank=0, num_engines=1, timeout_s=args.timeout_s)
    generator = torch.Generator().manual_seed(args.seed)
    sync.pull(load_weights)
    for step in range(args.steps):
        prompts = torch.randint(3, VOCAB, (args.prompts, PROMPT_LEN), generator=generator)
        torch.manual_seed(args.seed * 1000 + step)
        with torch.no_grad():
            sequences = model.generate(prompts.repeat_interleave(args.group, 0), do_sample=True, temperature=1.0,
                                       top_k=0, top_p=1.0, max_new_tokens=COMPLETION_LEN,
                                       min_new_tokens=COMPLETION_LEN, pad_token_id=0)
        per_rank = len(sequences) // len(queues)
        for rank, queue in enumerate(queues):
            queue.put(sequences[rank * per_rank:(rank + 1) * per_rank].tolist())
        sync.pull(load_weights)  # the actor after this step's update


# ----------------------------------------------------------------------------------------- the trainer


def prepare(args):
    from fullshard import FSDPStrategy, rl

    strategy = FSDPStrategy(seed=args.seed, max_norm=1.0, micro_train_batch_size=1, train_batch_size=2, bf16=False)
    strategy.setup_distributed(timeout=args.timeout_s)
    actor = strategy.prepare_model(build_policy(), is_training=True)
    reference = strategy.prepare_model(build_policy(), is_training=False)  # the initial policy, frozen
    reference.requires_grad_(False)
    rl.offload(reference)  # on the host between its forwards (`rl.reference_logprobs`)
    optimizer = strategy.create_optimizer(actor, lr=args.lr, weight_decay=0.0)
    return strategy, actor, reference, optimizer


def trainer_main(rank: int, args, ports: dict, queue, results) -> None:
    import torch.distributed as dist

    from fullshard import WeightSync, rl

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR=HOST, MASTER_PORT=str(ports["torch"]))
    torch.set_num_threads(1)
    strategy, actor, reference, optimizer = prepare(args)
    sync = WeightSync.trainer(HOST, ports["sync"], num_engines=1, timeout_s=args.timeout_s)
    sync.push(actor)  # the engine samples the first rollouts from the initial weights
    config = rl.UpdateConfig(kl_coef=args.kl_coef, kl_kind="k3", max_norm=1.0)
    history = []
    for step in range(args.steps):
        sequences = torch.tensor(queue.get(timeout=args.timeout_s))
        rewards = reward(sequences[:, :PROMPT_LEN], sequences[:, PROMPT_LEN:])
        batch = rollouts(sequences, rewards, args.group, reference)
        update = rl.policy_update(actor, optimizer, batch, config, dp_size=2)  # on-policy: ratio 1
        report = sync.push(actor)
        mean_reward = float(strategy.all_reduce(rewards.mean(), op="mean"))
        mean_kl = update["kl"]
        history.append({"step": step + 1, "reward": mean_reward, "kl": mean_kl, "sync_version": report.version,
                        "sync_seconds": report.seconds})
        strategy.print(f"step {step + 1:3d}  reward {mean_reward:.3f}  kl {mean_kl:.4f}  "
                       f"weights v{report.version} in {report.seconds * 1000:.0f} ms")
    if rank == 0:
        results.put(history)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- the run


def plot(history: list[dict], path: Path) -> Path | None:
    from fullshard.train.metrics import plot_lines

    rewards = [(h["step"], h["reward"]) for h in history]
    return plot_lines(path, {"mean reward": (rewards, "-")}, ylabel="mean reward",
                      title="GRPO, 2 FSDP trainer ranks + 1 engine (CPU)")


def run(args) -> list[dict]:
    from fullshard.distributed import find_free_port

    context = mp.get_context("spawn")
    queues, results = [context.Queue() for _ in range(2)], context.Queue()
    ports = {"torch": find_free_port(), "sync": find_free_port()}
    processes = [context.Process(target=trainer_main, args=(rank, args, ports, queues[rank], results), daemon=True)
                 for rank in range(2)]
    processes.append(context.Process(target=engine_main, args=(args, ports["sync"], queues), daemon=True))
    os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # a CPU example: the children see no GPU
    for process in processes:
        process.start()
    history = None
    try:
        while history is None:
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a process of the example failed (exit codes {[p.exitcode for p in processes]})")
            try:
                history = results.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes again
                pass
        for process in processes:
            process.join(timeout=60)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/grpo", help="where rewards.json and rewards.png go")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (split over the 2 trainer ranks)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kl-coef", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    history = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rewards.json").write_text(json.dumps(history, indent=1) + "\n")
    png = plot(history, out / "rewards.png")
    first, last = (sum(h["reward"] for h in part) / len(part) for part in (history[:5], history[-5:]))
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}; {len(history)} steps in "
          f"{time.perf_counter() - started:.0f} s; " + (f"plot {png}" if png else "no plot (matplotlib missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
