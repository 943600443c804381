"""dptrain's import layers are kept by a contract, and no import circle hides anywhere.

The layers are declared once, in pyproject.toml's [tool.importlinter] section, and checked here
with import-linter (lint-imports). Lazy imports inside functions count like any other: grimp, the
graph builder under import-linter, reads every import statement in a module's source.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _graph() -> grimp.ImportGraph:
    # cache_dir=None: build from the source as it is now, and leave no cache in the work tree.
    return grimp.build_graph("dptrain", include_external_packages=False, cache_dir=None)


def test_import_layers_contract_is_kept():
    proc = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", "--no-logo", "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    report = proc.stdout + proc.stderr
    if proc.returncode != 0 or "0 broken" not in report:
        pytest.fail(f"lint-imports: the layers contract in pyproject.toml is broken:\n{report}", pytrace=False)


def _where(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    lines = ", ".join(f"line {d['line_number']}: {d['line_contents'].strip()}" for d in details)
    return f"{importer} -> {imported} ({lines or 'line unknown'})"


def test_no_import_cycle_among_dptrain_modules():
    graph = _graph()
    assert "dptrain.train" in graph.modules  # the graph really is dptrain's
    cycles: dict[tuple[str, ...], str] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is None:
                continue
            circle = (importer, *back[:-1])  # back runs from imported to importer
            start = circle.index(min(circle))
            key = circle[start:] + circle[:start]  # the same circle, found from any of its imports
            steps = [*key, key[0]]
            cycles.setdefault(key, "\n  ".join(_where(graph, a, b) for a, b in zip(steps, steps[1:])))
    if cycles:
        pytest.fail("import cycles in dptrain:\n" + "\n".join(f"- circle:\n  {c}" for c in cycles.values()),
                    pytrace=False)


# Test folders that mirror no package: the test clusters of tests/*_cluster.py (clusters), files the tests read
# (fixtures), the exactness runs across strategies (float64), and the speed scripts of perf/ (perf).
NOT_A_PACKAGE = {"clusters", "fixtures", "float64", "perf"}


def test_the_tests_folders_mirror_the_packages():
    """tests/<package>/ holds the tests of src/dptrain/<package>/ (tests/dptrain_bench/ the lab's): a test folder
    named after no package, or a package with tests spread elsewhere, is where a reader looks in vain."""
    root = Path(__file__).resolve().parents[1]
    packages = {p.parent.name for p in (root / "src" / "dptrain").glob("*/__init__.py")} | {"dptrain_bench"}
    folders = {p.name for p in (root / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    strays = folders - NOT_A_PACKAGE - packages
    assert not strays, f"test folders that mirror no package: {sorted(strays)}"
    # the tests of a package with a folder of tests sit in it, not at tests/'s top
    top = {p.stem.removeprefix("test_") for p in (root / "tests").glob("test_*.py")}
    assert not top & (folders - NOT_A_PACKAGE), sorted(top & folders)
