"""How well the source tree keeps its architecture: ``python tools/structure.py [SRC]``.

Prints three things about ``src/isthmus`` (or SRC):

* **back-arrows**: imports that point up the layers of docs/ARCHITECTURE.md (a lower folder
  importing a higher one), lazy imports inside functions included;
* **cycles**: folders that import each other (directly or through others);
* **long files**: modules over 600 lines (usually two things in one file).

and, when the ``duplicates`` tool is on the PATH, how many pairs of repeated code it finds. Exit
status 1 if there is any back-arrow or cycle. ``tests/unit/test_structure.py`` runs the same
checks in the suite.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

LAYERS: dict[str, int] = {
    # lowest first: a module may import its own layer and those below it
    "spec": 0,
    "settings": 0,
    "version": 0,
    "models": 0,
    "data": 0,
    "coordinator": 1,
    "comm": 2,
    "testing": 3,
    "reduce": 3,
    "checkpoint": 4,
    "strategies": 5,
    "runconfig": 5,
    "lab": 6,
    "run": 7,
    "cli": 8,
}
"""Layer of each top-level module or folder of the package (see docs/ARCHITECTURE.md)."""

EXEMPT = {"__init__"}
"""The package's ``__init__`` re-exports the public API from every layer."""

MAX_LINES = 600


def _unit(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported top-level unit) for every ``isthmus.X`` import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "isthmus":
                names = [f"isthmus.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "isthmus" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def check(src: Path) -> tuple[list[str], list[list[str]], list[tuple[str, int]]]:
    """(back-arrows, cycles, long files) of the package at ``src``."""
    back: list[str] = []
    graph: dict[str, set[str]] = defaultdict(set)
    long: list[tuple[str, int]] = []
    for path in sorted(src.rglob("*.py")):
        unit = _unit(path, src)
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append((str(path.relative_to(src.parent)), n))
        if unit in EXEMPT:
            continue
        mine = LAYERS.get(unit)
        for line, other in _imports(path):
            if other == unit:
                continue
            graph[unit].add(other)
            theirs = LAYERS.get(other)
            if mine is None or theirs is None:
                back.append(f"{path.relative_to(src.parent)}:{line}: {unit} -> {other} (no layer)")
            elif theirs > mine:
                back.append(f"{path.relative_to(src.parent)}:{line}: {unit} -> {other}")
    return back, _cycles(graph), long


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src" / "isthmus"
    back, cycles, long = check(src)
    print(f"back-arrows: {len(back)}")
    for b in back:
        print(f"  {b}")
    print(f"folder cycles: {len(cycles)}")
    for c in cycles:
        print(f"  {' <-> '.join(c)}")
    print(f"files over {MAX_LINES} lines: {len(long)}")
    for name, n in long:
        print(f"  {name}: {n}")
    if shutil.which("duplicates"):
        out = subprocess.run(
            ["duplicates", "--repo", str(src), "--most", "1", "--seconds", "60"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
        print(f"duplicates: {out[0] if out else 'n/a'}")
    return 1 if back or cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
