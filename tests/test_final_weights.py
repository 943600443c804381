"""The final weights' file: model.pt in the run folder, or where output.weights_dir/weights_file put it (the tutorials'
--model_dir/--model_filename, where their scripts save the model), checked before the run trains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dptrain import config
from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.models import build_model
from dptrain.prestart import check_weights_file

TINY = ["--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "16",
        "--train.global_batch_size", "32", "--train.epochs", "1", "--model.dropout", "false"]


@pytest.mark.slow
def test_the_tutorials_model_dir_and_filename_save_the_final_weights_there_and_the_run_folder_stays(tmp_path, monkeypatch,
                                                                                                  capsys):
    """A tutorial user's second run with another rate (seed 001's `--model_dir saved_models --learning_rate 0.01`):
    --model_dir was the run folder, which resumed; then the one default run folder refused the new rate. Another
    rate is another experiment, in a run folder of its own."""
    from dptrain.cli import split_overrides

    def run_folder(*options: str) -> Path:
        return tmp_path / "runs" / config.experiment_name(config.load(None, split_overrides([*TINY, *options])))

    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--model_dir", "saved_models", "--model_filename", "resnet_distributed.pth"]) == 0
    weights = torch.load(tmp_path / "saved_models" / "resnet_distributed.pth", weights_only=True)
    model = build_model(config.load(None, [("data.name", "synthetic"), ("model.dropout", "false")]).model, (1, 28, 28), 10)
    model.load_state_dict(weights)  # whole: every tensor of the model, none more (strict)
    run = run_folder()
    assert (run / "config.toml").is_file() and (run / "checkpoints").is_dir()  # the run's own folder, as without them
    assert not (run / "model.pt").exists() and not (tmp_path / "saved_models" / "checkpoints").exists()
    assert main(["train", *TINY, "--model_dir", "saved_models", "--learning_rate", "0.01"]) == 0
    assert run_folder("--optim.lr", "0.01") != run and (run_folder("--optim.lr", "0.01") / "config.toml").is_file()
    assert (tmp_path / "saved_models" / "model.pt").is_file()


def test_without_them_the_final_weights_are_model_pt_in_the_run_folder():
    assert config.load(None, []).output.weights == config.load(None, []).output.run_dir / "model.pt"
    given = config.load(None, [("output.dir", "/scratch/a"), ("output.weights_file", "net.pth")]).output
    assert given.weights == given.folder.model == given.run_dir / "net.pth"


@pytest.mark.parametrize("name", ["a/net.pth", "..", "", "net\n.pth"])
def test_a_weights_file_that_is_no_file_name_is_one_sentence(name):
    with pytest.raises(ConfigError) as refused:
        config.load(None, [("output.weights_file", name)])
    assert str(refused.value) == (f"output.weights_file = {name!r} is not a file name; give a name such as model.pt, "
                                  f"and the folder as output.weights_dir.")


def output_to(weights: Path, run_dir: Path | None = None) -> config.OutputConfig:
    """The [output] options that put the final weights at `weights` (the run folder: run_dir, or beside them)."""
    return config.OutputConfig(dir=str(run_dir or weights.parent / "run"), weights_dir=str(weights.parent),
                               weights_file=weights.name)


def test_a_weights_file_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    (tmp_path / "net.pth").mkdir()
    with pytest.raises(ConfigError) as refused:
        check_weights_file(output_to(tmp_path / "net.pth"))
    assert str(refused.value) == (f"the final weights' file {tmp_path / 'net.pth'} is a folder; give another "
                                  f"--output.weights_file, or another --output.weights_dir.")
    (tmp_path / "plain").write_text("")
    with pytest.raises(ConfigError) as refused:
        check_weights_file(output_to(tmp_path / "plain" / "saved" / "model.pt", tmp_path / "run"))
    assert str(refused.value) == (f"the folder of the final weights {tmp_path / 'plain' / 'saved'} cannot be made: "
                                  f"{tmp_path / 'plain'} is a file; give another --output.weights_dir.")
    check_weights_file(output_to(tmp_path / "new" / "deeper" / "model.pt"))  # made by the run
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError) as refused:
            check_weights_file(output_to(locked / "model.pt", tmp_path / "run"))
        assert str(refused.value) == (f"the final weights cannot be written to {locked / 'model.pt'}: {locked} is not "
                                      f"writable for you; give another --output.weights_dir, or fix its permissions.")


@pytest.mark.parametrize("name, what", [("config.toml", "configuration"), ("metrics.jsonl", "metrics"),
                                        ("checkpoints", "snapshots"), ("env.json", "environment record"),
                                        ("logs", "logs"), ("tb", "TensorBoard files"), ("report", "card")])
def test_a_model_filename_naming_a_file_of_the_run_folder_is_refused_and_the_run_keeps_its_files(tmp_path, monkeypatch,
                                                                                                 capsys, name, what):
    """--model_filename config.toml replaced the run's configuration (and metrics.jsonl its metrics) with the weights:
    the run could no longer be evaluated, resumed or carded; checkpoints trained the whole run, then failed its final
    snapshot with a raw [Errno 20]."""
    monkeypatch.chdir(tmp_path)
    run = ["train", *TINY, "--output.dir", "run", "--train.epochs", "2", "--train.max_steps", "2"]
    assert main(run) == 0  # 2 steps of 4: the same command with another file name would go on
    before = {p: p.read_bytes() for p in Path("run").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*run[:-2], "--model_filename", name]) == 2
    assert capsys.readouterr().err.endswith(
        f"\ndptrain: error: output.weights_file {name} would put the final weights in place of {Path('run') / name}, the "
        f"run's {what}; give another --output.weights_file, such as model.pt.\n")
    assert {p: p.read_bytes() for p in Path("run").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("inside", ["checkpoints", "logs", "report/plots"])
def test_a_model_dir_inside_a_folder_of_the_run_is_refused(tmp_path, inside):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        check_weights_file(output_to(run_dir / inside / "model.pt", run_dir))
    own = run_dir / inside.split("/")[0]
    what = {"checkpoints": "snapshots", "logs": "logs", "report": "card"}[own.name]
    assert str(refused.value) == (f"the final weights' file {run_dir / inside / 'model.pt'} lies in {own}, where the run "
                                  f"keeps its {what}; give another --output.weights_dir.")


def test_a_file_of_the_users_is_refused_and_earlier_final_weights_are_replaced(tmp_path, monkeypatch, capsys):
    """`--model_dir md --model_filename existing.txt` replaced the user's file silently, where predict and export
    replace none; earlier final weights (torch.save's), as the same command wrote them, are the run's to replace."""
    monkeypatch.chdir(tmp_path)
    Path("md").mkdir()
    Path("md/existing.txt").write_text("mine")
    os.mkfifo("md/fifo.pt")  # checked without waiting for a writer
    for name in ("existing.txt", "fifo.pt"):
        assert main(["train", *TINY, "--model_dir", "md", "--model_filename", name]) == 2
        assert capsys.readouterr().err.endswith(
            f"\ndptrain: error: the final weights' file {Path('md') / name} already exists and holds no weights that "
            f"torch.save wrote, so the run would destroy it; give another --output.weights_file, or move that file "
            f"away.\n")
    assert Path("md/existing.txt").read_text() == "mine" and not Path("runs").exists()
    torch.save({"weight": torch.zeros(2)}, "md/net.pth")  # an earlier run's final weights
    assert main(["train", *TINY, "--model_dir", "md", "--model_filename", "net.pth"]) == 0
    assert set(torch.load("md/net.pth", weights_only=True)) != {"weight"}


def test_the_dry_run_names_where_the_final_weights_go(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    small = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--dry-run"]
    assert main(["train", *small]) == 0
    assert "checkpoints/, model.pt)" in capsys.readouterr().out
    assert main(["train", *small, "--model_dir", "saved_models", "--model_filename", "cnn.pth"]) == 0
    assert "checkpoints/); the final weights to saved_models/cnn.pth\n" in capsys.readouterr().out
    (tmp_path / "saved_models").mkdir()
    torch.save({"weight": torch.zeros(2)}, tmp_path / "saved_models" / "cnn.pth")  # an earlier run's
    assert main(["train", *small, "--model_dir", "saved_models", "--model_filename", "cnn.pth"]) == 0
    assert ("checkpoints/); the final weights to saved_models/cnn.pth; they replace the earlier final weights there\n"
            in capsys.readouterr().out)


def test_a_diverged_or_complete_run_advises_the_option_that_was_given():
    from dptrain.train import diverged_sentence

    given_dir = config.load(None, [("output.dir", "runs/mine")]).output.elsewhere
    assert given_dir == "another --output.dir"
    assert diverged_sentence(float("nan"), 3, 3, 1, None, given_dir).endswith(
        "and use another --output.dir to start afresh.")
    assert config.load(None, []).output.elsewhere == "another --output.name"
