"""Figures, history and pointers outside the repository in docstrings and comments:
``python tools/docstring_hits.py [SRC]``.

Docstrings state behaviour (docs/DEVELOPING.md): a measured figure goes stale (its home is
docs/BENCHMARKS.md), history ("used to", an issue number) means nothing to a reader of the
tree, and a path outside the repository does not resolve. This prints every line of a docstring
or comment under ``src/isthmus`` (or SRC) that looks like one of them, as ``file:line: text``,
and their count last. A hit is a line to read, not always a defect: a default or a unit
("rates in Mbit/s") is behaviour. Exit status 0 always.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

PATTERN = re.compile(
    r"\d\s?%"  # a percentage
    r"|\b\d+(\.\d+)?x\b|x fewer|times fewer"  # a ratio
    r"|\bmeasured\s*(here|best|on|with|in the lab|:|\()|\b(best|were) measured"
    r"|\d\s?[MG]bit/s|\d\s?s\)|\babout \d+(\.\d+)?\s?s\b"  # a rate or a time
    r"|\b20\d\d-\d\d-\d\d\b|\btorch 2\.\d+"  # a date, a version measured on
    r"|(?<!\")\bissue \d+|shared/|\.\./"  # outside the repository (a quoted section name is in)
    r"|\bused to\b(?! (record|mark|tell|keep|build|carry|compute|decide))"
    r"|\b(previously|formerly|anymore|before this change|our notes)\b"
    r"|\bwas (better|best|worse|faster|slower|picked|chosen)\b",
    re.IGNORECASE,
)


def doc_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every line of the file's docstrings (any string statement) and of every
    comment (the comment alone, not the code before it)."""
    source = path.read_text()
    lines = source.splitlines()
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                out[n] = lines[n - 1]
    return sorted(out.items())


def hits(src: Path) -> list[str]:
    """``file:line: text`` of every docstring or comment line that matches :data:`PATTERN`."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for n, text in doc_lines(path):
            if PATTERN.search(text):
                found.append(f"{path.relative_to(src.parent.parent)}:{n}: {text.strip()}")
    return found


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src" / "isthmus"
    found = hits(src)
    print("\n".join(found))
    print(f"{len(found)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
