"""Plans decided from the model alone: which modules become units, and every validation error."""

import warnings

import pytest
import torch

from fullshard import PlanError, ShardingPlan, UnitSpec, build_plan, find_blocks, get_transformer_layer_cls
from fullshard.distributed import ParallelDims
from fullshard.testing import ZOO, build_model

EXPECTED_UNITS = {
    "llama": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm + lm_head"],
    "mixtral": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm + lm_head"],
    "qwen3": ["model.layers.0", "model.layers.1", "model.embed_tokens + model.norm + lm_head"],
    "gemma": ["model.layers.0", "model.layers.1", "model.embed_tokens + model.norm + lm_head"],
    "gpt2": ["transformer.h.0", "transformer.h.1", "transformer.wte + transformer.ln_f + lm_head"],
    "bert": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
             "bert.embeddings.word_embeddings + cls"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_UNITS))
def test_auto_plan_units(name):
    model = build_model(name)
    plan = build_plan(model, "auto")
    assert plan.unit_names() == EXPECTED_UNITS[name]
    tail = plan.units[-1]
    assert tail.reshard_after_forward is False, "the tail keeps its full weight after forward"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_parameter_in_exactly_one_unit_and_ties_together(name):
    model = build_model(name)
    plan = build_plan(model)
    owner = plan.parameter_units(model)
    assert set(owner) == {n for n, _ in model.named_parameters()}
    # every name a tied parameter is reachable under resolves to the same unit
    names_by_param = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(pname)
    for names in names_by_param.values():
        units = {plan.unit_index_of(n.rpartition(".")[0]) for n in names}
        assert len(units) == 1, f"{names} split over units {units}"
    layer_cls = get_transformer_layer_cls(model)
    assert sum(isinstance(model.get_submodule(b), layer_cls) for b in find_blocks(model)) == 2


def test_moe_blocks_are_outermost_decoder_layers():
    for name in ("mixtral", "qwen3_moe"):
        model = build_model(name)
        blocks = find_blocks(model)
        assert blocks == ["model.layers.0", "model.layers.1"], blocks


def test_block_detection_without_hf_metadata():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.out = torch.nn.Linear(4, 2)

    assert find_blocks(Net()) == ["blocks.0", "blocks.1"]


def test_manual_plan_globs_and_policies():
    model = build_model("llama")
    plan = build_plan(model, {"mode": "manual", "modules": {
        "model.layers.*": ["free_full_weight", "cpu_offload"],
        "model.layers.*.mlp": ["keep_full_weight", "full_precision"],
        "model.norm + lm_head": "keep_full_weight",
    }})
    names = plan.unit_names()
    assert names[:2] == ["model.layers.0", "model.layers.1"]
    assert "model.layers.0.mlp" in names and "model.norm + lm_head" in names
    order = [u.name for u in plan.sharding_order()]
    assert order.index("model.layers.0.mlp") < order.index("model.layers.0"), "inner units shard first"
    mlp = plan.units[names.index("model.layers.0.mlp")]
    assert (mlp.reshard_after_forward, mlp.mixed_precision) == (False, False)
    layer = plan.units[0]
    assert (layer.reshard_after_forward, layer.cpu_offload) == (True, True)
    table = plan.describe(model, shard_size=2)
    assert "model.layers.0.mlp" in table and "<root>" in table and "total" in table


BAD_PLANS = {
    "no match": ("llama", {"mode": "manual", "modules": {"model.nothing.*": ["free_full_weight"]}},
                 "pattern 'model.nothing.*' matches no module"),
    "unknown policy": ("llama", {"mode": "manual", "modules": {"model.layers.*": ["fre_full_weight"]}},
                       "unknown policy 'fre_full_weight'"),
    "claimed twice": ("llama", {"mode": "manual", "modules": {"model.layers.*": [], "model.layers.0": []}},
                      "module 'model.layers.0' is claimed by two plan entries"),
    "tie split": ("gemma", {"mode": "manual", "modules": {"model.embed_tokens": ["cpu_offload"],
                                                          "lm_head": ["no_cpu_offload"]}},
                  "must be in one unit, but plan entries ['model.embed_tokens', 'lm_head'] set cpu_offload "
                  "differently"),
    "container unit": ("llama", ShardingPlan([UnitSpec(("model.layers",), source="by hand")]),
                       "'model.layers' is a container whose forward never runs"),
    "bad mode": ("llama", {"mode": "smart"}, "'mode' must be 'auto' or 'manual'"),
    "unknown key": ("llama", {"mode": "auto", "offload": True}, "unknown keys ['offload']"),
    "empty manual": ("llama", {"mode": "manual"}, "non-empty 'modules'"),
}


def check_bad_plan(case):
    name, spec, expected = BAD_PLANS[case]
    with pytest.raises(PlanError, match=expected.replace("[", r"\[").replace("(", r"\(").replace("*", r"\*")):
        build_plan(build_model(name), spec)


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plans_name_the_entry(case):
    check_bad_plan(case)


def test_mixed_dtypes_in_one_unit_is_an_error_naming_it():
    model = build_model("llama")
    model.model.layers[0].mlp.to(torch.bfloat16)
    with pytest.raises(PlanError, match=r"unit 'model.layers.0' mixes parameter dtypes"):
        build_plan(model)
    # giving the bf16 part its own unit is the fix
    build_plan(model, {"mode": "manual", "modules": {"model.layers.*": [], "model.layers.0.mlp": []}})


def test_frozen_and_trainable_in_one_unit_warns_and_auto_splits_them():
    model = build_model("llama")
    model.model.layers[0].self_attn.requires_grad_(False)
    with pytest.warns(UserWarning, match="'model.layers.0' holds both frozen and trainable"):
        build_plan(model, {"mode": "manual", "modules": {"model.layers.*": []}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = build_plan(model)
    split = [u for u in plan.units if u.source == "auto: block model.layers.0: trainable part"]
    assert len(split) == 1 and "model.layers.0.mlp.up_proj" in split[0].modules
    assert not any(m.startswith("model.layers.0.self_attn") for m in split[0].modules)


def test_nesting_cycle_is_an_error():
    plan = ShardingPlan([UnitSpec(("model.layers.0", "model.layers.1.mlp")),
                         UnitSpec(("model.layers.1", "model.layers.0.mlp"))])
    with pytest.raises(PlanError, match="nest inside each other"):
        plan.sharding_order()


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_replicate=3, world_size=4), "world size 4 is not divisible by dp_replicate=3"),
    (dict(dp_replicate=2, dp_shard=3, world_size=4), "dp_replicate=2 x dp_shard=3 = 6, but the world size is 4"),
    (dict(dp_replicate=0, world_size=4), "dp_replicate must be >= 1"),
])
def test_parallel_dims_errors_say_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_parallel_dims_infers_shard():
    dims = ParallelDims(dp_replicate=2, world_size=8)
    assert (dims.dp_shard, dims.hsdp, dims.dp_size) == (4, True, 8)


class _Block(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.inner = torch.nn.Linear(width, width)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.norm = torch.nn.LayerNorm(4)


class _Decoder(torch.nn.Module):
    """A trainable decoder registered before a frozen side model with blocks and a norm of its own (BLT's shape)."""

    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.decoder, self.side = _Stack(), _Stack().requires_grad_(False)
        self.head = torch.nn.Linear(4, 10)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_final_norm_is_beside_the_last_trainable_block_not_a_frozen_side_model():
    plan = build_plan(_Decoder())
    assert plan.units[-1].modules == ("decoder.norm", "head"), plan.unit_names()
    assert {"side.layers.0", "side.layers.1", "decoder.layers.0", "decoder.layers.1"} <= set(plan.unit_names())


def test_trainable_part_moved_out_of_a_unit_leaves_it():
    model = build_model("llama")
    model.model.norm.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = build_plan(model)
    by_source = {u.source: u.modules for u in plan.units}
    assert by_source["auto: tail"] == ("model.norm",)
    assert by_source["auto: tail: trainable part"] == ("lm_head",)
    assert not hasattr(plan, "mode"), "ShardingPlan.mode was write-only"


def test_repeated_blocks_found_without_declared_classes_with_parallel_lists():
    class Parallel(torch.nn.Module):
        """XLM's layout: per-layer attention, norm and feed-forward in parallel lists."""

        def __init__(self):
            super().__init__()
            self.attentions = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
            self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(8) for _ in range(3)])
            self.ffns = torch.nn.ModuleList([_Block(8) for _ in range(3)])
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])

    model = torch.nn.Module()
    model.transformer = Parallel()
    blocks = find_blocks(model)
    assert blocks == [f"transformer.{kind}.{i}" for kind in ("attentions", "ffns") for i in range(3)], blocks
    assert get_transformer_layer_cls(model) in (torch.nn.Linear, _Block)


def test_reversible_blocks_are_sharded_by_their_children():
    class Reversible(torch.nn.Module):
        """Reformer's convention: backward recomputes `attention` and `feed_forward` by hand."""

        def __init__(self):
            super().__init__()
            self.attention, self.feed_forward = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def backward_pass(self):
            pass

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Reversible(), Reversible()])
    assert find_blocks(model) == ["layers.0", "layers.1"]
    expected = [f"layers.{i}.{c}" for i in range(2) for c in ("attention", "feed_forward")]
    assert build_plan(model).unit_names() == expected


def test_frozen_part_below_a_trainable_root_keeps_the_unit_whole():
    from fullshard.plan.build import _split_trainable

    model = torch.nn.Module()
    model.holder = torch.nn.Module()
    model.holder.scale = torch.nn.Parameter(torch.ones(4))  # trainable, owned by the unit's root itself
    model.holder.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    plan = _split_trainable(model, ShardingPlan([UnitSpec(("holder",), source="auto: x")]))
    assert plan.unit_names() == ["holder"], "no empty unit is left behind"
