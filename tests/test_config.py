"""The training config: values as people write them, ranges, nulls, paths, section names, and the
help generated from the same definitions. Pure unit tests: no process group, no model."""

import dataclasses

import pytest

from fullshard.cli import parse_train_args
from fullshard.errors import ConfigError
from fullshard.train.config import SECTIONS, describe_keys, key_rows, load_config


def config_from_yaml(tmp_path, text, *overrides):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_numbers_as_people_write_them(tmp_path):
    config = config_from_yaml(tmp_path, "optim:\n  lr: 1e-4\n  eps: 1e-8\n  weight_decay: 1E-2\n"
                                        "train:\n  steps: 10.0\n", "--data.seq_len=1e3")
    assert (config.optim.lr, config.optim.eps, config.optim.weight_decay) == (1e-4, 1e-8, 1e-2)
    assert type(config.optim.lr) is float
    assert (config.train.steps, config.data.seq_len) == (10, 1000)
    assert type(config.train.steps) is int and type(config.data.seq_len) is int
    assert load_config(None, ["--optim.lr=3e-5", "--optim.betas=[0.8, 9e-1]"]).optim.lr == 3e-5
    assert load_config(None, ["--optim.betas", "[8e-1, 0.9]"]).optim.betas == [0.8, 0.9]  # space form
    with pytest.raises(ConfigError, match=r"^train.steps=10.5: input should be a valid integer, got a number with a "
                                          r"fractional part$"):
        load_config(None, ["--train.steps=10.5"])
    with pytest.raises(ConfigError, match=r"^train.steps='three': input should be a valid integer"):
        load_config(None, ["--train.steps=three"])


def test_null_for_optional_keys(tmp_path):
    config = config_from_yaml(tmp_path, "checkpoint:\n  resume: null\n  dir: null\ndata:\n  path: null\n")
    assert config.checkpoint.resume == "none" and config.checkpoint.dir is None and config.data.path is None
    assert load_config(None, ["--checkpoint.resume=none"]).checkpoint.resume == "none"
    assert load_config(None, ["--lora.r=null"]).lora.r is None
    with pytest.raises(ConfigError, match="train.steps=None"):
        load_config(None, ["--train.steps=null"])  # not optional


@pytest.mark.parametrize("override, message", [
    ("--optim.min_lr_ratio=5", "optim.min_lr_ratio=5: input should be less than or equal to 1"),
    ("--optim.min_lr_ratio=-0.1", "optim.min_lr_ratio=-0.1: input should be greater than or equal to 0"),
    ("--data.eval_fraction=1.5", "data.eval_fraction=1.5 must be in [0, 1)"),
    ("--optim.weight_decay=-1", "optim.weight_decay=-1: input should be greater than or equal to 0"),
    ("--train.eval_every=-5", "train.eval_every=-5: input should be greater than or equal to 0"),
    ("--train.max_norm=-1", "train.max_norm=-1: input should be greater than or equal to 0"),
    ("--train.micro_batch_size=0", "train.micro_batch_size=0: input should be greater than or equal to 1"),
    ("--optim.lr=0", "optim.lr=0: input should be greater than 0"),
    ("--optim.betas=[2,3]", "optim.betas[0]=2: input should be less than 1"),
    ("--optim.betas=[0.9]", "optim.betas=[0.9]: list should have at least 2 items"),
    ("--checkpoint.on_stop_timeout_s=-1", "checkpoint.on_stop_timeout_s=-1: input should be greater than or equal"),
    ("--fsdp.dp_replicate=0", "fsdp.dp_replicate=0 must be >= 1"),
    ("--fsdp.dp_shard=0", "fsdp.dp_shard=0 must be >= 1, or -1"),
    ("--fsdp.mixed_precision=fp8", "fsdp.mixed_precision must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"),
    ("--model.dtype=fp64", "model.dtype='fp64' must be one of"),
    ("--model.trust_remote_code=maybe", "model.trust_remote_code='maybe': input should be a valid boolean"),
    ("--lora.target_modules=[]", "lora.target_modules=[]: list should have at least 1 item"),
    ("--train.stepz=3", "unknown key train.stepz; the keys of section 'train' are: steps,"),
    ("--trian.steps=3", "unknown section 'trian'; sections are: model, data,"),
])
def test_ranges_and_names_are_checked(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_mesh_sizes_against_the_world_name_the_keys():
    config = load_config(None, ["--fsdp.dp_replicate=2", "--train.global_batch_size=16", "--train.micro_batch_size=2"])
    assert config.accumulation_steps(4) == 2
    with pytest.raises(ConfigError, match=r"fsdp.dp_replicate=2 x fsdp.dp_shard=-1 does not match the 3 processes"):
        config.accumulation_steps(3)
    config = load_config(None, ["--fsdp.dp_shard=3"])
    with pytest.raises(ConfigError, match=r"fsdp.dp_replicate=1 x fsdp.dp_shard=3 does not match the 2 processes"):
        config.accumulation_steps(2)


def test_parallel_section_and_the_old_fsdp_keys(tmp_path, monkeypatch):
    """The mesh is the parallel section; `fsdp.<key>` (YAML or override) is read as `parallel.<key>`,
    said in one line once, named as written in messages; the same key twice with two values is refused."""
    import fullshard.log
    from fullshard.launch import LAUNCHED_ENV
    from fullshard.train.config import MESH_KEYS, ParallelSection, say_renamed_keys

    said = []
    monkeypatch.setattr(fullshard.log, "warn_rank0", said.append)
    new = load_config(None, ["--parallel.tp_size=2", "--parallel.pp_size=2", "--parallel.pp_schedule=GPipe"])
    assert (new.parallel.tp_size, new.parallel.pp_size, new.parallel.pp_schedule) == (2, 2, "GPipe")
    engine = new.engine_config()
    assert (engine.tp_size, engine.pp_size, engine.pp_schedule) == (2, 2, "GPipe") and said == []
    assert set(MESH_KEYS) == {f.name for f in dataclasses.fields(ParallelSection)} >= {"dp_shard", "ep_size"}
    old = config_from_yaml(tmp_path, "fsdp:\n  tp_size: 2\n  cp_size: 2\n", "--fsdp.dp_replicate=2")
    assert (old.parallel.tp_size, old.parallel.cp_size, old.parallel.dp_replicate) == (2, 2, 2)
    assert old.engine_config().tp_size == 2 and old.fsdp.tp_size == 2  # the fsdp section holds the mesh too
    assert said == ["fsdp.dp_replicate, fsdp.tp_size, fsdp.cp_size read as parallel.dp_replicate, "
                    "parallel.tp_size, parallel.cp_size: the mesh keys moved to the parallel section"]
    say_renamed_keys(old)  # the launching process said it; the ranks it starts do not
    monkeypatch.setenv(LAUNCHED_ENV, "1")
    say_renamed_keys(old)
    assert len(said) == 2
    with pytest.raises(ConfigError, match=r"fsdp.dp_replicate=2 x fsdp.dp_shard=-1 x fsdp.cp_size=2 x fsdp.tp_size"):
        old.parallel_dims(4)
    with pytest.raises(ConfigError, match=r"^parallel.dp_replicate=3 x parallel.dp_shard=-1 does not match"):
        load_config(None, ["--parallel.dp_replicate=3"]).parallel_dims(2)
    with pytest.raises(ConfigError, match=r"^parallel.tp_size must be an int >= 1, got 0$"):
        load_config(None, ["--parallel.tp_size=0"])
    same = load_config(None, ["--fsdp.tp_size=2", "--parallel.tp_size=2"])  # both, agreeing: the new place
    assert same.parallel.tp_size == 2 and same.renamed == ()
    with pytest.raises(ConfigError, match=r"^fsdp.tp_size=2 and parallel.tp_size=4 disagree: fsdp.tp_size is the "
                                          r"old name of parallel.tp_size, keep one$"):
        config_from_yaml(tmp_path, "fsdp:\n  tp_size: 2\n", "--parallel.tp_size=4")
    rows = {flag: about for flag, _, _, about in key_rows("parallel") + key_rows("fsdp")}
    assert rows["--parallel.tp_size"].startswith("tensor-parallel ranks per layer")
    assert rows["--fsdp.tp_size"] == "read as --parallel.tp_size"
    assert "\nparallel:  The device mesh" in describe_keys()


def test_paths_expand_home_and_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    config = load_config(None, ["--checkpoint.dir=~/ck", "--train.output_dir=$RUNS/a", "--data.path=${RUNS}/d.txt",
                                "--model.name_or_path=~/model", "--checkpoint.resume=~/ck/step_3"])
    assert config.checkpoint.dir == str(tmp_path / "ck")
    assert config.output_dir == tmp_path / "runs" / "a" and config.data.path == str(tmp_path / "runs" / "d.txt")
    assert config.model.name_or_path == str(tmp_path / "model")
    assert config.checkpoint.resume == str(tmp_path / "ck" / "step_3")
    assert load_config(None, ["--model.name_or_path=Org/name"]).model.name_or_path == "Org/name"


def test_sections_must_be_mappings_and_have_one_name(tmp_path):
    with pytest.raises(ConfigError, match=r"^section 'train' must be a mapping of keys to values, got 5$"):
        config_from_yaml(tmp_path, "train: 5\n", "--train.steps=1")
    with pytest.raises(ConfigError, match="has both sections 'engine' and 'fsdp'"):
        config_from_yaml(tmp_path, "engine:\n  mixed_precision: bf16\nfsdp:\n  dp_replicate: 1\n")
    assert config_from_yaml(tmp_path, "engine:\n  mixed_precision: bf16\n").fsdp.mixed_precision == "bf16"
    assert load_config(None, ["--engine.mixed_precision=bf16"]).fsdp.mixed_precision == "bf16"
    assert config_from_yaml(tmp_path, "train:\n").train.steps == 240  # an empty section keeps the defaults
    with pytest.raises(ConfigError, match="must hold a mapping of sections, got list"):
        config_from_yaml(tmp_path, "- 1\n")


def test_config_path_anywhere_on_the_line():
    args = parse_train_args(["--train.steps=5", "run.yaml", "--optim.lr", "1e-4", "--nproc", "2", "--debug"])
    assert (args.config_path, args.overrides, args.nproc, args.debug) == (
        "run.yaml", ["--train.steps=5", "--optim.lr=1e-4"], 2, True)
    assert parse_train_args(["run.yaml", "--print-config"]).print_config
    with pytest.raises(ConfigError, match="two config files given: 'a.yaml' and 'b.yaml'"):
        parse_train_args(["a.yaml", "b.yaml"])
    with pytest.raises(ConfigError, match="unknown option '--frobnicate'"):
        parse_train_args(["--frobnicate"])


def test_help_lists_every_key_with_type_default_and_description():
    text = describe_keys()
    rows = {flag: (type_, default, about) for name in SECTIONS for flag, type_, default, about in key_rows(name)}
    for name, cls in SECTIONS.items():
        assert f"\n{name}:" in text
        for f in dataclasses.fields(cls):
            flag = f"--{name}.{f.name}"
            type_, default, about = rows[flag]
            assert f"  {flag}  {type_} = {default}" in text
            # every key but the data section's (its fields are another module's) says what it does
            assert about or name == "data", flag
    assert rows["--optim.min_lr_ratio"] == ("float in [0, 1]", "0.1", "final learning rate as a fraction of lr")
    assert rows["--train.steps"][:2] == ("int >= 1", "240")
    assert rows["--checkpoint.resume"][:2] == ("str | null", "auto")
    assert rows["--model.trust_remote_code"][:2] == ("bool", "false")
    assert rows["--optim.betas"][:2] == ("list[float in [0, 1)]", "[0.9, 0.95]")
    # keys of a section defined elsewhere get their line from that class's docstring
    assert rows["--fsdp.mixed_precision"][2] == ("compute dtype of the all-gathered weights (bf16 / fp16 / fp32); the "
                                                 "sharded master weights keep their own dtype and gradients are reduced "
                                                 "in `reduce_dtype`")


def test_stop_request_first_signal_asks_second_acts(tmp_path):
    """A first SIGINT only sets the flag polled once per step; a second one has its usual effect
    (KeyboardInterrupt), and the stop file asks the same way the first signal does."""
    import signal
    import time

    from fullshard.train.stop import StopRequest

    # Python's own SIGINT handler, whatever started pytest (a background job starts with SIGINT ignored)
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(stop_file=tmp_path / "stop")
    assert not stop.requested()
    signal.raise_signal(signal.SIGINT)
    assert stop.local() and stop.requested() and stop.signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored by the second signal
    from fullshard.distributed import STOP_ASKED

    assert not STOP_ASKED.is_set()  # and the process-wide flag cleared: a later run here starts unstopped

    by_file = StopRequest(stop_file=tmp_path / "stop")
    assert not by_file.requested()
    (tmp_path / "stop").write_text("2")
    assert by_file.requested()
    by_file.finish(7, 10, tmp_path / "step_7")
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, started_with)


def test_rank_failure_is_logged_and_reported_in_one_line(tmp_path, monkeypatch, capsys):
    from fullshard.errors import PlanError
    from fullshard.launch import _failure_message, run_rank

    def bad_plan():
        raise PlanError("plan entry 'x': pattern 'x' matches no module")

    def bug():
        raise KeyError("missing")

    monkeypatch.delenv("FULLSHARD_LAUNCHED", raising=False)
    monkeypatch.delenv("FULLSHARD_DEBUG", raising=False)
    monkeypatch.setenv("RANK", "1")
    assert run_rank(bad_plan, tmp_path) == 1
    err = capsys.readouterr().err  # plain torchrun: the rank says it itself, in one line
    assert err == f"fullshard: error: rank 1: plan entry 'x': pattern 'x' matches no module (traceback: {tmp_path}/rank1.log)\n"
    assert "Traceback" in (tmp_path / "rank1.log").read_text()
    monkeypatch.setenv("FULLSHARD_LAUNCHED", "1")
    monkeypatch.setenv("RANK", "0")
    assert run_rank(bug, tmp_path) == 1 and capsys.readouterr().err == ""  # the launcher reports
    # the first failure by time, rank 1's, not rank 0's later (knock-on) one
    assert _failure_message(tmp_path, 1, debug=False) == (
        f"rank 1: plan entry 'x': pattern 'x' matches no module (every rank's traceback: {tmp_path}/rank*.log)")
    _failure_message(tmp_path, 1, debug=True)
    shown = capsys.readouterr().err
    assert "raise KeyError" in shown and "raise PlanError" in shown


def test_tp_plan_and_cp_split_are_checked_before_launch():
    from fullshard.errors import FullshardError
    from fullshard.train.config import load_config
    from fullshard.train.preflight import check_before_launch

    base = ["--model.name_or_path=micro-llama", "--train.global_batch_size=4", "--train.micro_batch_size=2"]
    bad_plan = load_config(None, base + ["--fsdp.tp_size=2", "--fsdp.tp_plan={'model.layers.*.nope': 'colwise'}"])
    with pytest.raises(FullshardError, match=r"fsdp\.tp_plan.*nope"):
        check_before_launch(bad_plan, 4)
    heads = load_config(None, base + ["--fsdp.cp_size=8"])  # micro-llama has 4 query heads
    with pytest.raises(FullshardError, match="head"):
        check_before_launch(heads, 16)
    check_before_launch(load_config(None, base + ["--fsdp.tp_size=2"]), 4)  # the model's own plan fits


def test_help_rows_never_cut_a_sentence():
    """Every `fullshard train --help` row and section line is its whole description or that description's
    first sentences (before: "(0: FSDP's default order", "before every rank", "(and, from a")."""
    from fullshard.train.config import SECTIONS, _first_line, docstring_entries, key_rows

    def whole_or_sentences(shown: str, whole: str) -> bool:
        whole = " ".join(whole.split())
        return bool(shown) and (shown == whole.rstrip(".") or whole.startswith(shown + ". "))

    for name, cls in SECTIONS.items():
        paragraph = cls.__doc__.strip().split("\n\n")[0]
        assert whole_or_sentences(_first_line(cls.__doc__), paragraph), (name, _first_line(cls.__doc__))
        entries = docstring_entries(cls)
        for flag, _, _, about in key_rows(name):
            key = flag.split(".", 1)[1]
            assert whole_or_sentences(about, entries.get(key, about)), (flag, about, entries.get(key))
            assert about.count("`") % 2 == 0, (flag, about)
