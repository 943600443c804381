"""Snapshots across torch versions: what the manifest records, the one sentence for a part that another torch wrote
and that does not read the same here, `dptrain checkpoint verify --python` in a second interpreter, and golden
snapshots written by torch 2.6 (dptrain's oldest) resumed under this torch.

tests/fixtures/torch-2.6/<strategy>/ holds, for single, ddp, zero1 and ps, the snapshot of step 8 that torch 2.6.0
(PyPI's CUDA build, run on the CPU) wrote of GOLDEN (1 epoch of 8 steps), and losses.json: the step losses of the
same run trained by torch 2.6.0 for 2 epochs without a stop. They were made with torch 2.6.0 in a second venv:
`dptrain train GOLDEN --strategy.name S --nproc-per-node N --train.epochs 1` (and `--train.epochs 2` for the losses).
fsdp needs torch 2.7 on the CPU and deepspeed was not installed beside 2.6, so neither has one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from tests.conftest import read_events

GOLDEN = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "32",
          "--model.name", "tests.user_code:TinyNet", "--train.global_batch_size", "32", "--train.log_every", "1",
          "--launch.timeout_s", "60"]
FIXTURES = Path(__file__).parent / "fixtures" / "torch-2.6"
WORKERS = {"single": "1", "ddp": "2", "zero1": "2", "ps": "2"}


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """A snapshot of step 8 written by this torch (1 epoch of single, in this process)."""
    run = tmp_path_factory.mktemp("versions") / "run"
    assert main(["train", *GOLDEN, "--strategy.name", "single", "--train.epochs", "1", "--output.dir", str(run)]) == 0
    return run / "checkpoints" / "step-00000008"


def second_interpreter(folder: Path, with_torch: bool = True) -> Path:
    """A real second interpreter: a new virtual environment, which sees this one's packages (torch among them) through
    a .pth file where with_torch; its bin/python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    if with_torch:
        site = next(folder.glob("lib/python*/site-packages"))
        (site / "ours.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return folder / "bin" / "python"


@pytest.mark.slow
def test_the_manifest_records_what_a_loader_needs(snapshot):
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["torch"] == torch.__version__
    assert manifest["dcp"] == {"format": "FileSystemWriter", "version": "1.0.0"}
    assert manifest["optimizer"]["class"] == "Adam"
    assert manifest["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert {"lr", "betas", "eps", "weight_decay"} <= set(manifest["optimizer"]["group_keys"])
    assert manifest["parts"] == {"model and optimizer": {"storage": "DCP shards", "files": []}}


@pytest.mark.slow
def test_a_foreign_manifest_whose_optimizer_state_differs_refuses_the_resume_in_one_sentence(snapshot, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(snapshot, run / "checkpoints" / snapshot.name)
    manifest_path = run / "checkpoints" / snapshot.name / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["torch"] = "2.6.0"
    manifest["optimizer"]["state_keys"] = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]  # as if amsgrad's
    manifest_path.write_text(json.dumps(manifest))
    code = main(["train", *GOLDEN, "--strategy.name", "single", "--train.epochs", "2", "--output.dir", str(run)])
    err = capsys.readouterr().err
    assert code != 0
    said = [line for line in err.splitlines() if line.startswith("dptrain: error:")]
    assert said == [f"dptrain: error: rank 0 failed during resume: snapshot {run / 'checkpoints' / snapshot.name} was written by torch 2.6.0, and torch "
                    f"{torch.__version__} cannot load its optimizer state (Adam) as written (it holds exp_avg, "
                    f"exp_avg_sq, max_exp_avg_sq, step; this torch's keeps exp_avg, exp_avg_sq, step); load it with "
                    f"torch 2.6.0 (dptrain checkpoint verify --python names each part an interpreter reads), or export "
                    f"its weights there and start afresh."], err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_python_loads_every_part_in_a_second_interpreter_and_says_why_one_without_torch_cannot(
        snapshot, tmp_path, capsys):
    python = second_interpreter(tmp_path / "venv2")
    assert main(["checkpoint", "verify", str(snapshot), "--python", str(tmp_path / "venv2")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"under {python} (torch {torch.__version__}):"
    assert [line.split(":")[0].strip() for line in out[2:]] == [".metadata", "DCP shards", "extra.pt", "rank0.pt"]
    assert all(": ok: " in line for line in out[2:]), out
    assert "DCP shards: ok: model: 4 tensors, optim: 12 tensors" in out[3]
    second_interpreter(tmp_path / "bare", with_torch=False)
    assert main(["checkpoint", "verify", str(snapshot), "--python", str(tmp_path / "bare")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dptrain: error: {tmp_path / 'bare' / 'bin' / 'python'} could not load snapshot {snapshot} "
        f"(ModuleNotFoundError: No module named 'torch'); give an interpreter with torch installed.")
    assert main(["checkpoint", "verify", str(snapshot), "--python", str(tmp_path / "nothing")]) == 2
    assert "is neither a Python interpreter nor a virtual environment's folder" in capsys.readouterr().err


def _golden_resume(strategy: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / strategy / "step-00000008", run / "checkpoints" / "step-00000008")
    (run / "checkpoints" / "latest").write_text("step-00000008\n")
    assert main(["checkpoint", "verify", str(run / "checkpoints" / "step-00000008")]) == 0
    code = main(["train", *GOLDEN, "--strategy.name", strategy, "--nproc-per-node", WORKERS[strategy],
                 "--train.epochs", "2", "--output.dir", str(run)])
    assert code == 0
    [start] = read_events(run, "run_start")
    assert start["step"] == 8  # resumed from 2.6's snapshot
    expected = {int(k): v for k, v in json.loads((FIXTURES / strategy / "losses.json").read_text()).items()}
    resumed = {e["step"]: e["loss"] for e in read_events(run, "step")}
    assert sorted(resumed) == list(range(9, 17))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) <= 1e-5, (resumed, expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_snapshot_torch_2_6_wrote_resumes_here_with_its_losses(strategy, tmp_path):
    _golden_resume(strategy, tmp_path)


@pytest.mark.nightly
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero1", "ps"])
def test_a_zero1_or_ps_snapshot_torch_2_6_wrote_resumes_here_with_its_losses(strategy, tmp_path):
    _golden_resume(strategy, tmp_path)


# ---- the other way: this torch's snapshots under torch 2.6, in a second venv (nightly: building it downloads ~3 GB)

OLDEST_TORCH = "2.6.0"
VENV_VAR = "DPTRAIN_TORCH26_VENV"
"""A venv with torch 2.6.0 and dptrain's dependencies to use instead of building one (its folder)."""
CACHED_VENV = Path.home() / ".cache" / "dptrain-tests" / f"venv-torch-{OLDEST_TORCH}"
DEPENDENCIES = ["numpy", "rich", "pillow", "tensorboard", "psutil", "nvidia-ml-py", "matplotlib", "safetensors"]


def _has_torch(python: Path, version: str) -> bool:
    done = subprocess.run([str(python), "-c", "import torch, rich, safetensors; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=300)
    return done.returncode == 0 and done.stdout.strip().split("+")[0] == version


@pytest.fixture(scope="module")
def oldest_torch() -> Path:
    """bin/python of a venv with torch 2.6.0 (PyPI's build, with its nvidia-* packages: it does not import without
    them) and dptrain's dependencies, built once into CACHED_VENV (some 4 minutes and 5.3 GB here) and kept; skipped,
    with pip's reason, where the package index cannot give it."""
    folder = Path(os.environ.get(VENV_VAR) or CACHED_VENV)
    python = folder / "bin" / "python"
    if python.is_file() and _has_torch(python, OLDEST_TORCH):
        return python
    if os.environ.get(VENV_VAR):
        pytest.fail(f"{VENV_VAR}={folder} has no torch {OLDEST_TORCH} with dptrain's dependencies")
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={OLDEST_TORCH}", *DEPENDENCIES],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not _has_torch(python, OLDEST_TORCH):
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and "WARNING" not in line]
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"torch {OLDEST_TORCH} could not be installed into a venv here: {said[-1] if said else done.returncode}")
    return python


def _under(python: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`dptrain ARGV` run by `python`, with this checkout's dptrain and tests (not one installed there)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    return subprocess.run([str(python), "-m", "dptrain", *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env)


@pytest.mark.nightly
@pytest.mark.timeout(2400)
def test_a_snapshot_this_torch_wrote_loads_part_by_part_and_resumes_with_its_losses_under_torch_2_6(
        oldest_torch, snapshot, tmp_path, capsys):
    assert main(["checkpoint", "verify", str(snapshot), "--python", str(oldest_torch)]) == 0
    out = capsys.readouterr().out
    assert f"(torch {OLDEST_TORCH}" in out and out.count(": ok: ") == 5, out  # here, and 4 parts there
    reference = tmp_path / "uninterrupted"
    assert main(["train", *GOLDEN, "--strategy.name", "single", "--train.epochs", "2", "--output.dir", str(reference)]) == 0
    run = tmp_path / "run"
    shutil.copytree(snapshot.parent.parent, run)
    done = _under(oldest_torch, "train", *GOLDEN, "--strategy.name", "single", "--train.epochs", "2", "--output.dir",
                  str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    starts = read_events(run, "run_start")
    assert [s["step"] for s in starts] == [0, 8]  # the 2.13 run, then 2.6's resume from its snapshot
    resumed = {e["step"]: e["loss"] for e in read_events(run, "step") if e["step"] > 8}
    expected = {e["step"]: e["loss"] for e in read_events(reference, "step")}
    assert sorted(resumed) == list(range(9, 17))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) <= 1e-5, (resumed, expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_and_export_take_a_snapshot_torch_2_6_wrote(tmp_path, capsys):
    """eval and export read the model's part only: 2.6's reads the same here (the optimizer's missing hyper-parameter
    is no part of it). The numbers are those torch 2.6's run logged for its evaluation after step 8 (eval_loss
    2.208871006965637, eval_acc 0.21875)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "ddp" / "step-00000008", run / "checkpoints" / "step-00000008")
    shutil.copy(FIXTURES / "ddp" / "config.toml", run / "config.toml")
    assert main(["eval", "--checkpoint", str(run)]) == 0
    assert "step=8 world_size=1 eval_loss=2.20887 eval_acc=0.21875 eval_count=32" in capsys.readouterr().out
    out = tmp_path / "w.safetensors"
    assert main(["checkpoint", "export", str(run / "checkpoints" / "step-00000008"), str(out)]) == 0
    from safetensors.torch import load_file

    assert {k: tuple(v.shape) for k, v in load_file(out).items()} == {
        "net.1.weight": (32, 784), "net.1.bias": (32,), "net.3.weight": (10, 32), "net.3.bias": (10,)}
