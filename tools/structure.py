"""How well the source tree keeps its architecture: ``python tools/structure.py [SRC]``.

Prints about ``src/isthmus`` (or SRC):

* **back-arrows**: imports that point up the layers of docs/ARCHITECTURE.md (a lower folder
  importing a higher one), lazy imports inside functions included;
* **folder cycles**: top-level folders that import each other (directly or through others);
* **file cycles**: modules of one top-level folder that import each other at module level,
  imports under ``if TYPE_CHECKING:`` included (a cycle hidden from the interpreter is still two
  modules that cannot be read, or moved, one without the other); lazy imports inside functions
  are not counted;
* **impure math**: a strategy's pure math module (``math.py``, ``*_math.py`` or any module of a
  ``math/`` package) that imports ``isthmus.comm`` or ``torch.distributed``, at any depth;
* **long files**: modules over 600 lines (usually two things in one file), and how many are over
  500.

and, when the ``duplicates`` tool is on the PATH, how many pairs of repeated code it finds. Exit
status 1 if there is any back-arrow, cycle or impure math module. ``tests/unit/test_structure.py``
runs the same checks in the suite.
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
    "renamed": 0,
    "version": 0,
    "extras": 0,
    "models": 0,
    "data": 0,
    "mesh": 0,
    "coordinator": 1,
    "comm": 2,
    "testing": 3,
    "reduce": 3,
    "checkpoint": 4,
    "strategies": 5,
    "runconfig": 5,
    "lab": 6,
    "integrations": 6,
    "run": 7,
    "cli": 8,
}
"""Layer of each top-level module or folder of the package (see docs/ARCHITECTURE.md)."""

EXEMPT = {"__init__"}
"""The package's ``__init__`` re-exports the public API from every layer."""

MAX_LINES = 600
"""The cap: a module over it is reported as two things in one file."""

WARN_LINES = 500
"""Modules over this many lines are counted (not failed): the ones to watch."""

IMPURE = ("isthmus.comm", "torch.distributed")
"""What a pure math module must not import (itself or any submodule of it)."""


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


def _module_name(path: Path, src: Path) -> str:
    """``isthmus.a.b`` for ``src/a/b.py``, ``isthmus.a`` for ``src/a/__init__.py``."""
    parts = [src.name, *path.relative_to(src).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported, or named for type checking: those at
    module level and inside module-level ``if`` (``if TYPE_CHECKING:`` included), ``try`` and
    ``with`` blocks; never those inside a function or class body."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If):
            todo.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for h in node.handlers:
                todo.extend(h.body)
        elif isinstance(node, ast.With):
            todo.extend(node.body)
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> set[str]:
    """The package's own modules an import statement names (``from a import b`` names module
    ``a.b`` when that is a module, else ``a``)."""
    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                out.add(alias.name)
        return out
    base = _absolute(node, module, is_package)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif base in known:
            out.add(base)
    return out


def file_cycles(src: Path) -> list[list[str]]:
    """Groups of modules (``isthmus.a.b``) of the same top-level folder that import each other at
    module level, ``if TYPE_CHECKING:`` blocks included. Edges between folders are left to the
    folder check; importing a package's submodule is not counted as importing the package's
    ``__init__`` (only an import that names the package itself is)."""
    files = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        unit = module.split(".")[1] if "." in module else ""
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _top_level_imports(tree):
            for target in _targets(node, module, path.name == "__init__.py", known):
                if target != module and target.split(".")[1:2] == [unit]:
                    graph[module].add(target)
    return sorted(_cycles(graph))


def is_pure_math(path: Path) -> bool:
    """A strategy's pure math, by name: ``math.py``, ``*_math.py`` or a module of ``math/``."""
    return path.name == "math.py" or path.stem.endswith("_math") or "math" in path.parent.parts


def impure_math(src: Path) -> list[str]:
    """``file:line: module -> import`` for every import of :data:`IMPURE` (or a submodule of it)
    in a pure math module, lazy imports inside functions included."""
    out: list[str] = []
    for path in sorted(src.rglob("*.py")):
        if not is_pure_math(path.relative_to(src.parent)):
            continue
        module = _module_name(path, src)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                if any(n == bad or n.startswith(bad + ".") for bad in IMPURE):
                    out.append(f"{path.relative_to(src.parent)}:{node.lineno}: {module} -> {n}")
                    break
    return out


def line_counts(src: Path) -> dict[str, int]:
    """Lines of every module, by path relative to the package's parent."""
    return {
        str(p.relative_to(src.parent)): len(p.read_text().splitlines())
        for p in sorted(src.rglob("*.py"))
    }


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src" / "isthmus"
    back, cycles, long = check(src)
    fcycles = file_cycles(src)
    impure = impure_math(src)
    over_warn = {k: n for k, n in line_counts(src).items() if n > WARN_LINES}
    print(f"back-arrows: {len(back)}")
    for b in back:
        print(f"  {b}")
    print(f"folder cycles: {len(cycles)}")
    for c in cycles:
        print(f"  {' <-> '.join(c)}")
    print(f"file cycles: {len(fcycles)}")
    for c in fcycles:
        print(f"  {' <-> '.join(c)}")
    print(f"impure math modules: {len(impure)}")
    for i in impure:
        print(f"  {i}")
    print(f"files over {MAX_LINES} lines: {len(long)}")
    for name, n in long:
        print(f"  {name}: {n}")
    print(f"files over {WARN_LINES} lines: {len(over_warn)}")
    for name, n in over_warn.items():
        print(f"  {name}: {n}")
    if shutil.which("duplicates"):
        out = subprocess.run(
            ["duplicates", "--repo", str(src), "--most", "1", "--seconds", "60"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.splitlines()
        print(f"duplicates: {out[0] if out else 'n/a'}")
    return 1 if back or cycles or fcycles or impure else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
