"""Shared helpers: run the real `dptrain` CLI in a subprocess under a hard timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m dptrain ARGS` with tests/ importable (user models), killed after `timeout` seconds."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dptrain", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def start_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m dptrain ARGS` started in the background (the caller waits, with a timeout)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "dptrain", *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def log_tail(run_dir: Path) -> str:
    """The end of rank 0's log of a run, for a failure message."""
    log = run_dir / "logs" / "rank0.log"
    return log.read_text()[-3000:] if log.is_file() else "(no log: refused before start)"


def read_events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture
def cli(tmp_path: Path):
    def call(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_cli(list(args), tmp_path, timeout, env)

    return call
