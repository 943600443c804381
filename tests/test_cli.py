"""Bad input through the CLI: one sentence on stderr, a non-zero exit, nothing already written lost."""

from __future__ import annotations

import pytest

from dptrain.cli import main, split_overrides
from dptrain.config import experiment_name, load
from dptrain.errors import ConfigError
from tests.idx_files import idx_bytes, write_idx_dataset


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_split_overrides_accepts_both_spellings():
    assert split_overrides(["--optim.lr", "3e-4", "--train.bf16=true"]) == [("optim.lr", "3e-4"), ("train.bf16", "true")]
    with pytest.raises(ConfigError, match="needs a value"):
        split_overrides(["--optim.lr"])
    with pytest.raises(ConfigError, match="unexpected argument 'fast'"):
        split_overrides(["fast"])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optim.zzz", "1"], "unknown option optim.zzz; valid options in [optim] are"),
        (["--data.name", "synthetic", "--nproc-per-node", "3"], "train.global_batch_size 128 is not divisible by the world size 3"),
        (["--data.name", "synthetic", "--data.synthetic_train_size", "3", "--nproc-per-node", "4", "--train.global_batch_size", "4"],
         "world size 4 is larger than the training split (3 samples)"),
        (["--data.name", "synthetic", "--data.synthetic_shape", "3,32,32"], "model mnist-cnn takes 1x28x28 images but the dataset has 3x32x32; use --model.name cifar-cnn or resnet18"),
        (["--data.name", "synthetic", "--strategy.name", "single", "--nproc-per-node", "2"], "strategy single cannot run on 2 processes (it runs one process); start one process, or use --strategy.name ddp."),
        (["--data.name", "mnist", "--data.root", "nowhere"], "dataset mnist not found in nowhere/MNIST/raw, nowhere/mnist, nowhere"),
        (["--data.name", "synthetic", "--model.name", "no_such_pkg.models:Net"], "cannot import module no_such_pkg.models"),
        # a number beyond 32-bit floats failed SGD's first step, naming no option
        (["--data.name", "synthetic", "--optim.name", "sgd", "--optim.lr", "1e308"],
         "optim.lr = 1e+308 is above 3.4e+38, the largest 32-bit float, and the training's tensors hold 32-bit floats; "
         "give a smaller value."),
        # a global batch larger than the split: every step took the whole split, with the rate scaled by the batch
        (["--data.name", "synthetic", "--train.global_batch_size", "100000", "--optim.scale_lr_with", "linear"],
         "train.global_batch_size 100000 is larger than the training split (4096 samples), so every step would take "
         "the whole split; choose 4096 or less."),
        (["--data.name", "synthetic", "--train.batch_size_per_rank", "3000", "--nproc-per-node", "2"],
         "train.batch_size_per_rank 3000 x 2 ranks is a global batch of 6000, larger than the training split (4096 "
         "samples), so every step would take the whole split; choose a batch per rank of 2048 or less."),
    ],
)
def test_bad_input_is_one_sentence_before_any_worker_starts(capsys, tmp_path, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, "train", *argv)
    assert code == 2
    assert err.startswith("dptrain: error: ") and fragment in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_corrupt_dataset_names_the_file_and_keeps_earlier_results(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "data" / "MNIST" / "raw"
    write_idx_dataset(raw, train_size=50, test_size=20, gz=False)
    whole = (raw / "train-images-idx3-ubyte").read_bytes()
    (raw / "train-images-idx3-ubyte").write_bytes(whole[: len(whole) // 2])  # truncated mid-data
    options = ["--data.name", "mnist", "--train.global_batch_size", "10"]
    run_dir = tmp_path / "runs" / experiment_name(load(None, split_overrides(options)))  # the run's default folder
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"event": "epoch", "epoch": 1}\n')
    code, err = run_main(capsys, "train", *options)
    assert code == 1
    assert "rank 0 failed during data loading" in err and "train-images-idx3-ubyte is truncated" in err
    assert len(err.splitlines()) == 1
    assert (run_dir / "metrics.jsonl").read_text().startswith('{"event": "epoch", "epoch": 1}\n')


def test_one_process_run_in_this_process(capsys, tmp_path, monkeypatch):
    """world size 1 runs without the agent; exact counts even with a test split smaller than a batch."""
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "data"
    write_idx_dataset(raw, train_size=64, test_size=7)
    (raw / "extra.bin").write_bytes(idx_bytes(__import__("numpy").zeros(3, dtype="uint8")))  # ignored
    options = ["--data.name", "mnist", "--data.root", str(raw), "--strategy.name", "single",
               "--train.global_batch_size", "16", "--train.epochs", "1"]
    assert main(["train", *options]) == 0
    text = (tmp_path / "runs" / experiment_name(load(None, split_overrides(options))) / "metrics.jsonl").read_text()
    assert '"eval_count": 7' in text and '"train_samples": 64' in text


def test_eval_refuses_to_write_predictions_over_another_file(tmp_path, capsys):
    from dptrain import snapshots

    run_dir = tmp_path / "run"
    snapshot = run_dir / "checkpoints" / "step-00000001"
    snapshot.mkdir(parents=True)
    (run_dir / "config.toml").write_text('[data]\nname = "synthetic"\n')
    precious = run_dir / "config.toml"
    (snapshot / snapshots.MANIFEST).write_text('{"world_size": 1, "strategy": "single", "model": "mnist-cnn", '
                                                 '"config_hash": "x", "step": 1, "files": {}}')
    assert main(["eval", "--checkpoint", str(run_dir), "--predictions", str(precious)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --predictions {precious} exists and is not a predictions "
                                               f"file; choose another path.")
    assert precious.read_text() == '[data]\nname = "synthetic"\n'


@pytest.mark.parametrize(("version", "on_cpu", "refused"), [("2.6.0+cu124", True, True), ("2.6.0", False, False),
                                                            ("2.7.0", True, False), ("2.13.0+cpu", True, False)])
def test_fsdp_on_the_cpu_is_refused_where_torch_cannot_run_it(version, on_cpu, refused):
    from dptrain import config
    from dptrain.strategies.registry import check_world

    cfg = config.load(None, [("strategy.name", "fsdp")])
    if not refused:
        check_world(cfg, 1, 1000, on_cpu, version)  # one process, 1000 samples: only the torch version can refuse
        return
    with pytest.raises(ConfigError) as error:
        check_world(cfg, 1, 1000, on_cpu, version)  # one process, 1000 samples: only the torch version can refuse
    assert str(error.value) == (f"strategy fsdp on the CPU needs torch 2.7 or newer, and this is torch {version}; "
                                f"use --strategy.name ddp or zero1, or upgrade torch.")


def _shown(value) -> str:
    """A default as --help shows it: the text one would type after --section.option."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    if value == ():  # an empty list of lines
        return "[]"
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize("command", ["train", "config"])
def test_help_lists_every_option_of_every_section_with_its_default_and_docstring(capsys, command):
    import dataclasses
    import typing

    from dptrain import config
    from dptrain.config import RunConfig

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    flat = " ".join(out.split())
    def options(prefix: str, cls: type):
        """(--key, field, the class's docstrings) of every option of cls, a strategy's table ([strategy.ddp]) walked
        into: the table itself is no option."""
        docs = config.field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from options(f"{prefix}.{f.name}", hints[f.name])
            else:
                yield f"{prefix}.{f.name}", f, docs

    for section, cls in typing.get_type_hints(RunConfig).items():
        assert f"[{section}] options:" in lines
        for key, f, docs in options(section, cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            shown = f.metadata.get("shown_default", _shown(default))  # output.name: made from the experiment
            [line] = [line for line in lines if line.startswith(f"--{key} ")]
            assert line.endswith(f"(default: {shown})"), line
            assert docs.get(f.name, "").strip(), f"{key} has no docstring: --help cannot document it"
            assert " ".join(docs[f.name].split()) in flat


def test_config_prints_toml_that_loads_back_to_the_same_config(capsys, tmp_path, monkeypatch):
    import dataclasses

    from dptrain import config

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.toml"
    base.write_text('[optim]\nname = "sgd"\nlr = 0.1\n[train]\nepochs = 3\n')
    argv = ["--config", str(base), "--optim.lr", "3e-4", "--train.bf16=true", "--data.synthetic_shape", "3,32,32",
            "--train.grad_clip", "1.5", "--data.root", 'a "quoted" folder', "--nproc-per-node", "2",
            "--data.name", "synthetic", "--model.name", "cifar-cnn"]  # config checks the data and the model, as train
    assert main(["config", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(captured.out)
    cfg = config.load(resolved)
    given = config.load(base, [("optim.lr", "3e-4"), ("train.bf16", "true"), ("data.synthetic_shape", "3,32,32"),
                               ("train.grad_clip", "1.5"), ("data.root", 'a "quoted" folder'),
                               ("launch.nproc_per_node", "2"), ("data.name", "synthetic"), ("model.name", "cifar-cnn")])
    # and the run's name, which none of them gave: made from the experiment, as train names its folder
    assert cfg == dataclasses.replace(given, output=dataclasses.replace(given.output, name=config.experiment_name(given)))
    assert (cfg.optim.name, cfg.optim.lr, cfg.train.epochs, cfg.launch.nproc_per_node) == ("sgd", 3e-4, 3, 2)
    assert main(["config", "--config", str(resolved)]) == 0
    assert capsys.readouterr().out == captured.out  # a fixed point
    assert not (tmp_path / "runs").exists()  # it starts nothing


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim.lr", "1e400"], "optim.lr = 1e400 (it reads as inf) is not a finite number; give a finite value."),
        (["--optim.zzz", "1"], "unknown option optim.zzz; valid options in [optim] are: name, lr, momentum, weight_decay, betas, eps, "
                               "schedule, step_epochs, gamma, warmup_steps, scale_lr_with, reference_batch_size."),
        (["--launch.device=tpu"], "launch.device = 'tpu' is not one of auto, cpu, cuda; pick one of them."),
        (["--config", "absent.toml"], "config file absent.toml does not exist; check the path given to --config."),
    ],
)
def test_config_errors_are_one_sentence(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["config", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"dptrain: error: {message}\n"


PLANNED = ["--data.name", "synthetic", "--data.synthetic_train_size", "256"]


@pytest.mark.parametrize("argv", [
    ["--batch_size", "16", "--nproc_per_node", "2"],  # config printed global_batch_size = 128, train ran 32
    ["--batch-size", "8", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"],
    ["--epochs", "3", "--lr", "0.01", "--train.global_batch_size", "64", "--nproc-per-node", "2"],
    ["--batch_size", "16", "--nproc_per_node", "2", "--train.global_batch_size", "64"],  # config said 0, train refused
    ["--nproc-per-node", "3"],  # 128 is not divisible by 3
    ["--train.global_batch_size", "512"],  # larger than the split
    ["--optim.lr", "1e308"],
    ["--gpus", "2"],
])
def test_config_prints_what_train_runs_and_refuses_what_train_refuses(capsys, tmp_path, monkeypatch, argv):
    from dptrain import config, dry_run

    monkeypatch.chdir(tmp_path)
    planned = []
    monkeypatch.setattr(dry_run, "dry_run", lambda cfg, *rest: planned.append(cfg) or "")
    trained = main(["train", "--dry-run", *PLANNED, *argv])
    train_out, train_err = capsys.readouterr()
    code = main(["config", *PLANNED, *argv])
    out, err = capsys.readouterr()
    assert (code, err) == (trained, train_err)
    if trained:
        assert code == 2 and out == "" and err.splitlines()[-1].startswith("dptrain: error: ")
        return
    comment, toml = out.split("\n", 1)  # how the batch is shared out, then the configuration
    assert comment.startswith("# batches: global ") and " per rank, at world size " in comment, comment
    assert toml == config.to_toml(planned[0])  # train's configuration, which its workers get and its config.toml holds
    assert not (tmp_path / "runs").exists()


def test_config_prints_the_global_batch_of_the_tutorials_batch_per_process(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", *PLANNED, "--batch_size", "16", "--nproc_per_node", "2"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size = 32\n" in out and "batch_size_per_rank = 16\n" in out


def test_config_shows_the_micro_batches_of_accumulation_and_the_tutorials_spelling_of_it(capsys, tmp_path, monkeypatch):
    """Lightning's --accumulate_grad_batches is train.accumulate_steps; the per-rank batch is a micro-batch then."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", *PLANNED, "--batch_size", "16", "--accumulate_grad_batches", "4", "--nproc_per_node", "2"]) == 0
    out, err = capsys.readouterr()
    assert "--accumulate_grad_batches is read as --train.accumulate_steps" in err
    assert out.startswith("# batches: global 128 = 64 per rank = 4 micro-batches of 16 (train.accumulate_steps), at "
                          "world size 2\n"), out
    assert "global_batch_size = 128\n" in out and "accumulate_steps = 4\n" in out


@pytest.mark.slow
def test_output_into_a_pipe_that_is_closed_ends_without_a_traceback(tmp_path):
    # `dptrain train --dry-run | head -3` ended with a BrokenPipeError traceback once head had gone.
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    reader_gone = subprocess.Popen([sys.executable, "-m", "dptrain", "config", "--data.name", "synthetic"],
                                   cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    reader_gone.stdout.close()  # the reader leaves before dptrain writes a line
    err = reader_gone.stderr.read().decode()
    assert reader_gone.wait(timeout=60) == 1
    assert err == ""
