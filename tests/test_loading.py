"""Loading a checkpoint straight into shards gives exactly what plain transformers gives in one process.

Checkpoints are written here by `save_pretrained` of the zoo models (and rewritten as indexed
safetensors, `.bin`, DCP and a Hub cache), then loaded at world sizes 1-4 and compared tensor by
tensor, logit by logit and loss by loss with `from_pretrained` in one process.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fullshard.testing import reported_by_every_rank, run_distributed
from fullshard.testing.zoo import build_model, make_batch, model_class

# one AdamW step: gradients are averaged over ranks, so the sum order differs. A model kept in bf16
# also reduces its gradients in bf16 (8 bits of mantissa): at world 3 the loss after the step moved
# by 7e-5, rounding, not a wrong load (its logits before the step are still compared exactly).
STEP_TOL = {"float32": 1e-5, "bfloat16": 5e-4}
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


# --------------------------------------------------------------------------- checkpoints on disk


def save_hf(model, directory: Path, **kwargs) -> str:
    model.save_pretrained(directory, **kwargs)
    return str(directory)


def rewrite_as_bin(hf_dir: str, directory: Path, files: int = 1) -> str:
    """The same tensors as `.bin` pickles (transformers 5 no longer writes them), indexed when files > 1."""
    directory.mkdir(parents=True)
    shutil.copy(Path(hf_dir) / "config.json", directory / "config.json")
    state = load_file(Path(hf_dir) / "model.safetensors")
    keys = sorted(state)
    if files == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return str(directory)
    weight_map = {}
    for i in range(files):
        name = f"pytorch_model-{i + 1:05d}-of-{files:05d}.bin"
        part = {k: state[k] for k in keys[i::files]}
        torch.save(part, directory / name)
        weight_map.update({k: name for k in part})
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(directory)


def save_dcp(model, directory: Path, nested: bool) -> str:
    import torch.distributed.checkpoint as dcp

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": state} if nested else state, checkpoint_id=str(directory), no_dist=True)
    return str(directory)


def make_hub_cache(hf_dir: str, cache: Path, repo_id: str) -> str:
    """A Hub cache as `snapshot_download` leaves it, so a Hub id resolves with no network."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(hf_dir, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return str(cache)


def tensor_bytes(hf_dir: str) -> tuple[int, dict[str, tuple]]:
    """Total tensor bytes of a safetensors checkpoint, read from its headers."""
    total = 0
    for path in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape()) * f.get_tensor(key).element_size()
    return total


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for name in ("llama", "qwen3", "bert", "mixtral", "qwen3_moe", "gpt2"):
        paths[name] = save_hf(build_model(name, seed=1), root / name)
    paths["mixtral2"] = save_hf(build_model("mixtral", seed=1, num_local_experts=2), root / "mixtral2")
    paths["qwen3_indexed"] = save_hf(build_model("qwen3", seed=1), root / "qwen3_indexed", max_shard_size="20KB")
    paths["llama_bin"] = rewrite_as_bin(paths["llama"], root / "llama_bin")
    paths["mixtral_bin"] = rewrite_as_bin(paths["mixtral"], root / "mixtral_bin", files=3)
    paths["llama_dcp"] = save_dcp(build_model("llama", seed=1), root / "llama_dcp", nested=False)
    paths["mixtral_dcp"] = save_dcp(build_model("mixtral", seed=1), root / "mixtral_dcp", nested=True)
    paths["llama_bf16"] = save_hf(build_model("llama", seed=1, dtype=torch.bfloat16), root / "llama_bf16")
    paths["hub_cache"] = make_hub_cache(paths["qwen3"], root / "hub", "fake-org/tiny-qwen3")
    return paths


CORE = ("llama", "qwen3_indexed", "bert", "mixtral", "mixtral2")  # at every world size
SOURCES_AT = {1: (), 2: ("llama_bin", "llama_dcp"), 3: "all", 4: ("mixtral_dcp",)}


def equivalence_cases(paths: dict, world_size: int) -> list[dict]:
    """(what to load, how, and the plain-transformers reference) for one world size.

    The model families run at every world size; the other sources all run at 3 (uneven splits,
    an empty shard), some at 2 and 4, which keeps the file inside its time budget.
    """
    def case(label, zoo, source, reference, via="from_pretrained", dtype=None, ref_dtype=None, **extra):
        return dict(label=label, zoo=zoo, source=source, reference=reference, via=via, dtype=dtype,
                    ref_dtype=ref_dtype, budget=tensor_bytes(reference), **extra)

    cases = {
        "llama": case("llama untied rotary, single file", "llama", paths["llama"], paths["llama"]),
        "qwen3_indexed": case("qwen3 tied rotary, indexed files", "qwen3", paths["qwen3_indexed"], paths["qwen3"]),
        "bert": case("bert encoder, position_ids", "bert", paths["bert"], paths["bert"]),
        "mixtral": case("mixtral MoE, experts fused on load", "mixtral", paths["mixtral"], paths["mixtral"]),
        # 2 experts over 4 ranks: the engine shards expert tensors along a later dim, which the loader must slice
        "mixtral2": case("mixtral MoE, 2 experts (shorter than the group)", "mixtral", paths["mixtral2"],
                         paths["mixtral2"]),
        "gpt2": case("gpt2 tied Conv1D", "gpt2", paths["gpt2"], paths["gpt2"]),
        "qwen3_moe": case("qwen3_moe MoE", "qwen3_moe", paths["qwen3_moe"], paths["qwen3_moe"]),
        "llama_bin": case("llama .bin", "llama", paths["llama_bin"], paths["llama"]),
        "mixtral_bin": case("mixtral indexed .bin", "mixtral", paths["mixtral_bin"], paths["mixtral"]),
        "llama_dcp": case("llama DCP (flat)", "llama", paths["llama_dcp"], paths["llama"], via="dcp"),
        "mixtral_dcp": case("mixtral DCP (under model.)", "mixtral", paths["mixtral_dcp"], paths["mixtral"], via="dcp"),
        "bf16": case("llama bf16 checkpoint kept bf16", "llama", paths["llama_bf16"], paths["llama_bf16"]),
        "bf16_to_fp32": case("llama bf16 checkpoint into fp32 masters", "llama", paths["llama_bf16"],
                             paths["llama_bf16"], dtype="fp32", ref_dtype=torch.float32),
        "llama_all_meta": case("llama built wholly on meta (buffers recomputed)", "llama", paths["llama"],
                               paths["llama"], via="all_meta"),
        "bert_all_meta": case("bert built wholly on meta (buffers recomputed)", "bert", paths["bert"],
                              paths["bert"], via="all_meta"),
        "hub": case("qwen3 by Hub id from the cache, offline", "qwen3", "fake-org/tiny-qwen3", paths["qwen3"],
                    cache_dir=paths["hub_cache"]),
    }
    extra = SOURCES_AT[world_size]
    chosen = [*CORE, *(k for k in cases if k not in CORE)] if extra == "all" else [*CORE, *extra]
    return [cases[k] for k in chosen]


# --------------------------------------------------------------------------- the distributed side


def _load(case: dict, engine):
    import transformers

    from fullshard import FSDP2Engine, from_pretrained, init_empty_model

    if case["via"] == "from_pretrained":
        return from_pretrained(case["source"], engine=engine, dtype=case["dtype"], verify=True,
                               cache_dir=case.get("cache_dir"))
    config = transformers.AutoConfig.from_pretrained(case["reference"])
    if case["via"] == "dcp":
        model = init_empty_model(config)
        return FSDP2Engine({"dcp_path": case["source"]}).shard_model(model, verify=True)
    with torch.device("meta"):  # parameters and buffers on meta: buffers must be recomputed
        model = model_class(case["zoo"])._from_config(config)
    return engine.shard_model(model, case["source"], verify=True)


def _compare_one(case: dict, engine) -> dict:
    import transformers
    from harness.compare import full_state
    from torch.distributed.tensor import DTensor

    from fullshard import reshard_all

    ref_kwargs = {"dtype": case["ref_dtype"]} if case["ref_dtype"] is not None else {}
    reference = getattr(transformers, model_class(case["zoo"]).__name__).from_pretrained(case["reference"], **ref_kwargs)
    model = _load(case, engine)
    report = model.fullshard_load_report
    out = {"label": case["label"], "problems": []}

    params, ref_params = full_state(model), dict(reference.named_parameters())
    ref_state = reference.state_dict()
    if set(params) != set(ref_params):
        out["problems"].append(f"parameter names differ: {sorted(set(params) ^ set(ref_params))}")
    for key in sorted(set(params) & set(ref_params)):
        if params[key].dtype != ref_params[key].dtype or not torch.equal(params[key], ref_params[key].detach()):
            out["problems"].append(f"parameter {key} differs ({params[key].dtype} vs {ref_params[key].dtype})")
    buffers, ref_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
    if set(buffers) != set(ref_buffers):
        out["problems"].append(f"buffer names differ: {sorted(set(buffers) ^ set(ref_buffers))}")
    for key in sorted(set(buffers) & set(ref_buffers)):
        if buffers[key].dtype != ref_buffers[key].dtype or not torch.equal(buffers[key], ref_buffers[key]):
            out["problems"].append(f"buffer {key} differs from a normal load")
    missing_from_state = sorted(set(ref_state) - set(model.state_dict()))
    if missing_from_state:
        out["problems"].append(f"state-dict keys absent: {missing_from_state}")

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    out["tied_expected"] = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    out["tied"] = head.weight is embed.weight

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # before any forward (see DESIGN)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    batch = make_batch(case["zoo"], batch_size=2, seq_len=8)
    model.eval()
    reference.eval()
    with torch.no_grad():
        logits, ref_logits = model(**batch).logits, reference(**batch).logits
    out["logits_equal"] = torch.equal(logits, ref_logits)
    out["logits_diff"] = (logits.float() - ref_logits.float()).abs().max().item()
    reshard_all(model)
    model.train()
    reference.train()
    for m, opt in ((model, optimizer), (reference, ref_optimizer)):
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        out["loss_after_step"] = float(model(**batch).loss)
        out["ref_loss_after_step"] = float(reference(**batch).loss)
    out["shard_dims"] = sorted({pl.dim for p in model.parameters() if isinstance(p, DTensor)
                                for pl in p.placements if pl.is_shard()})
    out["bytes_read"] = report.bytes_read
    out["verified"] = report.verified
    out["format"] = report.format
    out["dtype"] = report.dtype
    # the allowance: this rank's share of the checkpoint plus one slice of every tensor along the
    # dim it is sharded on (uneven splits); tensors that are not sharded are read whole
    slack = 0
    for t in {id(t): t for t in model.state_dict().values()}.values():
        dims = [pl.dim for pl in t.placements if pl.is_shard()] if isinstance(t, DTensor) else []
        slack += t.numel() // t.shape[dims[0]] * t.element_size() if dims else t.numel() * t.element_size()
    out["allowance"] = case["budget"] // torch.distributed.get_world_size() + slack
    return out


def _equivalence(cases: list[dict]) -> list[dict]:
    from fullshard import FSDP2Engine

    engine = FSDP2Engine({"mixed_precision": "fp32"})
    return [_compare_one(case, engine) for case in cases]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_load_equals_plain_transformers(checkpoints, world_size, monkeypatch):
    monkeypatch.setenv("FULLSHARD_LOAD_THREADS", "4")  # several reader threads per rank, on any machine
    cases = equivalence_cases(checkpoints, world_size)
    results = run_distributed(_equivalence, world_size, cases)
    problems = []
    for rank, per_case in enumerate(results):
        for r in per_case:
            where = f"rank {rank} [{r['label']}]"
            problems += [f"{where}: {p}" for p in r["problems"]]
            if not r["logits_equal"]:
                problems.append(f"{where}: logits differ by {r['logits_diff']:.3e}")
            if abs(r["loss_after_step"] - r["ref_loss_after_step"]) > STEP_TOL[r["dtype"]]:
                problems.append(f"{where}: loss after one step {r['loss_after_step']} vs {r['ref_loss_after_step']}")
            if r["tied"] != r["tied_expected"]:
                problems.append(f"{where}: tie is {r['tied']}, reference {r['tied_expected']}")
            if r["bytes_read"] > r["allowance"]:
                problems.append(f"{where}: read {r['bytes_read']} bytes, allowance {r['allowance']}")
            if not r["verified"]:
                problems.append(f"{where}: NaN verification did not run")
    assert not problems, "\n".join(problems)
    # the cases really went through the sources they name
    formats = {r["label"]: (r["format"], r["dtype"]) for r in results[0]}
    expected = {"llama .bin": ("bin", "float32"), "llama DCP (flat)": ("dcp", "float32"),
                "qwen3 tied rotary, indexed files": ("safetensors", "float32"),
                "llama bf16 checkpoint kept bf16": ("safetensors", "bfloat16"),
                "llama bf16 checkpoint into fp32 masters": ("safetensors", "float32")}
    assert {k: formats[k] for k in expected if k in formats} == {k: v for k, v in expected.items() if k in formats}
    if world_size == 4:
        dims = {r["label"]: r["shard_dims"] for r in results[0]}
        assert dims["mixtral MoE, 2 experts (shorter than the group)"] != [0], "the later-dim slicing was not exercised"
    # the ranks together read the checkpoint exactly once
    full = tensor_bytes(checkpoints["llama"])
    llama_reads = [per_case[0]["bytes_read"] for per_case in results]
    assert sum(llama_reads) == full, (llama_reads, full)


# --------------------------------------------------------------------------- bad input


class _Payload:
    """A pickle that would create a file if unpickled without weights_only."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _edited(src: str, directory: Path, edit) -> str:
    """A copy of checkpoint `src` whose tensors went through `edit(dict)`."""
    from safetensors.torch import save_file

    shutil.copytree(src, directory)
    state = load_file(Path(src) / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory)


@pytest.fixture(scope="module")
def bad_checkpoints(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good = checkpoints["llama"]
    bad = {
        "missing": _edited(good, root / "missing", lambda s: s.pop("model.norm.weight")),
        "unexpected": _edited(good, root / "unexpected", lambda s: s.update({"model.extra.weight": torch.ones(3)})),
        "shape": _edited(good, root / "shape", lambda s: s.update(
            {"model.layers.0.mlp.up_proj.weight": torch.ones(63, 32)})),
        "both": _edited(good, root / "both", lambda s: (s.pop("model.norm.weight"),
                                                        s.update({"model.extra.weight": torch.ones(3)}))),
    }
    shutil.copytree(good, root / "truncated")
    data = (root / "truncated" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[:-100])
    shutil.copytree(good, root / "corrupt")
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    rewrite_as_bin(good, root / "malicious")
    marker = root / "pwned"
    torch.save({"model.norm.weight": torch.ones(32), "x": _Payload(str(marker))}, root / "malicious" / "pytorch_model.bin")
    (root / "dcp_malicious").mkdir()  # a crafted DCP `.metadata`: unpickling it would create the marker
    dcp_marker = root / "pwned_by_dcp"
    (root / "dcp_malicious" / ".metadata").write_bytes(pickle.dumps(_Payload(str(dcp_marker))))
    rewrite_as_bin(good, root / "bad_index", files=2)
    (root / "bad_index" / "pytorch_model-00002-of-00002.bin").unlink()
    bad.update(truncated=str(root / "truncated"), corrupt=str(root / "corrupt"), malicious=str(root / "malicious"),
               bad_index=str(root / "bad_index"), not_dcp=good, marker=str(marker), good=good,
               dcp_malicious=str(root / "dcp_malicious"), dcp_marker=str(dcp_marker),
               hub_cache=checkpoints["hub_cache"])
    return bad


def _bad_inputs(bad: dict) -> dict:
    import torch.distributed as dist
    import transformers

    from fullshard import FSDP2Engine, LoadError, from_pretrained, init_empty_model

    engine = FSDP2Engine({"mixed_precision": "fp32"})
    config = transformers.AutoConfig.from_pretrained(bad["good"])
    out = {}

    def attempt(label, load):
        model = init_empty_model(config)
        try:
            load(model)
            out[label] = ("no error", "", False)
        except LoadError as exc:
            untouched = all(p.is_meta for p in model.parameters())
            out[label] = ("LoadError", str(exc), untouched)

    for label in ("missing", "unexpected", "shape", "truncated", "corrupt", "malicious", "bad_index"):
        attempt(label, lambda m, label=label: engine.shard_model(m, bad[label]))
    for label in ("not_dcp", "dcp_malicious"):
        attempt(label, lambda m, label=label: FSDP2Engine({"dcp_path": bad[label]}).shard_model(m))
    try:
        from_pretrained("fake-org/absent", engine=engine, cache_dir=bad["hub_cache"])
        out["hub_absent"] = ("no error", "", False)
    except LoadError as exc:
        out["hub_absent"] = ("LoadError", str(exc), True)

    # strict=False loads what fits, gives the rest the model's own init, and lists both
    model = engine.shard_model(init_empty_model(config), bad["both"], strict=False, verify=True)
    report = model.fullshard_load_report
    norm = model.model.norm.weight.full_tensor()
    out["lenient"] = dict(missing=report.missing, unexpected=report.unexpected, verified=report.verified,
                          norm_is_init=bool(torch.equal(norm, torch.ones_like(norm))))
    flag = torch.ones(1)
    dist.all_reduce(flag)  # every rank is still in step after all of the above
    out["in_step"] = float(flag) == dist.get_world_size()
    return out


def test_bad_input_fails_on_every_rank_with_names(bad_checkpoints):
    results = run_distributed(_bad_inputs, 2, bad_checkpoints)
    expected = {  # label -> what the message must name
        "missing": ["missing keys", "model.norm.weight"],
        "unexpected": ["unexpected keys", "model.extra.weight"],
        "shape": ["model.layers.0.mlp.up_proj.weight", "[63, 32]", "[64, 32]"],
        "truncated": ["truncated", "model.safetensors"],
        "corrupt": ["corrupt", "model.safetensors"],
        "malicious": ["refused", "pytorch_model.bin", "weights_only"],
        "bad_index": ["pytorch_model-00002-of-00002.bin", "do not exist"],
        "not_dcp": ["not a DCP checkpoint"],
        "dcp_malicious": ["dcp_malicious/.metadata", "refused"],
        "hub_absent": ["fake-org/absent", "rank 0:", "HF_HUB_OFFLINE"],  # only the downloading rank fails
    }
    problems = []
    for rank, out in enumerate(results):
        for label, needles in expected.items():
            kind, message, untouched = out[label]
            if kind != "LoadError":
                problems.append(f"rank {rank} {label}: {kind}")
                continue
            absent = [n for n in needles if n not in message]
            if absent:
                problems.append(f"rank {rank} {label}: message lacks {absent}: {message}")
            if not untouched:
                problems.append(f"rank {rank} {label}: the model was touched before the error")
            if label != "hub_absent" and not reported_by_every_rank(message, 2):
                problems.append(f"rank {rank} {label}: not every rank's failure is reported: {message}")
        lenient = out["lenient"]
        if lenient["missing"] != ["model.norm.weight"] or lenient["unexpected"] != ["model.extra.weight"]:
            problems.append(f"rank {rank} strict=False lists {lenient}")
        if not (lenient["verified"] and lenient["norm_is_init"]):
            problems.append(f"rank {rank} strict=False left a missing key uninitialised: {lenient}")
        if not out["in_step"]:
            problems.append(f"rank {rank} fell out of step")
    assert not problems, "\n".join(problems)
    assert not Path(bad_checkpoints["marker"]).exists(), "the malicious pickle ran code"
    assert not Path(bad_checkpoints["dcp_marker"]).exists(), "the malicious DCP metadata ran code"


# --------------------------------------------------------------------------- slice recipes


def test_slice_recipes_read_exactly_the_region_of_the_converted_tensor(tmp_path):
    """Any region of a stacked / concatenated / converted tensor equals the same region of the
    tensor built whole, and a stack reads no more bytes than the region it returns."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from fullshard.loading.convert import Concat, Converted, Stack, Stored
    from fullshard.loading.safetensors_reader import SafetensorsReader

    generator = torch.Generator().manual_seed(0)
    tensors = {f"e{i}.{w}": torch.randn(5, 3, generator=generator) for i in range(4) for w in ("a", "b")}
    save_file(tensors, tmp_path / "t.safetensors")
    reader = SafetensorsReader([tmp_path / "t.safetensors"])
    stacks = [Stack([Stored(reader, f"e{i}.{w}") for i in range(4)], dim=0) for w in ("a", "b")]
    whole_stacks = [torch.stack([tensors[f"e{i}.{w}"] for i in range(4)]) for w in ("a", "b")]
    recipes = {
        "stack then cat on dim 1 (fused gate_up)": (Concat(stacks, dim=1), torch.cat(whole_stacks, dim=1)),
        "cat on dim 0 (rows span parts)": (Concat([Stored(reader, "e0.a"), Stored(reader, "e1.b")], dim=0),
                                          torch.cat([tensors["e0.a"], tensors["e1.b"]])),
        "stack on dim 1": (Stack([Stored(reader, f"e{i}.a") for i in range(4)], dim=1),
                           torch.stack([tensors[f"e{i}.a"] for i in range(4)], dim=1)),
    }
    converter = WeightConverter("e0.a", "t", operations=[Transpose(0, 1)])
    transposed = Converted(converter, {"e0.a": [Stored(reader, "e0.a")]}, "t")
    recipes["a conversion with no sliceable form"] = (transposed, tensors["e0.a"].t())
    for label, (recipe, whole) in recipes.items():
        for dim in range(whole.dim()):
            size = whole.shape[dim]
            for start, stop in ((0, size), (1, size - 1), (size - 1, size), (2, 2)):
                index = tuple(slice(start, stop) if d == dim else slice(0, n) for d, n in enumerate(whole.shape))
                got = recipe.read(index)
                assert torch.equal(got, whole[index]), (label, dim, start, stop)
    before = reader.bytes_read
    region = (slice(1, 3), slice(0, 10), slice(0, 3))  # experts 1 and 2 of the fused tensor
    Concat(stacks, dim=1).read(region)
    assert reader.bytes_read - before == 2 * 2 * 5 * 3 * 4  # 2 experts x (a, b) x 5x3 fp32, nothing more
