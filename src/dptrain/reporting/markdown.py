"""Text and figures of the reports dptrain writes (a sweep's report.md, a run's card): a value from a file shown as
plain Markdown, a figure saved as a file."""

from __future__ import annotations

import html
import re
import unicodedata
from pathlib import Path
from typing import Any

from dptrain.files import written_atomically

# What Markdown reads as markup wherever it stands (code, emphasis, links and images, table cells, strikethrough, the
# backslash itself); a backslash before it makes it plain text. <, > and & are left to html.escape.
INLINE_MARKUP = re.compile(r"([\\`*\[\]|~])")
# _ is emphasis only at a word's edge (CommonMark: epoch_time_s holds no emphasis, _x_ does)
EDGE_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")
# markup only at the start of a line: a heading ("# x"), a list item ("- x", "+ x", "1. x", "1) x"), a rule ("---")
LINE_START_MARKUP = re.compile(r"^(\s*)(#{1,6}(?=\s|$)|[-+](?=[\s-]|$)|\d{1,9}(?=[.)](?:\s|$)))")


def md_text(value: Any) -> str:
    """A value from results.csv or a run's files as plain text on one line of report.md.

    Such a value (an error message, a host name) may hold anything; without this, `# x` would start a heading,
    `![x](http://...)` make the viewer fetch a remote image, `<script>` reach a viewer that renders HTML, `|` add a
    table column and a line break end the table. Line breaks and other control characters become spaces; a backslash
    goes before what Markdown reads as markup there (`*`, `[`, `|`, a `_` at a word's edge, a `#` or `-` that starts
    the value), and only there: `fashion-mnist`, `0.001` and `epoch_time_s` read as they are. <, > and & become HTML
    entities."""
    flat = "".join(" " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in str(value))
    marked = EDGE_UNDERSCORE.sub(r"\\_", INLINE_MARKUP.sub(r"\\\1", flat)).replace("\\](", "\\]\\(")  # ](: a link
    start = LINE_START_MARKUP.match(marked)
    if start:  # "1." -> "1\.", "# x" -> "\# x"
        end = start.end()
        marked = (marked[:end] + "\\" + marked[end:] if start.group(2)[0].isdigit() else
                  marked[:start.start(2)] + "\\" + marked[start.start(2):])
    return html.escape(marked, quote=False)


def save_figure(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    with written_atomically(path) as tmp:  # a reader never sees half a PNG, and a link planted at path is replaced
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=110, bbox_inches="tight")  # tight: the legend
    plt.close(fig)
