"""The measurement scripts of perf/ import the names they use from dptrain: a rename in the package that a script
still imports fails here, not on the GPU machine the script was written for (gpu_profile.py imported train.build)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "perf").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_perf_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(script.parent))  # as `python perf/X.py` runs it: its siblings import
    spec = importlib.util.spec_from_file_location(f"perf_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # a dataclass looks its module up there
    spec.loader.exec_module(module)  # the scripts run only under __main__
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
