"""`dptrain checkpoint export SNAPSHOT model.pt`: a snapshot's weights, whole whatever the sharding, as the one plain
state_dict file the tutorials save and torch.load(weights_only=True) reads."""

from __future__ import annotations

import pytest
import torch

from dptrain.cli import main
from tests.conftest import run_cli

RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "128", "--data.synthetic_test_size", "32",
       "--train.global_batch_size", "32", "--train.epochs", "1", "--strategy.name", "fsdp", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run of fsdp on 2 workers: its snapshot holds sharded weights."""
    folder = tmp_path_factory.mktemp("export") / "run"
    done = run_cli([*RUN, "--output.dir", str(folder)], folder.parent, timeout=180)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.mark.slow
def test_an_fsdp_snapshot_exports_whole_weights_equal_to_the_runs_model_pt(run_dir, tmp_path, capsys):
    out = tmp_path / "weights.pt"
    assert main(["checkpoint", "export", str(run_dir), str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: 8 tensors of ")
    exported, final = torch.load(out, weights_only=True), torch.load(run_dir / "model.pt", weights_only=True)
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[name], final[name]) for name in final)


@pytest.mark.slow
def test_export_never_replaces_a_file_and_needs_one_to_write(run_dir, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main(["checkpoint", "export", str(run_dir), str(taken)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: {taken} exists; give a new file name for the weights, "
                                               f"or delete it first.")
    assert taken.read_text() == "mine"
    assert main(["checkpoint", "export", str(run_dir)]) == 2
    assert "checkpoint export needs a file to write" in capsys.readouterr().err


@pytest.mark.slow
def test_a_safetensors_file_name_exports_the_whole_weights_as_safetensors(run_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "weights.safetensors"
    assert main(["checkpoint", "export", str(run_dir), str(out)]) == 0
    assert "for safetensors.torch.load_file and load_state_dict" in capsys.readouterr().out
    exported, final = load_file(out), torch.load(run_dir / "model.pt", weights_only=True)  # no unpickling: safetensors
    assert sorted(exported) == sorted(final) and all(torch.equal(exported[name], final[name]) for name in final)
