"""The coordinator's rooms keep their walls: no module reaches into another object's private
members, no two of its modules import each other (type-checking imports included), and it
imports no other isthmus package but the floor's. Read from the source with ``ast``; nothing is
imported."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import isthmus

ROOT = Path(isthmus.__file__).parent / "coordinator"
PACKAGE = "isthmus.coordinator"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        out[".".join([PACKAGE, *parts])] = path
    return out


def private_reaches(tree: ast.AST) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``, and ``getattr(x, "_name")``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).endswith("__")
        ):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m == "isthmus" or m.startswith("isthmus.")}


def test_no_module_reaches_into_another_objects_private_members():
    bad = {}
    for name, path in modules().items():
        found = private_reaches(ast.parse(path.read_text()))
        if found:
            bad[name] = found
    assert not bad, bad


def test_no_two_coordinator_modules_import_each_other():
    mods = modules()
    edges = {
        m: {i for i in imports(ast.parse(p.read_text())) if i in mods and i != m}
        for m, p in mods.items()
    }

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                if nxt == b:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    cycles = sorted(m for m in mods if reaches(m, m))
    assert not cycles, f"modules in an import cycle: {cycles}"


def _floor() -> set[str]:
    """The units below the coordinator's layer in tools/structure.py (spec, settings, ...)."""
    path = Path(__file__).resolve().parents[2] / "tools" / "structure.py"
    spec = importlib.util.spec_from_file_location("structure", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {unit for unit, layer in mod.LAYERS.items() if layer < mod.LAYERS["coordinator"]}


def test_the_coordinator_imports_only_the_floor():
    floor = {f"isthmus.{unit}" for unit in _floor()}
    outside = {
        name: sorted(
            i
            for i in imports(ast.parse(path.read_text()))
            if not i.startswith(PACKAGE) and ".".join(i.split(".")[:2]) not in floor
        )
        for name, path in modules().items()
    }
    assert not {k: v for k, v in outside.items() if v}


def test_the_checks_see_what_they_look_for():
    tree = ast.parse("self._ok\nother._bad\ngetattr(x, '_hidden')\nx.__class__\n")
    assert private_reaches(tree) == ["other._bad (line 2)", "getattr(x, '_hidden') (line 3)"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import isthmus.comm\n"
    )
    assert imports(tree) == {"isthmus.comm"}
