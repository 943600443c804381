"""A test skipped for want of root is counted apart in pytest's summary line, with its reason in a section of its own
(tests/conftest.py): on a runner without root the full-disk, foreign-owner and cluster tests do not vanish among the
ordinary skips."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

TESTS = '''
import pytest

def test_runs():
    pass

def test_a_full_disk():
    pytest.skip("mounting a small tmpfs needs root; this machine's tests run as root")

@pytest.mark.skipif(True, reason="giving a file to another user needs root")
def test_a_foreign_owner():
    pass

def test_skipped_for_another_reason():
    pytest.skip("no GPU here")
'''


@pytest.mark.slow
def test_the_summary_line_counts_the_tests_skipped_without_root(tmp_path):
    hooks = "from tests.conftest import pytest_report_teststatus, pytest_terminal_summary\n"
    (tmp_path / "conftest.py").write_text(hooks)
    (tmp_path / "test_needs_root.py").write_text(TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=60)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[-1].startswith("1 passed, 1 skipped, 2 skipped without root in "), lines[-1]
    section = lines.index(next(line for line in lines if "2 skipped without root: run the suite as root" in line))
    assert sorted(lines[section + 1:section + 3]) == [
        "1 x giving a file to another user needs root",
        "1 x mounting a small tmpfs needs root; this machine's tests run as root"]
