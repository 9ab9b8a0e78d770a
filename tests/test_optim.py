"""Parameter groups, schedules, clipping and loss scaling on plain tensors (the sharded cases are in test_strategy)."""

import math

import pytest
import torch

from fullshard.optim import (
    ShardedGradScaler,
    clip_and_step,
    clip_grad_norm,
    create_optimizer,
    create_scheduler,
    lr_lambda,
    param_groups,
)
from fullshard.testing import build_model, make_batch


def test_groups_exempt_biases_norms_embeddings_and_split_by_dtype():
    model = build_model("qwen2")  # qwen2 has q/k/v biases
    model.lm_head.to(torch.bfloat16)
    groups = param_groups(model, weight_decay=0.1)
    decay_of = {name: g["weight_decay"] for g in groups for name in g["param_names"]}
    assert decay_of["model.layers.0.self_attn.q_proj.bias"] == 0.0
    assert decay_of["model.layers.0.input_layernorm.weight"] == 0.0
    assert decay_of["model.embed_tokens.weight"] == 0.0
    assert decay_of["model.layers.0.mlp.up_proj.weight"] == 0.1
    for group in groups:
        assert len({p.dtype for p in group["params"]}) == 1
    assert {p.dtype for g in groups for p in g["params"] if g["weight_decay"]} == {torch.float32, torch.bfloat16}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    decayed = param_groups(model, 0.1, decay_embeddings=True)
    assert {n: g["weight_decay"] for g in decayed for n in g["param_names"]}["model.embed_tokens.weight"] == 0.1
    with pytest.raises(ValueError, match="optimizer name must be one of"):
        create_optimizer(model, name="lamb")
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(model, 0.1)


def test_schedules_warm_up_then_decay_to_the_floor():
    for name in ("constant", "linear", "cosine"):
        f = lr_lambda(name, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
        assert [f(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
        assert f(4) == pytest.approx(1.0)
        assert f(14) == pytest.approx(1.0 if name == "constant" else 0.1)
        assert f(100) == pytest.approx(f(14))
    assert lr_lambda("cosine", 0, 10)(5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lr schedule must be one of"):
        lr_lambda("step", 0, 10)
    model = build_model("llama")
    opt = create_optimizer(model, lr=1.0)
    scheduler = create_scheduler(opt, "linear", warmup_steps=0, total_steps=4)
    lrs = []
    for _ in range(4):
        opt.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_clipping_matches_torch_and_zero_means_untouched():
    model = build_model("llama")
    model(**make_batch("llama")).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = clip_grad_norm(model.parameters(), max_norm=0.0)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    reference = build_model("llama")
    reference(**make_batch("llama")).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1))
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    assert clip_grad_norm(model.parameters(), max_norm=0.1) == pytest.approx(ref_norm, rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-8), n


def test_fp16_scaler_skips_overflow_and_backs_off_then_grows():
    model = build_model("llama")
    opt = create_optimizer(model, lr=1e-2)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale_loss(model(**make_batch("llama")).loss).backward()
    next(model.parameters()).grad[0, 0] = float("inf")  # an overflow in one gradient
    result = clip_and_step(opt, max_norm=1.0, scaler=scaler)
    assert result.skipped and math.isinf(result.grad_norm) and scaler.scale == 2.0**7
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for _ in range(2):
        scaler.scale_loss(model(**make_batch("llama")).loss).backward()
        result = clip_and_step(opt, max_norm=1.0, scaler=scaler)
        assert not result.skipped
    assert scaler.scale == 2.0**8  # grew after growth_interval good steps
    # the unscaled norm is the true one: a scaled backward then unscale equals an unscaled backward
    fresh, other = build_model("llama"), build_model("llama")
    ShardedGradScaler(init_scale=1024.0).scale_loss(fresh(**make_batch("llama")).loss).backward()
    ShardedGradScaler(init_scale=1024.0).unscale_(fresh.parameters())
    other(**make_batch("llama")).loss.backward()
    assert clip_grad_norm(fresh.parameters(), 0.0) == pytest.approx(clip_grad_norm(other.parameters(), 0.0), rel=1e-6)
    state = scaler.state_dict()
    restored = ShardedGradScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
