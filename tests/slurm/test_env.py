"""slurm/env.py is the one place that names SLURM's variables; the rest of dptrain looks them up there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dptrain.slurm.env import SLURM_VARS, in_srun_task, job_port, slurm_count

SRC = Path(__file__).resolve().parents[2] / "src" / "dptrain"
TABLE = SRC / "slurm" / "env.py"


def test_no_module_but_slurm_env_spells_a_slurm_variable():
    # A string that is a variable's name is a lookup (os.environ.get("SLURM_JOB_ID")) or a second table of them:
    # runtime, worker, launch/slurm.py and distributed/env.py each had their own.
    spelled = []
    for path in sorted(SRC.rglob("*.py")):
        if path == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"SLURM_[A-Z_]+", node.value):
                spelled.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value}")
    assert spelled == [], "SLURM variables named outside slurm/env.py (add them to SLURM_VARS):\n" + "\n".join(spelled)


def test_the_table_names_slurm_variables_once_each():
    assert all(name.startswith("SLURM_") for name in SLURM_VARS.values())
    assert len(set(SLURM_VARS.values())) == len(SLURM_VARS)


@pytest.mark.parametrize("value, expected", [("8", 8), ("0", 0), ("", None), ("8(x2)", None), ("-1", None), (None, None)])
def test_a_count_is_a_whole_number_or_none(value, expected):
    environ = {} if value is None else {SLURM_VARS["task_cpus"]: value}
    assert slurm_count("task_cpus", environ) == expected


def test_only_an_srun_task_has_a_slurm_rank():
    task = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert in_srun_task(task)
    assert not in_srun_task({k: v for k, v in task.items() if k != "SLURM_STEP_ID"})  # the batch shell


def test_jobs_get_ports_in_their_span():
    assert job_port("1234") == 21234 and job_port("21234") == 21234 and job_port(None) == 20000
