"""scripts/torchvision-for (what `scripts/setup.sh --torchvision` runs): the torchvision release that matches a torch,
as a pure function; the refusal where the package index has none for this torch build (the CPU wheel of
constraints.txt: PyPI's torchvision 0.28.0 installs beside it, then fails to import with `operator torchvision::nms
does not exist`); and, for real, pip in a fresh venv installing from a folder of small stand-in wheels: the match kept,
one that does not import uninstalled again, torch never replaced.

What is not tested here: an install of a real torchvision from the package index. The pairs that import here are a
CUDA build of torch of several GB on x86_64 (torch 2.14.1 with torchvision 0.29.1) or an aarch64 machine (torch
2.9.1 with 0.24.1), neither of which this suite can afford or has.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "torchvision-for"


@functools.cache
def script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("torchvision_for", str(SCRIPT))  # scripts/ is no package
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclass looks its module up there
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("torch, torchvision", [("2.6.0", "0.21.0"), ("2.7.1", "0.22.1"), ("2.9.1", "0.24.1"),
                                                ("2.13.0", "0.28.0"), ("2.14.1", "0.29.1")])
def test_a_torch_release_of_the_index_gets_the_torchvision_released_with_it(torch, torchvision):
    assert script().plan_for(torch) == script().Plan(f"torchvision=={torchvision}")


def test_a_torch_of_another_build_gets_one_sentence_of_what_to_do_instead():
    plan = script().plan_for("2.13.0+cpu")  # constraints.txt's CPU wheel
    assert plan.torchvision is None
    assert plan.why == ("the package index's torchvision 0.28.0 is built for its own torch 2.13.0, not for this cpu "
                        "build of it (2.13.0+cpu), beside which it fails to import; install torchvision==0.28.0+cpu "
                        "from the index this torch came from, or a torch release and its torchvision together from "
                        "the package index (torchvision 0.N.P is torch 2.(N-15).P's; on Linux x86_64 its torch is a "
                        "CUDA build of several GB), as the README's Train section shows.")
    for version, starts in (("2.5.1", "torch 2.5.1 is older than 2.6"), ("2.15.0.dev20261101", "torch 2.15.0.dev20261101 "
                                                                       "is no release"), ("1.13.1", "torch 1.13.1 is older")):
        plan = script().plan_for(version)
        assert plan.torchvision is None and plan.why.startswith(starts) and plan.why.count(";") == 1


def test_on_this_venv_a_dry_run_says_what_it_would_do_and_installs_nothing():
    from importlib.metadata import PackageNotFoundError, version

    def torchvision() -> str | None:
        try:
            return version("torchvision")
        except PackageNotFoundError:
            return None

    before = torchvision()
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=300)
    plan = script().plan_for(version("torch"))
    if plan.torchvision is None:  # this machine: torch 2.13.0+cpu
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.splitlines() == [f"torchvision-for: {plan.why}"]
    else:
        assert done.returncode == 0 and plan.torchvision in done.stdout, done.stderr
    assert torchvision() == before


# ---- for real: pip in a fresh venv, from a folder of stand-in wheels ----------------------------------------------

def wheel(folder: Path, name: str, version: str, init: str, requires: str | None = None) -> None:
    """A pure-Python wheel of package `name` whose __init__.py is `init` (and which requires `requires`)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": init,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + (f"Requires-Dist: {requires}\n" if requires else ""),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(text.encode())}\n" for path, text in files.items()) + f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in {**files, f"{dist}/RECORD": record}.items():
            archive.writestr(path, text)


@pytest.mark.nightly  # a real pip in a fresh venv; the default run keeps the choice and the refusal above
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pip_installs_the_match_keeps_torch_and_takes_back_one_that_does_not_import(tmp_path):
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # pip without a machine's own caps (torch<=2.14.1 here)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    index = tmp_path / "wheels"
    wheel(index, "torch", "2.99.1", "__version__ = '2.99.1'\n")
    wheel(index, "torch", "2.99.2", "__version__ = '2.99.2'\n")  # newer: what an unheld pip would take
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(index), "torch==2.99.1"],
                   check=True, timeout=300, env=env)

    def run(*folders: Path) -> subprocess.CompletedProcess:
        links = [word for folder in folders for word in ("--find-links", str(folder))]
        return subprocess.run([python, str(SCRIPT), "--", "--no-index", *links], capture_output=True, text=True,
                              timeout=300, env=env)

    def versions() -> str:
        return subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                              check=True, env=env).stdout

    # only a torchvision made for another torch: pip may not replace torch to take it
    wheel(tmp_path / "other", "torchvision", "0.114.1", "", requires="torch==2.99.2")
    done = run(index, tmp_path / "other")
    assert done.returncode == 1 and done.stderr.startswith("torchvision-for: pip could not install "
                                                           "torchvision==0.114.1 beside torch 2.99.1 ("), done.stderr
    assert "torch==2.99.1" in versions() and "torchvision" not in versions()
    # one that installs but does not import, as PyPI's beside a CPU build of torch
    wheel(tmp_path / "broken", "torchvision", "0.114.1",
          "raise RuntimeError('operator torchvision::nms does not exist')\n", requires="torch==2.99.1")
    done = run(index, tmp_path / "broken")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "torchvision-for: torchvision==0.114.1 was installed but does not import beside torch 2.99.1 (RuntimeError: "
        "operator torchvision::nms does not exist), so it was uninstalled again; install torch and torchvision "
        "together from one index."]
    assert "torchvision" not in versions()
    # the match
    wheel(tmp_path / "good", "torchvision", "0.114.1", "import torch\n", requires="torch==2.99.1")
    done = run(index, tmp_path / "good")
    assert done.returncode == 0 and done.stdout == "torchvision-for: installed torchvision==0.114.1 for torch 2.99.1\n"
    assert {"torch==2.99.1", "torchvision==0.114.1"} <= set(versions().split())
    done = run(index, tmp_path / "good")  # again: nothing to do
    assert done.returncode == 0 and "installed for torch 2.99.1 already" in done.stdout
