"""The chunked loss (`train/chunked_loss.py`) against the loss from whole logits, and the step's collectives.

Every 2-rank check runs in one spawned process group (`_world_2_checks`): FSDP (untied, tied, a
tail unit resharded after forward), TP 2 (head kept whole: chunked; head split over the
vocabulary: the plain loss), the largest logits tensor a step creates, and the collectives a step
issues. The reference is one process computing the loss from whole logits on the whole batch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.compare import data_slice, full_tensor
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fullshard import FSDP2Engine, FSDPStrategy
from fullshard.testing import build_model, make_batch, run_distributed
from fullshard.train.chunked_loss import chunkable_head, linear_cross_entropy_sum
from fullshard.train.loss import IGNORE_INDEX, causal_lm_loss_sum, normalized_loss, target_count
from fullshard.train.step import train_step

TOL = 1e-5
VOCAB, CHUNK = 1000, 16  # 64 tokens per rank: 4 chunks
LLAMA_LAYERS_TP = {f"model.layers.*.{m}": s for m, s in {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}.items()}


def _batch(name: str) -> dict:
    batch = make_batch(name, batch_size=8, seq_len=16, seed=3)
    batch["labels"][0, :5] = IGNORE_INDEX  # ignored targets take no part
    return batch


def _against_reference(name: str, shard, dp_rank: int, dp_size: int, **model_kwargs) -> dict:
    """Gradients of the token-normalised loss: the sharded model through the chunked loss on its
    data slice, against one process through whole logits on the whole batch."""
    kwargs = dict(vocab_size=VOCAB, **model_kwargs)
    reference, model = build_model(name, **kwargs), shard(build_model(name, **kwargs))
    batch = _batch(name)
    tokens = target_count(batch)
    (causal_lm_loss_sum(reference, batch, chunk_tokens=0) / tokens).backward()
    loss = causal_lm_loss_sum(model, data_slice(batch, dp_rank, dp_size), chunk_tokens=CHUNK)
    normalized_loss(loss, tokens, dp_size).backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    diffs = {n: (full_tensor(p.grad) - grads[n]).abs().max().item() for n, p in model.named_parameters()}
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    return {"grad_diff": max(diffs.values()), "largest_grad": max(g.abs().max().item() for g in grads.values()),
            "loss": float(summed) / (dist.get_world_size() // dp_size),
            "ref_loss": float(causal_lm_loss_sum(reference, batch, 0)),
            "chunked": chunkable_head(model) is not None}


class LargestVocabularyTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates whose last dim is the vocabulary (an output on
    an input's storage, a view or an in-place result, is not a new tensor)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and _storage(t) not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def _storage(value) -> int | None:
    """Where a plain tensor's memory is (None for anything else: a DTensor wraps a plain one)."""
    plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    return value.untyped_storage().data_ptr() if plain else None


def _step_observed(chunk: int) -> dict:
    """Training steps under FSDP after a warm-up step: the largest vocabulary-wide tensor of one,
    the collectives of the next (apart: the dispatch mode would show each collective twice)."""
    strategy = FSDPStrategy(bf16=False, micro_train_batch_size=4, train_batch_size=8, max_norm=1.0)
    model = strategy.prepare_model(build_model("llama", vocab_size=VOCAB), is_training=True)
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    batch = data_slice(_batch("llama"), dist.get_rank(), 2)
    train_step(strategy, model, optimizer, None, [batch], chunk)
    with LargestVocabularyTensor(VOCAB) as watch:
        train_step(strategy, model, optimizer, None, [batch], chunk)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = train_step(strategy, model, optimizer, None, [batch], chunk)
    names = [e.name for e in prof.events()]
    return {"largest": watch.largest, "tokens_per_rank": batch["input_ids"].numel(), "loss": out.loss,
            "norm": out.result.grad_norm,
            "all_reduces": sum(n in ("c10d::allreduce_", "_c10d_functional::all_reduce") for n in names),
            "embedding_all_gathers": names.count("FSDP::all_gather (model.embed_tokens)")}


def _world_2_checks() -> dict:
    rank = dist.get_rank()
    out = {}
    fsdp = FSDP2Engine({"mixed_precision": "fp32"})
    out["fsdp"] = _against_reference("llama", fsdp.prepare_model, rank, 2)
    out["fsdp_tied"] = _against_reference("qwen3", fsdp.prepare_model, rank, 2)
    resharded_tail = FSDP2Engine({"mixed_precision": "fp32", "plan": {"mode": "manual", "modules": {
        "model.layers.*": ["free_full_weight"], "model.norm + lm_head": ["free_full_weight"]}}})
    out["fsdp_tail_resharded"] = _against_reference("llama", resharded_tail.prepare_model, rank, 2)
    tp = FSDP2Engine({"mixed_precision": "fp32", "tp_size": 2, "tp_plan": LLAMA_LAYERS_TP})
    out["tp2"] = _against_reference("llama", tp.prepare_model, 0, 1)
    vocab_split = FSDP2Engine({"mixed_precision": "fp32", "tp_size": 2,
                               "tp_plan": dict(LLAMA_LAYERS_TP, lm_head="colwise_gather_output")})
    out["tp2_head_split"] = _against_reference("llama", vocab_split.prepare_model, 0, 1)
    out["steps"] = {chunk: _step_observed(chunk) for chunk in (0, CHUNK)}
    return out


@pytest.fixture(scope="module")
def world_2():
    return run_distributed(_world_2_checks, 2)


@pytest.mark.parametrize("case", ["fsdp", "fsdp_tied", "fsdp_tail_resharded", "tp2", "tp2_head_split"])
def test_chunked_loss_gradients_equal_whole_logits(world_2, case):
    for result in world_2:
        r = result[case]
        assert r["chunked"] == (case != "tp2_head_split")  # a vocabulary-split head keeps the plain loss
        assert r["largest_grad"] > 1e-3  # the comparison is not between zeros
        assert r["grad_diff"] < TOL, r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=TOL)


def test_no_logits_tensor_larger_than_a_chunk(world_2):
    for result in world_2:
        whole, chunked = result["steps"][0], result["steps"][CHUNK]
        assert whole["largest"] >= whole["tokens_per_rank"] * VOCAB  # the check sees the whole logits
        assert 0 < chunked["largest"] <= CHUNK * VOCAB
        assert chunked["loss"] == pytest.approx(whole["loss"], rel=TOL)
        assert chunked["norm"] == pytest.approx(whole["norm"], rel=TOL)


def test_step_pays_two_small_collectives_and_no_embedding_regather(world_2):
    """The target count, then one all_reduce carrying the grad norm and the loss sum (the old step
    had a third, and a second per mesh); the input embedding is not all-gathered for backward."""
    for result in world_2:
        for observed in result["steps"].values():
            assert observed["all_reduces"] == 2, observed
            assert observed["embedding_all_gathers"] == 1, observed


def test_linear_cross_entropy_matches_autograd_with_bias_and_ignored_rows():
    torch.manual_seed(0)
    hidden = torch.randn(3, 10, 8, requires_grad=True)
    weight, bias = torch.randn(50, 8, requires_grad=True), torch.randn(50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 10))
    targets[1, 3:] = IGNORE_INDEX
    ref = F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, 50), targets.reshape(-1), reduction="sum")
    expected = torch.autograd.grad(ref * 0.37, (hidden, weight, bias))
    loss = linear_cross_entropy_sum(hidden, weight, bias, targets, chunk=4)
    got = torch.autograd.grad(loss * 0.37, (hidden, weight, bias))
    assert float(loss) == pytest.approx(float(ref), rel=TOL)
    for a, b in zip(expected, got):
        assert (a - b).abs().max() < TOL
    loss = linear_cross_entropy_sum(hidden, weight, bias, targets, chunk=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        loss.backward()


def test_model_that_changes_its_logits_keeps_the_plain_loss(monkeypatch):
    """Gemma 2 soft-caps its logits: the chunked loss would not be its loss, so it is not used."""
    import transformers

    warnings = []
    monkeypatch.setattr("fullshard.objectives.logprobs.warn_rank0", warnings.append)
    config = transformers.Gemma2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=3.0)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    reference = copy.deepcopy(model)
    batch = make_batch("llama", batch_size=2, seq_len=16)
    first, again = causal_lm_loss_sum(model, batch, CHUNK), causal_lm_loss_sum(model, batch, CHUNK)
    expected = causal_lm_loss_sum(reference, batch, 0)
    assert float(first) == float(expected) == float(again)
    assert len(warnings) == 1 and "does not return its head's output unchanged" in warnings[0]
