"""A snapshot loaded by another interpreter (`dptrain checkpoint verify --python PATH`): another torch, another venv.
probe.py runs there and loads each part; this side says in one sentence why it could not run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError, SnapshotError

PROBE = Path(__file__).with_name("probe.py")
PROBE_TIMEOUT_S = 600  # importing torch and reading every shard of a large snapshot


def interpreter(given: str) -> Path:
    """The interpreter `given` names: a Python executable, or a virtual environment's folder (its bin/python)."""
    path = Path(given).expanduser()
    if path.is_dir():
        path = path / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(f"--python {given} is neither a Python interpreter nor a virtual environment's folder with "
                          f"bin/python; give the path of one (for example .venv-torch26 or /usr/bin/python3).")
    return path


def probe_with(python: Path, snapshot: Path) -> dict[str, Any]:
    """What `python` makes of each part of the (verified) snapshot: {"torch": version, "parts": [[part, status,
    detail]]}; SnapshotError in one sentence where it could not run the probe."""
    try:
        done = subprocess.run([str(python), str(PROBE), str(snapshot.resolve())], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, cwd=snapshot.resolve().parent, env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        raise SnapshotError(f"{python} did not finish loading snapshot {snapshot} within {PROBE_TIMEOUT_S} s; try it "
                            f"on a machine with more memory, or verify it there.") from None
    except OSError as exc:
        raise SnapshotError(f"{python} could not be started ({exc.strerror or exc}); give an interpreter that runs "
                            f"here.") from None
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
        assert isinstance(result.get("parts"), list) and isinstance(result.get("torch"), str)
        return result
    except (IndexError, ValueError, AssertionError, AttributeError):
        said = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise SnapshotError(f"{python} could not load snapshot {snapshot} ({said[-1].strip() if said else f'exit code {done.returncode}'}); "
                            f"give an interpreter with torch installed.") from None
