"""A ds_config.json as the tutorials write it (seed 003: a batch, Adam with its betas and eps, gradient clipping, a
WarmupLR scheduler) is read into dptrain's options where the run does not set them, and refused in one sentence where
it contradicts the run; optim.betas and optim.eps reach torch's optimizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.cli import main
from dptrain.config import OptimConfig, RunConfig, load as load_config
from dptrain.errors import ConfigError
from dptrain.strategies.registry import check_world
from dptrain.strategies.base import optimizer_choice
from dptrain.strategies.deepspeed.ds_config import adopt_user_config, file_options

# Seed 003's ds_config.json: the same keys and values, as data.
TUTORIAL = {
    "train_batch_size": 400,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
}


def run_config(tmp_path: Path, ds: dict, *overrides: tuple[str, str]) -> RunConfig:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return load_config(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(path)), *overrides])


def refusal(cfg: RunConfig) -> str:
    with pytest.raises(ConfigError) as caught:
        check_world(cfg, 2, 1000, on_cpu=True)
    return str(caught.value)


# ---------------------------------------------------------------- optim.betas and optim.eps


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_betas_and_eps_reach_torchs_optimizer(name):
    optim = OptimConfig(name=name, betas=(0.8, 0.99), eps=1e-6)
    built = optimizer_choice(optim, 0.01, fused=False).build(nn.Linear(2, 1).parameters())
    assert built.param_groups[0]["betas"] == (0.8, 0.99)
    assert built.param_groups[0]["eps"] == 1e-6


def test_betas_and_eps_default_to_torchs():
    built = optimizer_choice(OptimConfig(), 0.01, fused=False).build(nn.Linear(2, 1).parameters())
    plain = torch.optim.Adam(nn.Linear(2, 1).parameters())
    assert (built.param_groups[0]["betas"], built.param_groups[0]["eps"]) == (plain.defaults["betas"], plain.defaults["eps"])


def test_betas_are_read_from_the_command_line_and_checked():
    assert load_config(None, [("optim.betas", "0.8,0.999"), ("optim.eps", "1e-7")]).optim.betas == (0.8, 0.999)
    with pytest.raises(ConfigError, match=r"^optim.betas = \[0.9\] must be two numbers from 0 up to \(not including\) 1, like 0.9,0.999\.$"):
        load_config(None, [("optim.betas", "0.9")])
    with pytest.raises(ConfigError, match=r"^optim.betas = \[0.9, 1.0\] must be two numbers"):
        load_config(None, [("optim.betas", "0.9,1")])
    with pytest.raises(ConfigError, match=r"^optim.betas = inf is not a finite number; give a finite value\.$"):
        load_config(None, [("optim.betas", "inf,0.999")])
    with pytest.raises(ConfigError, match=r"^optim.eps = 0.0 must be greater than 0\.$"):
        load_config(None, [("optim.eps", "0")])


def test_betas_and_eps_are_computation_options_a_resume_keeps():
    from dptrain.snapshots import computation_options

    options = computation_options(load_config(None, [("optim.betas", "0.8,0.999")]))
    assert options["optim.betas"] == [0.8, 0.999] and options["optim.eps"] == 1e-8


# ---------------------------------------------------------------- the tutorial's file, read into the options


def test_the_tutorials_file_maps_to_dptrains_options(tmp_path):
    path = str(tmp_path / "ds_config.json")
    assert file_options(TUTORIAL, path) == {
        "train.global_batch_size": 400, "train.grad_clip": 1.0, "optim.name": "adamw", "optim.lr": 0.001,
        "optim.weight_decay": 3e-7, "optim.betas": [0.8, 0.999], "optim.eps": 1e-8,
        "optim.schedule": "constant", "optim.warmup_steps": 1000, "strategy.deepspeed.warmup_type": "log"}


def test_the_tutorials_file_is_accepted_as_written(tmp_path):
    """Refused before: train_batch_size 400 against the default batch, WarmupLR, betas [0.8, 0.999]."""
    cfg = adopt_user_config(run_config(tmp_path, TUTORIAL))
    check_world(cfg, 2, 1000, on_cpu=True)
    assert (cfg.train.global_batch_size, cfg.train.grad_clip) == (400, 1.0)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay) == \
        ("adamw", 0.001, (0.8, 0.999), 1e-8, 3e-7)
    assert (cfg.optim.schedule, cfg.optim.warmup_steps) == ("constant", 1000)
    assert cfg.strategy.deepspeed.warmup_type == "log"  # DeepSpeed's default: the file names no warmup_type


def test_gradient_accumulation_steps_is_read_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed's train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks: the file's
    accumulation becomes train.accumulate_steps (refused before: dptrain took one micro-batch a step)."""
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}
    cfg = adopt_user_config(run_config(tmp_path, ds))
    check_world(cfg, 2, 1000, on_cpu=True)
    assert (cfg.train.global_batch_size, cfg.train.accumulate_steps) == (64, 4)
    from dptrain.strategies.deepspeed.ds_config import engine_config

    assert engine_config(ds, 2, cfg.train.accumulate_steps)["gradient_accumulation_steps"] == 4
    # the run's own accumulation is kept where it gives one, and a contradiction refused
    given = adopt_user_config(run_config(tmp_path, ds, ("train.accumulate_steps", "2")), given={"train.accumulate_steps"})
    assert refusal(given) == (f"{tmp_path / 'ds_config.json'} sets gradient_accumulation_steps 4 but "
                              f"train.accumulate_steps is 2; set --train.accumulate_steps 4, or remove "
                              f"gradient_accumulation_steps from the file.")


def test_options_the_run_gives_are_kept_and_agreeing_ones_accepted(tmp_path):
    cfg = run_config(tmp_path, TUTORIAL, ("train.global_batch_size", "400"), ("optim.name", "adamw"))
    adopted = adopt_user_config(cfg, given={"train.global_batch_size", "optim.name"})
    check_world(adopted, 2, 1000, on_cpu=True)
    assert adopted.train.global_batch_size == 400


CONTRADICTIONS = {  # name -> (the options the run gives, the one sentence)
    "batch": ((("train.global_batch_size", "128"),),
              "sets train_batch_size 400 but train.global_batch_size is 128; set --train.global_batch_size 400, or remove "
              "train_batch_size from the file."),
    "betas": ((("optim.betas", "0.9,0.999"),),
              "sets optimizer betas [0.8, 0.999] but optim.betas is [0.9, 0.999]; set --optim.betas 0.8,0.999, or remove "
              "betas from the file."),
    "clipping": ((("train.grad_clip", "0.5"),),
                 "sets gradient_clipping 1.0 but train.grad_clip is 0.5; set --train.grad_clip 1.0, or remove "
                 "gradient_clipping from the file."),
    "warm-up": ((("optim.warmup_steps", "10"),),
                "sets scheduler warmup_num_steps 1000 but optim.warmup_steps is 10; set --optim.warmup_steps 1000, or "
                "remove the scheduler section."),
    "schedule": ((("optim.schedule", "cosine"),),
                 "has scheduler WarmupLR, which holds the rate after its warm-up, but optim.schedule is cosine; set "
                 "--optim.schedule constant, or remove the scheduler section."),
    "warm-up shape": ((("strategy.deepspeed.warmup_type", "linear"),),
                      "has scheduler WarmupLR without warmup_type (DeepSpeed's \"log\"), but "
                      "strategy.deepspeed.warmup_type is linear; set --strategy.deepspeed.warmup_type log, or set "
                      "\"warmup_type\": \"linear\" in the file."),
    "peak rate": ((("optim.lr", "0.01"),),
                  "sets optimizer lr 0.001 but optim.lr is 0.01; set --optim.lr 0.001, or remove lr from the file."),
}


@pytest.mark.parametrize("name", CONTRADICTIONS)
def test_a_contradiction_with_a_given_option_is_one_sentence(tmp_path, name):
    overrides, sentence = CONTRADICTIONS[name]
    cfg = adopt_user_config(run_config(tmp_path, TUTORIAL, *overrides), given={key for key, _ in overrides})
    assert refusal(cfg) == f"{tmp_path / 'ds_config.json'} {sentence}"


def test_without_the_given_names_an_option_off_its_default_counts_as_given(tmp_path):
    cfg = adopt_user_config(run_config(tmp_path, TUTORIAL, ("train.global_batch_size", "64")))
    assert cfg.train.global_batch_size == 64 and cfg.optim.betas == (0.8, 0.999)
    assert "sets train_batch_size 400 but train.global_batch_size is 64" in refusal(cfg)


WARMUPS = {  # name -> (the scheduler's params, the one sentence's fragment)
    "another shape": ({"warmup_num_steps": 5, "warmup_type": "cosine"},
                      "sets scheduler warmup_type \"cosine\", which is not one of DeepSpeed's (it would rise along its "
                      "log curve instead); set \"log\" or \"linear\"."),
    "from a floor": ({"warmup_num_steps": 5, "warmup_min_lr": 1e-5},
                     "sets scheduler warmup_min_lr 1e-05, but dptrain's warm-up starts from 0; set 0, or remove "
                     "warmup_min_lr from the file."),
    "to another rate": ({"warmup_num_steps": 5, "warmup_max_lr": 0.1},
                        "sets scheduler warmup_max_lr 0.1 but optim.lr is 0.001, the rate the warm-up reaches; set "
                        "--optim.lr 0.1, or remove warmup_max_lr from the file."),
    "another key": ({"warmup_num_steps": 5, "last_batch_iteration": 3},
                    "sets scheduler last_batch_iteration, which dptrain's warm-up does not take (it reads warmup_min_lr, "
                    "warmup_num_steps, warmup_type, warmup_max_lr); remove it."),
}


@pytest.mark.parametrize("name", WARMUPS)
def test_a_warmup_dptrain_cannot_honour_is_one_sentence_naming_the_key(tmp_path, name):
    params, sentence = WARMUPS[name]
    cfg = adopt_user_config(run_config(tmp_path, {"scheduler": {"type": "WarmupLR", "params": params}}))
    assert cfg.optim.warmup_steps == 5
    assert refusal(cfg) == f"{tmp_path / 'ds_config.json'} {sentence}"


def test_warmup_lr_with_deepspeeds_defaults_is_1000_steps_to_optim_lr(tmp_path):
    cfg = adopt_user_config(run_config(tmp_path, {"scheduler": {"type": "WarmupLR"}}))
    check_world(cfg, 2, 1000, on_cpu=True)
    assert (cfg.optim.warmup_steps, cfg.optim.lr) == (1000, 1e-3)


def test_a_run_without_a_file_is_left_as_it_is():
    cfg = load_config(None, [("strategy.name", "deepspeed")])
    assert adopt_user_config(cfg) is cfg


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_dptrain_train_takes_the_tutorials_file(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(TUTORIAL))
    code = main(["train", "--dry-run", "--strategy.name", "deepspeed", "--strategy.deepspeed.config", str(path),
                 "--data.name", "synthetic", "--output.dir", str(tmp_path / "runs"), "--nproc-per-node", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "400" in out
    # The settings taken from the file, and the warm-up of 1,000 steps over a run of 22, said in one line each.
    assert f"  ds_config  settings from {path}: train.global_batch_size 400, train.grad_clip 1, " in out
    assert "warm-up 1000 steps along DeepSpeed's log curve" in out
    assert ("warning: optim.warmup_steps 1000 is longer than the run's 22 optimizer steps, so the learning rate never "
            "reaches its peak 0.001 (the last step runs at 45% of it)") in out


RATE = "a number from 1.2e-38 to 3.4e+38"
QUOTED = " (text: JSON writes numbers, true and false without quotes)"
WRONG_VALUES = {  # name -> (the file's settings, the key, its value as shown, what dptrain takes)
    # each got advice that could not work: set --optim.lr 0.01 (then the same sentence again), --train.global_batch_size
    # True, --optim.warmup_steps 1e+30, --train.global_batch_size 1616 (the text "16" times 2 ranks)
    "lr as text": ({"optimizer": {"type": "Adam", "params": {"lr": "0.01"}}}, "optimizer.params.lr", '"0.01"' + QUOTED,
                   RATE),
    "batch as true": ({"train_batch_size": True}, "train_batch_size", "true", "an integer above 0"),
    "warm-up of 1e30 steps": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e30}}},
                              "scheduler.params.warmup_num_steps", "1e+30", "an integer 0 or more"),
    "micro batch as text": ({"train_micro_batch_size_per_gpu": "16"}, "train_micro_batch_size_per_gpu", '"16"' + QUOTED,
                            "an integer above 0"),
    "accumulation as text": ({"gradient_accumulation_steps": "1"}, "gradient_accumulation_steps", '"1"' + QUOTED,
                             "an integer above 0"),
    "clipping as text": ({"gradient_clipping": "1.0"}, "gradient_clipping", '"1.0"' + QUOTED,
                         f"0 (no clipping) or {RATE}"),
    "negative clipping": ({"gradient_clipping": -1}, "gradient_clipping", "-1", f"0 (no clipping) or {RATE}"),
    "lr beyond float32": ({"optimizer": {"type": "Adam", "params": {"lr": 1e39}}}, "optimizer.params.lr", "1e+39",
                          RATE),
    "one beta": ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "[0.9]",
                 "two numbers from 0 up to (not including) 1, like [0.9, 0.999]"),
    "betas of 1": ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1]}}}, "optimizer.params.betas", "[0.9, 1]",
                   "two numbers from 0 up to (not including) 1, like [0.9, 0.999]"),
    "negative warm-up": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
                         "scheduler.params.warmup_num_steps", "-5", "an integer 0 or more"),
    "fp16 off as text": ({"fp16": {"enabled": "false"}}, "fp16.enabled", '"false"' + QUOTED, 'true, false or "auto"'),
    "adam_w_mode as text": ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}},
                            "optimizer.params.adam_w_mode", '"false"' + QUOTED, "true or false"),
    "a long text": ({"train_batch_size": "x" * 500}, "train_batch_size",
                    '"' + "x" * 59 + "... (502 characters)" + QUOTED, "an integer above 0"),
}


@pytest.mark.parametrize("name", WRONG_VALUES)
def test_a_value_of_the_wrong_type_or_range_is_one_sentence_naming_the_key_and_what_is_valid(tmp_path, capsys, name):
    ds, key, shown, valid = WRONG_VALUES[name]
    path = tmp_path / "ds_config.json"
    sentence = f"{path} sets {key} {shown}, where dptrain takes {valid}; fix the value, or remove {key} from the file."
    cfg = run_config(tmp_path, ds)
    with pytest.raises(ConfigError) as caught:
        adopt_user_config(cfg)  # the first reader: the value was taken into the option, or left to a wrong sentence
    assert str(caught.value) == sentence
    assert refusal(cfg) == sentence
    code = main(["config", "--strategy.name", "deepspeed", "--strategy.deepspeed.config", str(path), "--data.name",
                 "synthetic", "--nproc-per-node", "2"])
    assert (code, capsys.readouterr().err) == (2, f"dptrain: error: {sentence}\n")


def test_auto_in_the_warmup_is_dptrains_value_not_advice_to_set_an_option_to_auto(tmp_path):
    # "auto" (Hugging Face's placeholder) was compared as it is: "sets scheduler warmup_min_lr "auto" ... set 0",
    # and for warmup_num_steps the advice --optim.warmup_steps auto.
    auto = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "warmup_type": "auto"}
    cfg = adopt_user_config(run_config(tmp_path, {"scheduler": {"type": "WarmupLR", "params": auto}},
                                       ("optim.warmup_steps", "10"), ("optim.scale_lr_with", "linear")))
    check_world(cfg, 2, 1000, on_cpu=True)
    assert (cfg.optim.warmup_steps, cfg.optim.lr) == (10, 1e-3)


# ---------------------------------------------------------------- WarmupLR's rise, as DeepSpeed computes it


def tutorial_rates(tmp_path: Path, ds: dict, steps: int) -> list[float]:
    """The learning rate dptrain sets after 0, 1, ..., steps - 1 optimizer steps of a run adopting the file."""
    from dptrain.schedule import build_scheduler

    cfg = adopt_user_config(run_config(tmp_path, ds))
    check_world(cfg, 2, 1000, on_cpu=True)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    schedule = build_scheduler(cfg, optimizer, total_steps=5000, steps_per_epoch=100)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("warmup_type", [None, "log", "linear"])
def test_warmup_lr_rises_as_deepspeeds_own_scheduler(tmp_path, warmup_type):
    """Before: without warmup_type the rate rose linearly (6e-06 after 6 steps); DeepSpeed's default is its log curve
    (about 2.8e-4 there). Compared with deepspeed.runtime.lr_schedules.WarmupLR itself, step by step."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="DeepSpeed is not installed (a dev dependency)")
    params = {**TUTORIAL["scheduler"]["params"], **({"warmup_type": warmup_type} if warmup_type else {})}
    ours = tutorial_rates(tmp_path, {**TUTORIAL, "scheduler": {"type": "WarmupLR", "params": params}}, steps=1100)
    theirs_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.001)
    theirs = lr_schedules.WarmupLR(theirs_optimizer, **params)
    expected = []
    for steps_done in range(1100):
        theirs.step(steps_done)  # its last_batch_iteration: the optimizer steps done
        expected.append(theirs_optimizer.param_groups[0]["lr"])
    assert ours == pytest.approx(expected, rel=1e-12, abs=0)
    assert ours[6] == pytest.approx(6e-6 if warmup_type == "linear" else 2.817e-4, rel=1e-3)
    assert ours[0] == 0 and ours[1000:] == [0.001] * 100


def test_the_settings_taken_from_the_file_are_one_line(tmp_path):
    from dptrain.strategies.deepspeed.ds_config import settings_line

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(TUTORIAL))
    assert settings_line(str(path)) == (
        f"settings from {path}: train.global_batch_size 400, train.grad_clip 1, optim.name adamw, optim.lr 0.001, "
        f"optim.weight_decay 3e-07, optim.betas 0.8,0.999, optim.eps 1e-08, optim.schedule constant, "
        f"optim.warmup_steps 1000, strategy.deepspeed.warmup_type log")
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert settings_line(str(path)) is None


@pytest.mark.parametrize("is_main", [True, False])
def test_the_run_prints_the_files_settings_once_as_it_starts(tmp_path, monkeypatch, caplog, is_main):
    """docs/strategies.md said the settings taken from the file are printed: nothing printed them. DeepSpeed's engine
    is faked here (its set-up is timed elsewhere): the line is the strategy's, on rank 0."""
    from types import SimpleNamespace

    from dptrain.strategies.deepspeed.strategy import DeepSpeed

    cfg = adopt_user_config(run_config(tmp_path, TUTORIAL))
    model = nn.Linear(2, 1)
    engine = SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.001))
    fake = SimpleNamespace(initialize=lambda **kwargs: (engine, None, None, None))
    strategy = DeepSpeed(cfg.strategy, SimpleNamespace(world_size=1, is_main=is_main, local_rank=0), torch.device("cpu"))
    monkeypatch.setattr(strategy, "_import_deepspeed", lambda: fake)
    strategy.wrap(model)
    with caplog.at_level("INFO", logger="dptrain"):
        strategy.build_optimizer(model, optimizer_choice(cfg.optim, cfg.optim.lr, fused=False))
    lines = [record.getMessage() for record in caplog.records if "settings from" in record.getMessage()]
    assert lines == ([f"settings from {tmp_path / 'ds_config.json'}: train.global_batch_size 400, train.grad_clip 1, "
                      f"optim.name adamw, optim.lr 0.001, optim.weight_decay 3e-07, optim.betas 0.8,0.999, optim.eps "
                      f"1e-08, optim.schedule constant, optim.warmup_steps 1000, strategy.deepspeed.warmup_type log"]
                     if is_main else [])
