"""Every Python that pyproject.toml claims, read statically: the source parses as the oldest claimed version's
grammar, and imports no standard module that the claimed versions lack, unless guarded (a `try` that catches
ImportError, or an `if sys.version_info ...`). An unconditional `import tomllib` (3.11 and later) broke every
`dptrain train` on Python 3.10 while pyproject claimed it; this is the check that would have caught it.

scripts/python-versions runs the real thing (a dry run and a tiny run on each claimed version installed here); it
needs a torch for each, several GB, so it is not part of the suite."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted((REPO / "src").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))

# Standard modules by the version that added them, and by the version that removed them (the ones a codebase like
# this one might reach for; see "What's New" of each release).
ADDED = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}
REMOVED = {"distutils": (3, 12), "imp": (3, 12), "asynchat": (3, 12), "asyncore": (3, 12), "smtpd": (3, 12),
           "cgi": (3, 13), "cgitb": (3, 13), "crypt": (3, 13), "imghdr": (3, 13), "mailcap": (3, 13),
           "nntplib": (3, 13), "pipes": (3, 13), "sndhdr": (3, 13), "spwd": (3, 13), "sunau": (3, 13),
           "telnetlib": (3, 13), "uu": (3, 13), "xdrlib": (3, 13), "audioop": (3, 13), "aifc": (3, 13),
           "chunk": (3, 13), "msilib": (3, 13), "nis": (3, 13), "ossaudiodev": (3, 13), "lib2to3": (3, 13)}
NEWEST_KNOWN = (3, 13)  # the newest version this table was written for


def claimed() -> tuple[int, int]:
    """The oldest Python pyproject.toml claims (requires-python = ">=3.X")."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert match, f"requires-python {spec!r} is not of the form >=3.X, which this check reads"
    return 3, int(match.group(1))


def guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a try that catches ImportError (or ModuleNotFoundError, or any exception), or an if on
    sys.version_info."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(handler.type is None or any(
                name in ast.unparse(handler.type) for name in ("ImportError", "ModuleNotFoundError", "Exception"))
                for handler in node.handlers):
            return True
        if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
            return True
    return False


def unguarded_imports(tree: ast.AST) -> list[tuple[int, str]]:
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        for name in names:
            if not guarded(node, parents):
                found.append((node.lineno, name))
    return found


def test_pyproject_claims_a_version_this_check_knows():
    oldest = claimed()
    assert (3, 10) <= oldest <= NEWEST_KNOWN, oldest


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_source_parses_and_imports_as_every_claimed_python_would(path):
    oldest = claimed()
    source = path.read_text()
    tree = ast.parse(source, filename=str(path), feature_version=oldest)  # a newer grammar is a SyntaxError here
    for line, name in unguarded_imports(tree):
        top = name.split(".")[0]
        added = ADDED.get(name) or ADDED.get(top)
        assert added is None or added <= oldest, (
            f"{path.relative_to(REPO)}:{line} imports {name}, which Python before {added[0]}.{added[1]} lacks, while "
            f"pyproject claims {oldest[0]}.{oldest[1]}: guard it (try/except ImportError) or claim a newer Python")
        removed = REMOVED.get(name) or REMOVED.get(top)
        assert removed is None, (f"{path.relative_to(REPO)}:{line} imports {name}, which Python {removed[0]}."
                                 f"{removed[1]} removed, while pyproject claims every version from "
                                 f"{oldest[0]}.{oldest[1]} on")


def test_the_check_catches_an_unguarded_import_and_passes_a_guarded_one():
    bare = ast.parse("import tomllib\n")
    assert unguarded_imports(bare) == [(1, "tomllib")]
    for guarded_source in ("try:\n    import tomllib\nexcept ImportError:\n    import tomli as tomllib\n",
                           "import sys\nif sys.version_info >= (3, 11):\n    import tomllib\n"):
        assert (1, "tomllib") not in unguarded_imports(ast.parse(guarded_source))
        assert all(name != "tomllib" for _, name in unguarded_imports(ast.parse(guarded_source)))
