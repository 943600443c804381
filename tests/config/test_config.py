from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Literal

import pytest

from dptrain import config
from dptrain.config import OptimConfig, RunConfig
from dptrain.errors import ConfigError
from dptrain.strategies.registry import check_world, data_world_size


def test_defaults_are_the_readme_main_job():
    cfg = config.load()
    assert (cfg.data.name, cfg.model.name, cfg.strategy.name) == ("fashion-mnist", "mnist-cnn", "ddp")
    assert config.experiment_name(cfg) == "fashion-mnist_mnist-cnn_ddp"  # train's run folder: runs/<this>


def test_the_default_run_name_says_which_experiment_and_changes_with_every_option_a_resume_keeps():
    """One runs/run for every experiment: a small synthetic run's snapshot refused even the dry run of the next
    experiment. The name now changes with what a resume must keep, and with nothing else."""
    def name(*pairs):
        return config.experiment_name(config.load(None, list(pairs)))

    base = name()
    assert name(("data.name", "synthetic")) == "synthetic_mnist-cnn_ddp"
    assert name(("strategy.name", "fsdp"), ("model.name", "cifar-cnn")) == "fashion-mnist_cifar-cnn_fsdp"
    assert name(("model.name", "tests.user_code:TinyNet")) == "fashion-mnist_tests.user_code-TinyNet_ddp"
    for pair in (("train.epochs", "9"), ("train.max_steps", "7"), ("data.root", "Data"), ("launch.nproc_per_node", "4"),
                 ("checkpoint.every_steps", "10"), ("optim.lr", str(OptimConfig().lr)), ("train.log_every", "3")):
        assert name(pair) == base, pair  # the same run: a resume may change these
    changed = {pair: name(pair) for pair in (("optim.lr", "0.01"), ("train.seed", "3"), ("train.global_batch_size", "64"),
                                             ("strategy.ddp.comm_hook", "fp16"), ("train.batch_size_per_rank", "64"))}
    for pair, other in changed.items():
        assert other.startswith(base + "_") and len(other) == len(base) + 9, (pair, other)  # _ and 8 hex digits
    assert len(set(changed.values())) == len(changed)
    assert name(("optim.lr", "0.01"), ("train.epochs", "5")) == changed["optim.lr", "0.01"]
    long = name(("data.name", "tests.user_code:" + "D" * 80), ("model.name", "tests.user_code:" + "M" * 80),
                ("optim.lr", "0.5"))
    assert len(long) == 100 and config.OutputConfig(name=long).name == long  # a valid run name, cut to fit


def test_toml_then_overrides_take_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nlr = 0.1\nname = "sgd"\n[train]\nepochs = 3\nbf16 = true\n')
    cfg = config.load(path, [("optim.lr", "3e-4"), ("train.max_steps", "30"), ("data.synthetic_shape", "[3, 8, 8]")])
    assert cfg.optim.lr == 3e-4 and cfg.optim.name == "sgd"
    assert cfg.train.epochs == 3 and cfg.train.bf16 is True and cfg.train.max_steps == 30
    assert cfg.data.synthetic_shape == (3, 8, 8)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = config.load(None, [("optim.lr", "0.05"), ("train.grad_clip", "1.5"), ("data.root", 'a "quoted" folder')])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(cfg))
    assert config.load(path) == cfg


def test_none_is_accepted_where_none_means_something():
    cfg = config.load(None, [("train.max_steps", "none")])
    assert cfg.train.max_steps is None


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ([("optim.lrr", "1")], "unknown option optim.lrr; valid options in [optim] are: name, lr,"),
        ([("optimizer.lr", "1")], "unknown option --optimizer.lr; valid sections are: data, model, optim"),
        ([("lr", "1")], "not of the form --section.option"),
        ([("optim.lr", "fast")], "optim.lr expects a number, got 'fast'"),
        ([("train.epochs", "2.5")], "train.epochs expects an integer"),
        ([("train.bf16", "maybe")], "train.bf16 expects true or false"),
        ([("optim.name", "lamb")], "optim.name = 'lamb' is not one of sgd, adam, adamw"),
        ([("data.name", "imagenet")], "data.name = 'imagenet' is not one of"),
        ([("train.global_batch_size", "0")], "train.global_batch_size = 0 must be greater than 0"),
        ([("data.synthetic_shape", "[1, 28]")], "data.synthetic_shape = [1, 28] must be three positive sizes"),
    ],
)
def test_bad_options_are_one_sentence_naming_themselves(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message and message.endswith(".")


def test_bad_toml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[optim\nlr = 1\n")
    with pytest.raises(ConfigError, match="broken.toml is not valid TOML"):
        config.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "absent.toml")
    path.write_text("[optim]\nmomentum = 0.5\nnesterov = 1\n")
    with pytest.raises(ConfigError, match="unknown option optim.nesterov"):
        config.load(path)


def test_check_world_refuses_impossible_splits():
    cfg = config.load(None, [("train.global_batch_size", "100")])
    check_world(cfg, 4, 1000)
    with pytest.raises(ConfigError, match="global_batch_size 100 is not divisible by the world size 3; choose a multiple of 3, for example 99"):
        check_world(cfg, 3, 1000)
    with pytest.raises(ConfigError, match="world size 4 is larger than the training split \\(3 samples\\)"):
        check_world(cfg, 4, 3)
    single = config.load(None, [("strategy.name", "single")])
    with pytest.raises(ConfigError, match="strategy single cannot run on 2 processes"):
        check_world(single, 2, 1000)


def test_run_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(Exception):
        cfg.train.epochs = 5  # type: ignore[misc]  # frozen on purpose


def test_strategy_options_are_checked_together():
    with pytest.raises(ConfigError, match="strategy.ddp.comm_hook ring applies to ddp and zero1 only, not fsdp"):
        config.load(None, [("strategy.name", "fsdp"), ("strategy.ddp.comm_hook", "ring")])
    with pytest.raises(ConfigError, match="strategy.fsdp.param_dtype = 'fp8' is not one of auto, float32, bfloat16, float16"):
        config.load(None, [("strategy.fsdp.param_dtype", "fp8")])
    dedicated = config.load(None, [("strategy.name", "ps"), ("strategy.ps.dedicated_server", "true"), ("train.global_batch_size", "128")])
    assert data_world_size(dedicated.strategy, 4) == 3
    with pytest.raises(ConfigError, match="not divisible by the number of training ranks 3"):
        check_world(dedicated, 4, 1000)  # 3 workers take the data; rank 0 only serves
    with pytest.raises(ConfigError, match="dedicated_server needs at least 2 processes"):
        check_world(dedicated, 1, 1000)
    dp = config.load(None, [("strategy.name", "dp")])
    with pytest.raises(ConfigError, match="strategy dp cannot run on 2 processes \\(dp drives every GPU from one process\\)"):
        check_world(dp, 2, 1000)


def _options_typed(test) -> list[tuple[str, object]]:
    """(section.option, declared type) of every option whose type passes `test`, found from the dataclasses."""
    return [(f"{section}.{name}", tp)
            for section, cls in typing.get_type_hints(RunConfig).items()
            for name, tp in typing.get_type_hints(cls).items() if test(tp)]


FLOAT_OPTIONS = [key for key, _ in _options_typed(lambda tp: typing.get_origin(tp) is not tuple and float in (tp, *typing.get_args(tp)))]
LITERAL_OPTIONS = _options_typed(lambda tp: typing.get_origin(tp) is Literal)


def test_introspection_finds_the_options_it_should():
    assert {"optim.lr", "optim.momentum", "optim.weight_decay", "optim.gamma", "train.grad_clip", "launch.timeout_s"} <= set(FLOAT_OPTIONS)
    assert {"optim.name", "optim.schedule", "strategy.name", "launch.device"} <= {key for key, _ in LITERAL_OPTIONS}


@pytest.mark.parametrize("key, tp", LITERAL_OPTIONS, ids=[key for key, _ in LITERAL_OPTIONS])
def test_literal_options_refuse_other_values_naming_the_allowed_ones(key, tp):
    allowed = typing.get_args(tp)
    with pytest.raises(ConfigError) as err:
        config.load(None, [(key, "bogus")])
    assert str(err.value) == f"{key} = 'bogus' is not one of {', '.join(allowed)}; pick one of them."
    section, _, option = key.partition(".")
    for value in allowed:  # every member is accepted, from the CLI and from TOML alike
        assert getattr(getattr(config.load(None, [(key, value)]), section), option) == value
        assert getattr(getattr(config.from_dict({section: {option: value}}), section), option) == value


@pytest.mark.parametrize("key", FLOAT_OPTIONS)
@pytest.mark.parametrize("text, reads_as", [("inf", ""), ("-inf", ""), ("nan", ""), ("1e400", " (it reads as inf)"),
                                            ("-1e400", " (it reads as -inf)"), ("Infinity", " (it reads as inf)")])
def test_every_float_option_refuses_non_finite_numbers(key, text, reads_as):
    with pytest.raises(ConfigError) as err:
        config.load(None, [(key, text)])
    assert str(err.value) == f"{key} = {text}{reads_as} is not a finite number; give a finite value."


@pytest.mark.parametrize("key", FLOAT_OPTIONS)
def test_non_finite_numbers_in_a_toml_file_are_refused_too(tmp_path, key):
    section, _, option = key.partition(".")
    path = tmp_path / "run.toml"
    for value in ("inf", "-inf", "nan"):  # TOML's own spellings
        path.write_text(f"[{section}]\n{option} = {value}\n")
        with pytest.raises(ConfigError, match=f"^{key} = {value} is not a finite number; give a finite value.$"):
            config.load(path)


@pytest.mark.parametrize("key", FLOAT_OPTIONS + ["optim.betas"])
@pytest.mark.parametrize("text", ["1e308", "3.5e38", "1e-320", "-1e308"])
def test_every_float_option_refuses_a_number_beyond_32_bit_floats_in_one_sentence_naming_it(tmp_path, key, text):
    # --optim.lr 1e308 passed every check, then failed SGD's first step: "value cannot be converted to type float
    # without overflow", naming no option. Where an option has a range of its own (a timeout's week, a rate's sign,
    # betas below 1), its own sentence comes first.
    section, _, option = key.partition(".")
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\n{option} = {'[0.9, ' + text + ']' if key == 'optim.betas' else text}\n")
    for load in (lambda: config.load(None, [(key, "0.9," + text if key == "optim.betas" else text)]),
                 lambda: config.load(path)):
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert message.startswith(f"{key} = ") and message.endswith(".") and message.count(". ") == 0, message
        if "must" not in message and "minimum" not in message and "maximum" not in message:
            beyond = "above 3.4e+38, the largest" if text[0] != "-" and float(text) > 1 else "closer to 0 than 1.2e-38"
            assert f"{key} = {float(text)} is {beyond}" in message, message


@pytest.mark.parametrize("key", [key for key in FLOAT_OPTIONS if key != "launch.timeout_s"])
def test_the_edges_of_32_bit_floats_are_accepted(key):
    section, _, option = key.partition(".")
    for text in ("3.4e38", "1.2e-38"):
        assert getattr(getattr(config.load(None, [(key, text)]), section), option) == float(text)


@pytest.mark.parametrize("scale, batch, lr, beyond, advice", [
    ("linear", "100000", "1e38", "above 3.4e+38, the largest 32-bit float", "smaller"),
    ("sqrt", "1", "1e-37", "closer to 0 than 1.2e-38, the smallest normal 32-bit float", "larger"),
])
def test_a_peak_rate_scaled_beyond_32_bit_floats_is_refused_naming_optim_lr(scale, batch, lr, beyond, advice):
    pairs = [("optim.lr", lr), ("optim.scale_lr_with", scale), ("train.global_batch_size", batch)]
    peak = OptimConfig(lr=float(lr), scale_lr_with=scale).peak_lr(int(batch))
    with pytest.raises(ConfigError) as err:
        config.load(None, pairs)
    assert str(err.value) == (f"optim.lr = {float(lr)} scaled by optim.scale_lr_with {scale} to "
                              f"train.global_batch_size {batch} is a peak rate of {peak:.3g}, {beyond}; give a "
                              f"{advice} optim.lr.")
    # the global batch a per-rank batch makes is checked too (resolve_batch replaces it in the config)
    fine = config.load(None, [("optim.lr", lr), ("optim.scale_lr_with", scale)])
    with pytest.raises(ConfigError, match="^optim.lr = .* is a peak rate of"):
        dataclasses.replace(fine, train=dataclasses.replace(fine.train, global_batch_size=int(batch)))


def test_a_step_schedule_that_raises_the_rate_beyond_32_bit_floats_ends_in_inf_not_in_a_refused_conversion():
    # gamma above 1 raises the rate at each drop: 10 x 3e38 failed SGD's step ("value cannot be converted to type
    # float without overflow"), and 3e38 ** 9 raised OverflowError in the schedule. inf makes the loss nan, which the
    # loop reports as a diverged run naming optim.lr.
    import torch

    from dptrain.schedule import build_scheduler

    cfg = config.load(None, [("optim.name", "sgd"), ("optim.lr", "10"), ("optim.schedule", "step"),
                             ("optim.gamma", "3e38")])
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=10.0)
    schedule = build_scheduler(cfg, optimizer, total_steps=20, steps_per_epoch=1)
    weight.grad = torch.ones(2)
    for step in range(1, 13):  # 3e38 ** 9 is beyond any float
        optimizer.step()  # after the first drop, a finite rate above float32's range raised RuntimeError here
        schedule.step()
        assert schedule.get_last_lr() == [float("inf")], step
    assert not torch.isfinite(weight).any()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optim.lr", "0", "optim.lr = 0.0 must be greater than 0."),
        ("optim.momentum", "-0.1", "optim.momentum = -0.1 must be 0 or more."),
        ("optim.weight_decay", "-1e-4", "optim.weight_decay = -0.0001 must be 0 or more."),
        ("optim.gamma", "0", "optim.gamma = 0.0 must be greater than 0."),
        ("train.grad_clip", "-1", "train.grad_clip = -1.0 must be greater than 0."),
        ("train.eval_batch_size", "0", "train.eval_batch_size = 0 must be greater than 0."),
        ("launch.max_restarts", "-1", "launch.max_restarts = -1 must be 0 or more."),
        ("checkpoint.every_epochs", "-1", "checkpoint.every_epochs = -1 must be 0 or more."),
        ("data.num_workers", "-2", "data.num_workers = -2 must be 0 or more."),
    ],
)
def test_numbers_out_of_range_are_refused(key, value, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, [(key, value)])
    assert str(err.value) == message


def test_zero_momentum_and_weight_decay_are_allowed():
    cfg = config.load(None, [("optim.momentum", "0"), ("optim.weight_decay", "0")])
    assert (cfg.optim.momentum, cfg.optim.weight_decay) == (0.0, 0.0)


@pytest.mark.parametrize("value", ["1e-9", "0", "0.5", "-5"])
def test_launch_timeout_has_a_minimum_of_one_second(value):
    with pytest.raises(ConfigError) as err:
        config.load(None, [("launch.timeout_s", value)])
    assert str(err.value) == (f"launch.timeout_s = {float(value):g} is below the minimum of 1 s: it bounds the rendezvous "
                              f"and every collective, and starting the workers alone takes longer than that; "
                              f"set 1 or more (the default is 300).")


def test_launch_timeout_of_one_second_is_accepted():
    assert config.load(None, [("launch.timeout_s", "1")]).launch.timeout_s == 1.0


@pytest.mark.parametrize("value", ["604801", "1e10", "1e300"])
def test_launch_timeout_has_a_maximum_of_a_week(value):
    # 1e10 s overflowed c10d's deadline (nanoseconds of a 64-bit clock) and failed every run with 2 workers.
    with pytest.raises(ConfigError) as err:
        config.load(None, [("launch.timeout_s", value)])
    assert str(err.value) == (f"launch.timeout_s = {float(value):g} is above the maximum of 604800 s (7 days) that a "
                              f"collective may wait; set 604800 or less (the default is 300).")
    assert config.load(None, [("launch.timeout_s", "604800")]).launch.timeout_s == 604800.0


def test_names_are_checked_against_one_list_or_taken_as_import_paths():
    with pytest.raises(ConfigError) as err:
        config.load(None, [("model.name", "vgg")])
    assert str(err.value) == (f"model.name = 'vgg' is not one of {', '.join(config.MODEL_NAMES)}, nor an import path "
                              f"package.module:Name; pick one of them or give an import path.")
    assert config.load(None, [("model.name", "my_pkg.nets:Net")]).model.name == "my_pkg.nets:Net"  # preflight imports it


def leaf_options(cls: type, prefix: str) -> list[str]:
    """Every option's dotted name, a strategy's table (strategy.ddp) entered."""
    names = []
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) is typing.ClassVar:
            continue
        names += leaf_options(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
    return names


def test_every_option_has_a_docstring_and_a_default_that_reads_back():
    """--help is generated from these; a new option without a docstring fails here."""
    listed = {f"{o.section}.{o.name}": o for o in config.options()}
    assert set(listed) == set(leaf_options(RunConfig, ""))
    made = {"output.name": "DATA_MODEL_STRATEGY[_HASH]"}  # shown as what a run gets, which train makes for it
    for key, option in listed.items():
        assert option.doc.strip(), f"{key} has no docstring"
        if key in made:
            assert option.default == made[key], key
            continue
        assert config.load(None, [(key, option.default)]) == RunConfig(), key  # the shown default is the default


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", ".", "", ".hidden", "-x", "a,b", "a b", "x" * 101,
                                  "a\n2026-11-24 12:00:00,000 rank0 INFO [METRIC] epoch=9", "\x1b[31mred", "caf\udcc3"])
def test_a_run_name_is_a_short_printable_name_not_a_path(name):
    # One name forged 4 [METRIC] lines in the console and the log; '../../x' wrote outside runs/.
    with pytest.raises(ConfigError) as err:
        config.load(None, [("output.name", name)])
    message = str(err.value)
    assert message.startswith("output.name = ") and "is not a run name; use up to 100 letters, digits and ._-+=@" in message
    assert message.isprintable()  # the name is shown escaped: no line break, escape or lone surrogate reaches the console
    assert len(message) < 300


@pytest.mark.parametrize("name", ["run", "sgd-cosine", "e2e", "_x", "a.b_c+d=e@f-1", "x" * 100])
def test_plain_run_names_are_accepted(name):
    assert config.load(None, [("output.name", name)]).output.run_dir == Path("runs") / name


@pytest.mark.parametrize("folder", ["runs/a\nb", "runs/\x1b[2Jx", "runs/\udcff"])
def test_a_run_folder_with_control_characters_is_refused(folder):
    with pytest.raises(ConfigError, match="holds a control character .* give a folder whose path is printable text") as err:
        config.load(None, [("output.dir", folder)])
    assert str(err.value).isprintable()
    assert config.load(None, [("output.dir", "/tmp/my runs/é")]).output.run_dir == Path("/tmp/my runs/é")


def _refusal(path) -> str:
    with pytest.raises(ConfigError) as err:
        config.load(path)
    message = str(err.value)
    assert message.isprintable() and message.endswith(".") and len(message) < 300
    return message


def test_a_config_file_that_is_no_small_text_file_is_one_sentence(tmp_path):
    # /dev/zero was read until memory ran out (7 GB); a folder and a binary file gave tracebacks.
    assert _refusal("/dev/zero") == ("config file /dev/zero is a character device, not a regular file; check that the "
                                     "path names the right file.")
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * (config.MAX_CONFIG_BYTES // 10) + "[optim]\nlr = 0.1\n")
    assert "is larger than 1 MiB" in _refusal(big)
    assert _refusal(tmp_path) == f"config file {tmp_path} is a directory, not a file; give the path of the file."
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\x14\x00\x00\x08\x08\x00\xe2\xab")
    assert _refusal(binary) == (f"config file {binary} is not UTF-8 text (byte 10 is 0xe2; a binary file?); check that the "
                                f"path names the right file.")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, sentence", [
    (".".join(["a"] * 50_000) + " = 1\n", "has a dotted key of 50000 parts (at most 16: an option is section.option)"),
    (".".join(['"a"'] * 50_000) + " = 1\n", "has a dotted key of 50000 parts (at most 16: an option is section.option)"),
    ("[" + ".".join(["t"] * 17) + "]\n", "has a dotted key of 17 parts (at most 16: an option is section.option)"),
    ("x = " + "[" * 3000 + "]" * 3000 + "\n", "nests brackets more than 32 deep, far more than a config needs"),
    ("x = " + "{a = " * 33 + "1" + "}" * 33 + "\n", "nests brackets more than 32 deep, far more than a config needs"),
    ("[train]\nepochs = " + "1" * 5000 + "\n", "has a key or number longer than 100 characters"),
    ("a" * 101 + " = 1\n", "has a key or number longer than 100 characters"),
])
def test_a_config_file_beyond_any_configs_needs_is_refused_before_parsing(tmp_path, text, sentence):
    # The 50,000-part key took tomllib 61 s and 15 GB; 3,000 brackets gave a 3,002-line RecursionError; a 5,000-digit
    # number a ValueError traceback.
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    assert _refusal(path) == f"config file {path} {sentence}; fix the file."


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ['"""\\' * 250_000, '"\\' * 500_000, "'''\\" * 250_000, 'x = "a\\\n' * 100_000])
def test_unterminated_strings_are_scanned_in_linear_time(tmp_path, text):
    # A scan that retried a failing string match from every quote took minutes on these.
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    assert _refusal(path).startswith(f"config file {path} ")


def test_brackets_and_dots_in_strings_and_comments_are_not_counted(tmp_path):
    path = tmp_path / "run.toml"
    deep = "[" * 40 + "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r"
    path.write_text(f'# {deep} "\n[slurm]\nsetup = ["echo {deep}", \'{deep}\', """{deep}"""]\n'
                    f"[optim]  # {deep}\nlr = 1.5e-3\n[data]\nroot = \'\'\'\n{deep}\n\'\'\'\n")
    cfg = config.load(path)
    assert cfg.slurm.setup == (f"echo {deep}", deep, deep) and cfg.optim.lr == 1.5e-3 and cfg.data.root == f"{deep}\n"


def test_a_key_of_the_file_cannot_forge_a_log_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\n"x\\n2026-11-24 12:00:00,000 rank0 INFO [METRIC] epoch=9" = 1\n')
    assert _refusal(path).startswith("unknown option optim.'x\\n2026-11-24 12:00:00,000 rank0 INFO [METRIC] epoch=9';")
