"""docs/extending.md's strategy, followed literally in a copy of the repository: the page's files written, its one
registry line put in, its commands run (the option reference written, two ranks trained with the new strategy), then
the strategies' and the docs' tests of that copy: a strategy is one folder and one line, and the suite passes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
COPIED = ("src", "tests", "docs", "scripts", "perf", "pyproject.toml", "README.md")


def strategy_section() -> str:
    text = PAGE.read_text()
    return text[text.index("### A strategy\n"):text.index("\n### ", text.index("### A strategy\n") + 1)]


def blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.nightly  # 26 s: a copy of the repository, two ranks trained, its tests run; tests/test_docs.py keeps the
@pytest.mark.timeout(300)  # page's links and commands checked in the default run
def test_the_pages_strategy_is_one_folder_and_one_line_and_trains(tmp_path):
    copy = tmp_path / "repo"
    for name in COPIED:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, copy / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    python = [block for block in blocks(strategy_section(), "python")]
    assert len(python) == 3, "the page shows two files and the registry line"
    for block in python:
        path, _, what = block.split("\n", 1)[0].removeprefix("# ").partition(": ")
        target = copy / path
        if "registry line" in what:  # the line replaces the catalog's FOLDERS line
            line = block.split("\n", 1)[1].strip()
            text = target.read_text()
            assert line.split(" = ")[0] in text
            target.write_text(re.sub(r"^FOLDERS = .*$", line, text, count=1, flags=re.M))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.split("\n", 1)[1])
    env = {**os.environ, "PYTHONPATH": f"{copy / 'src'}{os.pathsep}{copy}", "PYTHONUNBUFFERED": "1"}
    [commands] = blocks(strategy_section(), "bash")
    for line in commands.strip().splitlines():
        argv = shlex.split(line)
        if argv[0] == ".venv/bin/dptrain":  # the copy's dptrain, on small synthetic data, 4 steps
            argv = [sys.executable, "-m", "dptrain", *argv[1:], "--data.name", "synthetic", "--data.synthetic_train_size",
                    "128", "--train.max_steps", "4", "--output.dir", str(tmp_path / "run")]
        elif argv[0] == ".venv/bin/python":
            argv = [sys.executable, *argv[1:]]
        done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{line}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    [start] = [e for e in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if e["event"] == "run_start"]
    assert (start["strategy"], start["world_size"]) == ("ddp_split", 2)
    assert "[strategy.ddp_split]\nbuckets = 3" in (tmp_path / "run" / "config.toml").read_text()
    assert "| `strategy.ddp_split.buckets` | `INT` | `2` | How many buckets" in (copy / "docs" / "configuration.md").read_text()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                            "tests/strategies", "tests/config", "tests/test_docs.py", "tests/test_docs_commands.py"],
                           cwd=copy, env=env, capture_output=True, text=True, timeout=240)
    assert tests.returncode == 0, tests.stdout[-4000:]
