"""Vision-language models: every image-text-to-text type transformers can build tiny, sharded and
trained exactly like one process, through steps where one rank, or every rank, has no image.

The sweep builds each type from a tiny config made generically from its default one
(`fullshard.testing.vlm_zoo`); a type is left out only when that tiny model cannot take an image and
a text-only row in one process (encoder-decoder, BLIP-2-style, an image layout no generic rule finds,
a config transformers itself cannot build) or when its images interact within a batch, so one process
on two halves already differs from one process on the whole; the left-out types are printed with
their reasons and counted.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from harness.vlm_parity import vlm_against_reference, vlm_problems

from fullshard.testing import run_distributed
from fullshard.testing.vlm_zoo import VLMInputs, build_vlm, tiny_vlm_config, vlm_types

MIN_TESTED = 30
MAX_PARAMS = 3_000_000
# trained with the vision tower frozen and trainable both: mRoPE (Qwen2-VL) and mRoPE with deepstack
# features (Qwen3-VL); every other type runs one of the two, alternating over the sorted types
BOTH_VARIANTS = ("qwen2_vl", "qwen3_vl")


def sweep_entry(model_type: str) -> str | None:
    """None when a tiny model of this type takes an image row and a text-only row in one process, else why not."""
    try:
        config = tiny_vlm_config(model_type)
        if getattr(config, "is_encoder_decoder", False) or getattr(getattr(config, "text_config", None),
                                                                   "is_encoder_decoder", False):
            return "encoder-decoder"
        size = _meta_size(model_type, config)
        if size is None or size <= MAX_PARAMS:
            model = build_vlm(model_type, config=config)
            size = sum(p.numel() for p in model.parameters())
        if size > MAX_PARAMS:
            return f"{size:,} parameters after shrinking"
        inputs = VLMInputs(model)
        model(**inputs.batch([True, False])).loss.backward()
        model(**inputs.batch([False, False])).loss.backward()
        return None
    except Exception as error:  # noqa: BLE001 - the reason is reported
        line = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")
        return f"{type(error).__name__}: {line[:120]}"


def _meta_size(model_type: str, config) -> int | None:
    """Parameters of the tiny model, counted on the meta device (a model too big is never built); None
    where the model cannot be built there."""
    from fullshard.testing.vlm_zoo import model_class

    try:
        with torch.device("meta"):
            return sum(p.numel() for p in model_class(model_type)._from_config(config).parameters())
    except Exception:  # noqa: BLE001
        return None


def batch_coupled(model_type: str, tol: float = 1e-5) -> str | None:
    """Why one process on two halves of a batch with two images trains differently from one process
    on the whole batch (its images interact, e.g. vision attention across images), else None: no
    sharding can then match the whole batch."""
    from harness.vlm_parity import token_loss_sum

    flags, norms = [True, False, False, True], []
    for parts in ([range(0, 4)], [range(0, 2), range(2, 4)]):
        model = build_vlm(model_type)
        inputs = VLMInputs(model)
        tokens = int((inputs.batch(flags)["labels"][:, 1:] != -100).sum())
        for rows in parts:
            (token_loss_sum(model, inputs.batch(flags, rows=rows))[0] / tokens).backward()
        norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    gap = float(abs(norms[0] - norms[1]) / norms[0])
    return f"its images interact within a batch: one process on halves vs whole, grad norms {gap:.1e} apart" \
        if gap > tol else None


def _vision_units(model, engine) -> list[str]:
    """Problems of the plan: a vision block not its own unit, a vision parameter left in the root."""
    from fullshard.plan import find_blocks
    from fullshard.towers import find_towers

    towers, plan = find_towers(model), engine.plan
    blocks = [b for b in find_blocks(model) if any(b.startswith(t + ".") for t in towers.vision)]
    problems = [f"vision block {b} is not a unit" for b in blocks if (b,) not in {u.modules for u in plan.units}]
    if not blocks:
        problems.append("no vision blocks found")
    rooted = [n for n, _ in model.named_parameters() if plan.unit_index_of_parameter(n) is None
              and any(n.startswith(t + ".") for t in towers.vision)]
    return problems + [f"vision parameters in the root unit: {rooted[:3]}"] * bool(rooted)


def sweep_variants(tested: list[str]) -> list[tuple[str, object]]:
    """(type, freeze spec) runs: "auto" (the default: vision tower frozen) and [] (all trained)
    alternate over the sorted types; BOTH_VARIANTS run both."""
    runs = []
    for i, model_type in enumerate(sorted(tested)):
        specs = ("auto", []) if model_type in BOTH_VARIANTS else (("auto",) if i % 2 == 0 else ([],))
        runs += [(model_type, spec) for spec in specs]
    return runs


def _sweep(model_types: list[str]) -> dict:
    from fullshard import FSDP2Engine
    from fullshard.towers import freeze

    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    found = [None] * world  # each rank tries its share of the types, in one process each
    torch.distributed.all_gather_object(found, {t: sweep_entry(t) for t in model_types[rank::world]})
    skipped = {t: reason for part in found for t, reason in part.items() if reason is not None}
    results = {}
    for model_type, spec in sweep_variants([t for t in model_types if t not in skipped]):
        name = f"{model_type} ({'vision frozen' if spec == 'auto' else 'all trained'})"
        try:
            engine = FSDP2Engine({"mixed_precision": "fp32", "freeze": spec})
            plan_problems = []

            def shard(model, engine=engine, plan_problems=plan_problems):
                model = engine.prepare_model(model)
                plan_problems += _vision_units(model, engine)
                return model

            r = vlm_against_reference(model_type, shard, freeze=functools.partial(freeze, spec=spec))
            r["plan"] = plan_problems
            results[name] = r
        except Exception as error:  # noqa: BLE001 - every failure is reported at the end
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return {"skipped": skipped, "results": results}


def _run_problems(name: str, r: dict) -> list[str]:
    problems = vlm_problems(name, r) + [f"{name}: {p}" for p in r.get("plan", [])]
    if "error" in r:
        return problems
    if "frozen" in name and not r["frozen"]:
        problems.append(f"{name}: nothing frozen by default")
    if r["vision"] and not any(set(r["vision"]) & set(g) for g in r["ref_grads"]) and "trained" in name:
        problems.append(f"{name}: the vision tower never got a gradient")
    if set(r["vision"]) & set(r["ref_grads"][1]):
        problems.append(f"{name}: the vision tower got a gradient in the step without images")
    return problems


def readme_vlm_lists(model_types: set[str]) -> tuple[set[str], set[str], str]:
    """The types docs/vision-language.md says are tested and left out, and its count."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "vision-language.md").read_text()
    section = text[text.index("## Which types are tested\n"):]
    section = section[:section.index("\n## ", 1)]
    tested = section[section.index("Tested (world 2"):section.index("Left out")]
    left_out = section[section.index("Left out"):]
    count = re.search(r"\d+ of the \d+ types", tested)
    return ({n for n in re.findall(r"[a-z0-9_.-]+", tested) if n in model_types},
            {n for n in re.findall(r"`([a-z0-9_.-]+)`", left_out) if n in model_types},
            count.group(0) if count else "")


def test_every_vlm_type_trains_sharded_like_one_process():
    """World 2, fp32, 3 AdamW steps with clipping against one process on the whole batch: step 0 one
    rank has an image and the other none, step 1 no rank has one (the vision tower gets no gradient,
    as in one process), step 2 accumulates a micro-batch with images and a text-only one. Each type
    with its vision tower frozen (the default; frozen parameters bit-identical after) or trained,
    alternating; Qwen2-VL and Qwen3-VL both ways. A type that fails is left out only when one process
    on two halves of a batch already trains differently from one process on the whole."""
    model_types = list(vlm_types())
    outcome = run_distributed(_sweep, 2, model_types, timeout=1500)
    skipped = dict(outcome[0]["skipped"])
    failed: dict[str, list[str]] = {}
    for rank, per_rank in enumerate(outcome):
        for name, r in per_rank["results"].items():
            failed.setdefault(name.split(" (")[0], [])
            failed[name.split(" (")[0]] += [f"rank {rank} {p}" for p in _run_problems(name, r)]
    for model_type in [t for t, ps in failed.items() if ps]:
        if (reason := batch_coupled(model_type)) is not None:
            skipped[model_type] = reason
    tested = sorted(t for t in failed if t not in skipped)
    summary = "\n".join([f"{len(tested)} of {len(model_types)} image-text-to-text types tested; {len(skipped)} left out:",
                         *(f"  {name}: {reason}" for name, reason in sorted(skipped.items()))])
    warnings.warn(summary, stacklevel=1)
    print(summary)
    problems = [p for t in tested for p in failed[t]]
    assert not problems, "\n".join(problems)
    runs = {name for name in outcome[0]["results"] if name.split(" (")[0] in tested}
    assert {"frozen" in name for name in runs} == {True, False}
    readme_tested, readme_left_out, readme_count = readme_vlm_lists(set(model_types))
    assert (readme_tested, readme_left_out) == (set(tested), set(skipped)), (
        f"docs/vision-language.md's VLM lists are out of date: tested {sorted(readme_tested ^ set(tested))}, "
        f"left out {sorted(readme_left_out ^ set(skipped))}")
    assert readme_count == f"{len(tested)} of the {len(model_types)} types"
    assert len(tested) >= MIN_TESTED, f"only {len(tested)} types could be built offline"
    assert len(tested) + len(skipped) == len(model_types)
    for required in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "llava", "idefics3",
                     "smolvlm", "mistral3", "internvl", "paligemma", "llava_next", "llava_next_video",
                     "llava_onevision", "deepseek_vl", "janus", "video_llava", "qianfan_ocr", "video_llama_3"):
        assert required in tested, f"{required} left out: {skipped.get(required)}"


# images and videos on different ranks: step 0 one rank an image, the other a video; step 1 a video
# on one rank only; step 2 accumulation: a micro-batch with a video and an image on one rank, then a
# text-only one; step 3 neither anywhere
VIDEO_SCHEDULE = [
    [[True, False, "video", False]],
    [[False, "video", False, False]],
    [["video", True, False, False], [False, False, False, False]],
    [[False, False, False, False]],
]
VIDEO_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_next_video", "llava_onevision", "video_llava",
               "video_llama_3")


def _video_checks(model_types) -> dict:
    from fullshard import FSDP2Engine

    torch.set_num_threads(1)
    out = {}
    for model_type in model_types:
        engine = FSDP2Engine({"mixed_precision": "fp32", "freeze": []})
        try:
            out[model_type] = vlm_against_reference(model_type, engine.prepare_model, schedule=VIDEO_SCHEDULE)
        except Exception as error:  # noqa: BLE001 - every failure is reported at the end
            out[model_type] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return out


def test_videos_on_some_ranks_train_like_one_process():
    """World 2, fp32, everything trained, against one process: a rank with an image and one with a
    video, a video on one rank only, a micro-batch with both then a text-only one, and a step with
    neither. Each rank runs the model's own video path on a stand-in when another has a video, after
    its real image call where it has one (Video-LLaVA's two towers are gathered in the same order on
    both ranks), and the vision tower gets a gradient only where one process gives it one."""
    out = run_distributed(_video_checks, 2, VIDEO_TYPES, timeout=900)[0]
    problems = [p for t in VIDEO_TYPES for p in vlm_problems(t, out[t])]
    assert not problems, "\n".join(problems)
    for model_type in VIDEO_TYPES:
        r = out[model_type]
        assert set(r["vision"]) & set(r["ref_grads"][1]), f"{model_type}: the video step trained no vision"
        assert not set(r["vision"]) & set(r["ref_grads"][3]), model_type


# --------------------------------------------------------------------------- plan and freezing


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava", "idefics3", "ovis2", "qwen3_vl"])
def test_towers_blocks_and_freezing_come_from_the_structure(model_type):
    from fullshard.errors import ConfigError
    from fullshard.plan import auto_plan, find_blocks
    from fullshard.towers import find_towers, freeze, freeze_targets

    model = build_vlm(model_type)
    towers = find_towers(model)
    assert towers.vision and towers.projector and towers.language, towers
    blocks = find_blocks(model)
    vision_blocks = [b for b in blocks if any(b.startswith(t + ".") for t in towers.vision)]
    assert len(vision_blocks) == 2, blocks  # the tiny configs have two vision layers
    plan = auto_plan(model)
    units = {u.modules for u in plan.units}
    assert all((b,) in units for b in vision_blocks)
    assert all(plan.unit_index_of(p) is not None for p in towers.projector)
    assert "vision: " in plan.describe(model) and "projector: " in plan.describe(model)

    params = dict(model.named_parameters())
    in_vision = {n for n in params if any(n.startswith(t + ".") for t in towers.vision)}
    in_projector = {n for n in params if any(n.startswith(t + ".") for t in towers.projector)}
    assert set(freeze_targets(model, "auto")) == in_vision - in_projector
    assert set(freeze_targets(model, ["projector"])) == in_projector
    assert freeze_targets(model, []) == []
    language = set(freeze_targets(model, ["language"]))
    assert model.get_output_embeddings().weight is not None and language and not language & in_vision
    pattern = f"{towers.vision[0]}.**"
    assert set(freeze_targets(model, [pattern])) == in_vision
    with pytest.raises(ConfigError, match="matches no module"):
        freeze_targets(model, ["model.no_such_tower.*"])
    with pytest.raises(ConfigError, match="words"):
        freeze_targets(model, [3])
    with pytest.raises(ConfigError, match="no audio tower"):
        freeze_targets(model, ["audio"])
    frozen = freeze(model, "auto")
    assert all(not params[n].requires_grad for n in frozen) and all(params[n].requires_grad for n in params
                                                                     if n not in frozen)


@pytest.mark.parametrize("model_type", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_an_audio_tower_is_a_tower_but_not_the_vision_one(model_type):
    """Omni thinkers: the tower built from `audio_config` is audio, whole (its convolutions and projection
    no projector); `vision` freezes none of it, `audio` all of it, `auto` both encoders; Qwen3-Omni's
    deepstack `merger_list`, registered before the vision blocks, is projector like its `merger`."""
    from fullshard.plan import auto_plan, find_blocks
    from fullshard.towers import find_towers, freeze_targets

    model = build_vlm(model_type)
    towers = find_towers(model)
    assert (towers.vision, towers.audio) == (["model.visual"], ["model.audio_tower"]), towers
    assert towers.projector and all(p.startswith("model.visual.") for p in towers.projector), towers.projector
    if model_type == "qwen3_omni_moe_thinker":
        assert "model.visual.merger_list" in towers.projector
    params = {n for n, _ in model.named_parameters()}
    audio = {n for n in params if n.startswith("model.audio_tower.")}
    projector = {n for n in params if any(n.startswith(p + ".") for p in towers.projector)}
    vision = {n for n in params if n.startswith("model.visual.")} - projector
    assert set(freeze_targets(model, ["vision"])) == vision
    assert set(freeze_targets(model, ["audio"])) == audio
    assert set(freeze_targets(model, "auto")) == vision | audio
    assert set(freeze_targets(model, ["projector"])) == projector

    plan = auto_plan(model)
    units = {u.modules for u in plan.units}
    audio_blocks = [b for b in find_blocks(model) if b.startswith("model.audio_tower.")]
    assert len(audio_blocks) == 2 and all((b,) in units for b in audio_blocks)
    assert all(plan.unit_index_of_parameter(n) is not None for n in audio | projector)
    described = plan.describe(model)
    assert "audio: model.audio_tower (2 blocks)" in described and "vision: model.visual (2 blocks)" in described


def test_causal_lm_is_not_a_vlm():
    from fullshard.errors import ConfigError
    from fullshard.testing import build_model
    from fullshard.towers import find_towers, freeze_targets

    model = build_model("llama")
    assert not find_towers(model)
    assert freeze_targets(model, "auto") == []
    with pytest.raises(ConfigError, match="'vision' names no part"):
        freeze_targets(model, ["vision"])


# --------------------------------------------------------------------------- the engine's settings on a VLM

LANGUAGE_LINEARS = r".*language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"  # LoRA on the language model only
BF16_TOL = 5e-2  # bf16 compute against the fp32 reference (test_compile's tolerance)
# each run: (name, engine settings beyond fp32, vlm_against_reference arguments). "aot_eager" compiles
# each block through dynamo and AOTAutograd, the capture FSDP's hooks and the checkpointing meet;
# inductor's code generation adds ~80 s on 2 CPUs and nothing fullshard owns
SETTINGS = [
    ("checkpointing", {"activation_checkpointing": True, "freeze": []}, {}),
    ("compile", {"compile": "aot_eager", "freeze": []}, {}),
    ("tp", {"tp_size": 2, "freeze": []}, {"dp_size": 1}),
    ("lora", {}, {"prepare": "lora"}),
    ("bf16", {"mixed_precision": "bf16"}, {}),
]


def _lora_on_language(model):
    from fullshard.lora import apply_lora

    return apply_lora(model, {"r": 4, "alpha": 8, "target_modules": LANGUAGE_LINEARS})


def _sharded_parts(model) -> dict:
    """What the engine did to each block (checkpointed, compiled) and which parameters tp split."""
    from torch.distributed.tensor import DTensor

    from fullshard import find_blocks
    from fullshard.towers import find_towers

    towers = find_towers(model)
    blocks = {}
    for name in find_blocks(model):
        block = model.get_submodule(name)
        tower = next((w for w in ("vision", "language") if any(name.startswith(t + ".") for t in towers.of(w))), None)
        blocks[name] = (tower, getattr(block, "_fullshard_checkpointed", False), block._compiled_call_impl is not None)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)
             and "tp" in (p.device_mesh.mesh_dim_names or ()) and p.device_mesh["tp"].size() > 1]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"blocks": blocks, "tp_split": split, "trainable": trainable}


def _settings_checks() -> dict:
    from torch._dynamo.utils import counters

    from fullshard import FSDP2Engine
    from fullshard.towers import freeze

    torch.set_num_threads(1)
    out = {}
    for name, settings, arguments in SETTINGS:
        engine = FSDP2Engine({"mixed_precision": "fp32", **settings})
        parts = {}

        def shard(model, engine=engine, parts=parts):
            model = engine.prepare_model(model)
            parts.update(_sharded_parts(model))
            return model

        arguments = dict(arguments, prepare=_lora_on_language if arguments.get("prepare") else None)
        r = vlm_against_reference("qwen2_vl", shard, freeze=functools.partial(freeze, spec=engine.config.freeze),
                                  **arguments)
        out[name] = {**r, **parts, "graphs": counters["stats"]["unique_graphs"]}
    return out


def test_vlm_checkpointing_compile_tp_lora_and_bf16_train_like_one_process():
    """Qwen2-VL at world 2 through the image / no-image schedule against one process, with each of the
    settings the issue names: activation checkpointing (both towers' blocks), compiled blocks, tp 2 on
    the language model (transformers' plan from `text_config`; the vision tower stays whole), LoRA on
    the language model's linear layers (the same adapters on both sides) and bf16 compute."""
    out = run_distributed(_settings_checks, 2, timeout=600)[0]
    problems = [p for name in ("checkpointing", "compile", "tp", "lora") for p in vlm_problems(name, out[name])]
    assert not problems, "\n".join(problems)

    blocks = out["checkpointing"]["blocks"]
    assert {tower for tower, _, _ in blocks.values()} == {"vision", "language"}, blocks
    assert all(checkpointed for _, checkpointed, _ in blocks.values()), blocks
    assert not any(checkpointed for _, checkpointed, _ in out["compile"]["blocks"].values())
    assert all(compiled for _, _, compiled in out["compile"]["blocks"].values()), out["compile"]["blocks"]
    assert out["compile"]["graphs"] > 0, "no block was compiled"

    split, vision = out["tp"]["tp_split"], out["tp"]["vision"]
    language_linears = [n for n in out["tp"]["trainable"] if re.fullmatch(LANGUAGE_LINEARS + r"\.weight", n)]
    assert language_linears and set(language_linears) <= set(split), sorted(set(language_linears) - set(split))
    assert not set(split) & set(vision), "tp split the vision tower, which has no TP plan"

    lora = out["lora"]
    adapters = [n for n in lora["trainable"] if ".lora_" in n]
    assert adapters and adapters == lora["trainable"], lora["trainable"][:4]
    assert all(re.search(r"language_model\.layers\.", n) for n in adapters), adapters[:4]
    assert all(".lora_" in n for n in lora["grads"][0]) and lora["grads"][0], "a base weight got a gradient under LoRA"
    assert len(lora["frozen"]) > len(adapters) and not lora["frozen_changed"]

    bf16 = out["bf16"]
    assert all(torch.isfinite(torch.tensor(bf16["loss"] + bf16["norm"]))), bf16["loss"]
    assert max(abs(a - b) for a, b in zip(bf16["loss"], bf16["ref_loss"])) <= BF16_TOL, (bf16["loss"], bf16["ref_loss"])
    assert max(abs(a - b) / b for a, b in zip(bf16["norm"], bf16["ref_norm"])) <= BF16_TOL, \
        (bf16["norm"], bf16["ref_norm"])
    unfrozen = {n for n in vision if ".merger." not in n} - set(bf16["frozen"])  # the merger is the projector
    assert not unfrozen, f"the vision tower was not frozen: {sorted(unfrozen)[:4]}"
    assert not bf16["frozen_changed"], f"bf16 changed frozen parameters: {bf16['frozen_changed'][:4]}"


# --------------------------------------------------------------------------- loading and saving


def _load_checks(directories: dict) -> dict:
    """Each directory loaded with fullshard's from_pretrained (no model class named) against plain
    transformers' from_pretrained: every tensor, and what each rank read."""
    import transformers
    from harness.compare import full_state
    from torch.distributed.tensor import DTensor

    from fullshard import FSDP2Engine, from_pretrained
    from fullshard.fsdp import model_class_name

    out = {}
    for label, (directory, budget) in directories.items():
        engine = FSDP2Engine({"mixed_precision": "fp32", "freeze": []})
        model = from_pretrained(directory, engine=engine)
        reference = transformers.AutoModelForImageTextToText.from_pretrained(directory)
        params, ref = full_state(model), dict(reference.named_parameters())
        problems = [f"class {model_class_name(model)} vs {type(reference).__name__}"] \
            * (model_class_name(model) != type(reference).__name__)
        problems += [f"names differ: {sorted(set(params) ^ set(ref))[:4]}"] * (set(params) != set(ref))
        problems += [f"{k} differs" for k in sorted(set(params) & set(ref)) if not torch.equal(params[k], ref[k].detach())]
        buffers, ref_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
        problems += [f"buffer {k} differs" for k in ref_buffers if k in buffers and not torch.equal(buffers[k], ref_buffers[k])]
        slack = 0
        for t in {id(t): t for t in model.state_dict().values()}.values():
            dims = [pl.dim for pl in t.placements if pl.is_shard()] if isinstance(t, DTensor) else []
            slack += t.numel() // t.shape[dims[0]] * t.element_size() if dims else t.numel() * t.element_size()
        read = model.fullshard_load_report.bytes_read
        allowance = budget // torch.distributed.get_world_size() + slack
        problems += [f"read {read} bytes, allowance {allowance}"] * (read > allowance)
        out[label] = problems
    return out


def _write_model_layout(model, directory: Path) -> None:
    """The model's own key names (transformers 5's module layout), not the Hub's."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    for f in directory.glob("*.safetensors"):
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    state, seen = {}, set()
    for key, value in model.state_dict().items():  # a tied head is stored once, under its first name
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            state[key] = value.contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    del config["architectures"]  # the class then comes from the config's type alone
    (directory / "config.json").write_text(json.dumps(config))


def test_vlm_checkpoints_load_into_shards_like_transformers(tmp_path):
    """save_pretrained's directory (the Hub layout: transformers renames on load) and one in the
    model's own layout load at world 2, each rank reading its slices, equal to plain transformers."""
    directories = {}
    for model_type in ("qwen2_vl", "llava", "gemma3", "idefics3", "qwen3_vl_moe", "qianfan_ocr"):
        model = build_vlm(model_type)
        hub = tmp_path / model_type
        model.save_pretrained(hub)
        size = (hub / "model.safetensors").stat().st_size
        directories[f"{model_type} (Hub layout)"] = (str(hub), size)
        own = tmp_path / f"{model_type}-own"
        _write_model_layout(model, own)
        directories[f"{model_type} (model layout)"] = (str(own), (own / "model.safetensors").stat().st_size)
    with open(tmp_path / "qwen2_vl" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2VLForConditionalGeneration"]
    results = run_distributed(_load_checks, 2, directories, timeout=600)
    problems = [f"rank {rank} {label}: {p}" for rank, r in enumerate(results) for label, ps in r.items() for p in ps]
    assert not problems, "\n".join(problems)


EXPORTED = ("qwen2_vl", "llava", "gemma3", "qwen3_vl_moe", "qianfan_ocr")


# LoRA on the vision tower's attention of the one type whose Hub tensor fuses several model tensors
# (each of q, k, v merged into its part of Qianfan-OCR's `qkv`), with random B so every merge counts
VISION_LORA = {"qianfan_ocr": dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                   target_modules=r".*vision_tower.*attention\.[qkv]_proj")}


def _weights_out(model, directory: str, **lora) -> dict:
    """Every way the sharded model's weights go out in the Hub layout: `export_hf` into
    `directory`, and on the first rank the tensors `hf_weights` streams (small buckets, so several)
    and `WeightSync`'s stream to the first rank (`buckets_to_first`) gives."""
    from fullshard import export_hf, hf_weights
    from fullshard.weight_sync import buckets_to_first

    export_hf(model, directory, **lora)
    streamed = dict(hf_weights(model, bucket_bytes=64 * 1024, **lora))
    buffer = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)  # noqa: E731
    buckets = buckets_to_first(model, buffer, bucket_bytes=64 * 1024, **lora)
    sent = {name: tensor for bucket in buckets for name, tensor in bucket.pairs}
    first = torch.distributed.get_rank() == 0
    return {"streamed": streamed if first else {}, "sent": sent}


def _logits(model, model_type: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        batch = _inputs(model_type).batch([True, False], seed=7)
        batch.pop("labels")
        return model(**batch, use_cache=False).logits


def _train_and_save(directories: dict, checkpoint_root: str) -> dict:
    """Per model: load save_pretrained's directory sharded, train two steps (one rank with an image,
    then none), save a DCP checkpoint, train a third step; its weights out in the Hub layout
    (`_weights_out`) and whole; logits of the sharded model on image + text rows. The LoRA types
    also with adapters on the vision tower: merged out, and saved for the offline export."""
    from harness.compare import full_state

    from fullshard import FSDP2Engine, from_pretrained
    from fullshard.checkpoint import CheckpointManager

    out = {}
    for model_type, directory in directories.items():
        model = from_pretrained(directory, engine=FSDP2Engine({"mixed_precision": "fp32"})).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
        manager = CheckpointManager(Path(checkpoint_root) / model_type)
        out[model_type] = {"loss": _steps(model, optimizer, model_type, range(3), manager)}
        out[model_type].update(_weights_out(model, directory + "-export"))
        out[model_type]["state"] = full_state(model)
        out[model_type]["logits"] = _logits(model, model_type)
        if model_type in VISION_LORA:
            torch.manual_seed(0)
            lora = from_pretrained(directory, engine=FSDP2Engine({"mixed_precision": "fp32"}),
                                   lora=VISION_LORA[model_type])
            CheckpointManager(Path(checkpoint_root) / f"{model_type}-lora").save(0, lora)
            out[model_type]["lora"] = _weights_out(lora, directory + "-lora", lora="merge")
            out[model_type]["lora"]["logits"] = _logits(lora, model_type)
    return out


def _inputs(model_type: str) -> VLMInputs:
    return VLMInputs(build_vlm(model_type))


def _steps(model, optimizer, model_type: str, steps, manager=None, save_after: int = 1) -> list[float]:
    """SCHEDULE's first micro-batch of each step, this rank's rows; the loss summed over ranks."""
    from harness.vlm_parity import SCHEDULE, token_loss_sum

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    inputs, losses = _inputs(model_type), []
    for step in steps:
        flags = SCHEDULE[step % len(SCHEDULE)][0]
        tokens = int((inputs.batch(flags, seed=step)["labels"][:, 1:] != -100).sum())
        per_rank = len(flags) // world
        loss, _ = token_loss_sum(model, inputs.batch(flags, rows=range(rank * per_rank, (rank + 1) * per_rank), seed=step))
        (loss * world / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach() / tokens
        torch.distributed.all_reduce(total)
        losses.append(float(total))
        if manager is not None and step == save_after:
            manager.save(step, model, optimizer)
    return losses


def _resume(directories: dict, checkpoint_root: str) -> dict:
    """Per model at world 1: the checkpoint loaded, its weights out in the Hub layout and whole,
    then the remaining steps trained."""
    from harness.compare import full_state

    from fullshard import FSDP2Engine, from_pretrained
    from fullshard.checkpoint import CheckpointManager

    out = {}
    for model_type, directory in directories.items():
        model = from_pretrained(directory, engine=FSDP2Engine({"mixed_precision": "fp32"})).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
        state = CheckpointManager(Path(checkpoint_root) / model_type).load(model, optimizer)
        out[model_type] = {"step": state["step"], **_weights_out(model, directory + "-resumed"),
                           "state": full_state(model)}
        out[model_type]["loss"] = _steps(model, optimizer, model_type, range(state["step"] + 1, 3))
    return out


def _hub_files(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    return {key: tensor for f in files for key, tensor in load_file(f).items()}


def _differences(label: str, got: dict, expected: dict) -> list[str]:
    """Where two sets of Hub tensors differ: keys, dtypes, bits."""
    if set(got) != set(expected):
        return [f"{label}: keys differ: {sorted(set(got) ^ set(expected))[:4]}"]
    wrong = [k for k in expected
             if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    return [f"{label}: {len(wrong)} tensors differ, first {wrong[:2]}"] if wrong else []


def _hub_layout_problems(model, directory: str, trained: dict, resumed: dict, tmp_path: Path) -> list:
    """Every way fullshard puts weights out in the Hub layout against transformers'
    `save_pretrained` of the same weights (key for key, bitwise): live at world 2 and 1, streamed,
    sent, and exported offline from the checkpoint the world-1 run resumed from. `model`: a plain
    one of the type, given each run's weights in turn."""
    from fullshard import export_hf, hf_weights

    model_type, problems = model.config.model_type, []
    runs = (("world 2", trained, directory + "-export"),
            ("world 1", resumed, directory + "-resumed"))
    for label, run, export in runs:
        model.load_state_dict(run["state"], strict=False)  # parameters; a miss would show below
        reference = tmp_path / f"{model_type}-reference-{label[-1]}"
        model.save_pretrained(reference)
        expected = _hub_files(reference)
        problems += _differences(f"{model_type} {label} export_hf", _hub_files(export), expected)
        problems += _differences(f"{model_type} {label} hf_weights", run["streamed"], expected)
        problems += _differences(f"{model_type} {label} WeightSync's stream", run["sent"], expected)
    checkpoint = tmp_path / "ckpt" / model_type / "step_1"
    offline = export_hf(checkpoint, tmp_path / f"{model_type}-offline")
    world_1 = _hub_files(directory + "-resumed")
    problems += _differences(f"{model_type} offline export", _hub_files(offline), world_1)
    problems += _differences(f"{model_type} checkpoint's hf_weights", dict(hf_weights(checkpoint)),
                             world_1)
    return problems + _old_recipe_problems(model_type, checkpoint, world_1)


def _old_recipe_problems(model_type: str, checkpoint: Path, hub: dict) -> list[str]:
    """A recipe recorded before Hub tensors could be fused (no `fused`) still reads, and its offline
    export writes the parts under the model's own names, as that fullshard did."""
    from fullshard.checkpoint.read import CheckpointReader
    from fullshard.hf.export import ExportRecipe
    from fullshard.hf.offline import _hub_tensors

    recorded = json.loads((checkpoint / "model_meta.json").read_text())["export"]
    fused = recorded.pop("fused", {})
    if bool(fused) != (model_type == "qianfan_ocr"):
        return [f"{model_type}: the recipe fuses {sorted(fused)[:2]}"]
    old_recipe = ExportRecipe.from_json(recorded)
    old = dict(_hub_tensors(CheckpointReader(checkpoint), old_recipe, torch.float32))
    expected = {k: v for k, v in hub.items() if k not in fused}
    for name, spec in fused.items():
        expected.update(zip(spec["parts"], hub[name].chunk(len(spec["parts"]), spec["dim"])))
    return _differences(f"{model_type} offline export of a recipe without `fused`", old, expected)


def _merged_problems(model_type: str, directory: str, out: dict, tmp_path: Path) -> list:
    """A LoRA model on the vision tower, merged: the export has save_pretrained's keys and, loaded
    by plain transformers, the LoRA model's logits; stream, sent and offline export equal it
    bitwise."""
    import transformers

    from fullshard import export_hf

    exported = _hub_files(directory + "-lora")
    problems = []
    if set(exported) != set(_hub_files(directory)):
        problems.append(f"{model_type} LoRA merged: keys differ from save_pretrained's: "
                        f"{sorted(set(exported) ^ set(_hub_files(directory)))[:4]}")
    problems += _differences(f"{model_type} LoRA merged hf_weights", out["streamed"], exported)
    problems += _differences(f"{model_type} LoRA merged WeightSync's stream", out["sent"], exported)
    offline = _hub_files(export_hf(tmp_path / "ckpt" / f"{model_type}-lora",
                                   tmp_path / f"{model_type}-lora-offline"))
    problems += _differences(f"{model_type} LoRA merged offline export", offline, exported)
    merged = transformers.AutoModelForImageTextToText.from_pretrained(directory + "-lora").eval()
    batch = _inputs(model_type).batch([True, False], seed=7)
    batch.pop("labels")
    with torch.no_grad():
        gap = (merged(**batch, use_cache=False).logits - out["logits"]).abs().max().item()
        plain = transformers.AutoModelForImageTextToText.from_pretrained(directory).eval()
        moved = (plain(**batch, use_cache=False).logits - out["logits"]).abs().max().item()
    if not gap <= 1e-5 or not moved > 1e-4:
        problems.append(f"{model_type} LoRA merged: logits differ by {gap:.2e} from the LoRA "
                        f"model's, which differ by {moved:.2e} from the base model's")
    return problems


def test_vlm_export_and_checkpoints(tmp_path):
    """Sharded at world 2 and 1, the export, the weight stream and WeightSync's stream are
    save_pretrained's files of the same weights, key for key and bitwise (Qianfan-OCR's vision `qkv`
    fused from q_proj, k_proj, v_proj included), so is the offline export of the checkpoint, and the
    export, loaded by plain transformers, gives the sharded model's logits on image + text rows; a
    LoRA model merged likewise (`VISION_LORA`); a DCP checkpoint saved at world 2 (vision tower
    frozen) resumes at world 1 and trains what the uninterrupted run trained."""
    import transformers

    directories, models = {}, {}
    for model_type in EXPORTED:
        directory = tmp_path / model_type
        models[model_type] = build_vlm(model_type)
        models[model_type].save_pretrained(directory)
        directories[model_type] = str(directory)
    trained = run_distributed(_train_and_save, 2, directories, str(tmp_path / "ckpt"), timeout=900)[0]
    resumed = run_distributed(_resume, 1, directories, str(tmp_path / "ckpt"), timeout=900)[0]
    problems = []
    for model_type, directory in directories.items():
        problems += _hub_layout_problems(models[model_type], directory, trained[model_type],
                                         resumed[model_type], tmp_path)
        if model_type in VISION_LORA:
            lora = trained[model_type]["lora"]
            problems += _merged_problems(model_type, directory, lora, tmp_path)
        exported = transformers.AutoModelForImageTextToText.from_pretrained(directory + "-export").eval()
        batch = _inputs(model_type).batch([True, False], seed=7)
        batch.pop("labels")
        with torch.no_grad():
            logits = exported(**batch, use_cache=False).logits
        gap = (logits - trained[model_type]["logits"]).abs().max().item()
        if not gap <= 1e-5:
            problems.append(f"{model_type}: exported logits differ by {gap:.2e}")
        after = resumed[model_type]
        if after["step"] != 1 or max(abs(a - b) for a, b in zip(after["loss"], trained[model_type]["loss"][2:])) > 1e-5:
            problems.append(f"{model_type}: resumed at world 1 from step {after['step']}: {after['loss']} "
                            f"vs uninterrupted {trained[model_type]['loss'][2:]}")
    assert not problems, "\n".join(problems)
