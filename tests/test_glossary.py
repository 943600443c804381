"""docs/glossary.md and the code keep one word for one thing: every name the page gives in backticks is a name of src/
(or a path of the repository), and no retired word (a line's `Not: ...`) is said in src/, the README or docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "glossary.md"
ENTRY = re.compile(r"^- \*\*(?P<term>[^*]+)\*\*(?P<rest>.*)$")


def entries() -> list[tuple[str, str]]:
    return [(m["term"], m["rest"]) for line in PAGE.read_text().splitlines() if (m := ENTRY.match(line))]


def source_text() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "src").rglob("*.py")))


def names_of(rest: str) -> list[str]:
    """The code names of a line: its backticked words, each an identifier, a dotted name or a path (a `<...>` part, a
    `[...]` table or an option's `--`/dots are left to the words around them)."""
    found = []
    for code in re.findall(r"`([^`]+)`", rest.split(" Not: ")[0]):
        if code.startswith(("[", "--", "runs/", "dptrain ")) or "<" in code:
            continue
        found.append(code)
    return found


def test_the_page_has_its_words():
    terms = [term for term, _ in entries()]
    assert len(terms) >= 25 and len(set(terms)) == len(terms), terms


def test_every_name_the_page_gives_is_a_name_of_the_code():
    source = source_text()
    missing = []
    for term, rest in entries():
        for name in names_of(rest):
            if "/" in name or name.endswith((".py", ".md", ".toml", ".json")):
                path = name if "/" in name else None
                if path is not None and (ROOT / path).exists() or any(ROOT.glob(f"src/**/{Path(name).name}")) \
                        or Path(name).name in source:
                    continue
                missing.append((term, name))
                continue
            last = name.split(".")[-1]
            if not re.search(rf"\b{re.escape(last)}\b", source):
                missing.append((term, name))
    assert not missing, f"names in docs/glossary.md that src/ does not have: {missing}"


def test_no_retired_word_is_said_anywhere():
    retired = [word.strip().rstrip(".") for _, rest in entries() if " Not: " in rest
               for word in rest.split(" Not: ", 1)[1].split(", ")]
    assert retired
    places = [*sorted((ROOT / "src").rglob("*.py")), ROOT / "README.md",
              *(p for p in sorted((ROOT / "docs").glob("*.md")) if p != PAGE)]
    said = [(place.relative_to(ROOT), word) for place in places for word in retired
            if re.search(rf"(?<![\w/.]){re.escape(word)}(?![\w])", place.read_text(), flags=re.IGNORECASE)]
    assert not said, f"retired words still said (docs/glossary.md names the word to use): {said}"
