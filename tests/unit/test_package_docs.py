"""Every package's docstring says what it holds and what it must not import, and the "must not"
agrees with the layers tools/structure.py enforces (docs/ARCHITECTURE.md, "Layers")."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "isthmus"
PACKAGES = sorted(p.parent for p in SRC.rglob("__init__.py") if p.parent != SRC)


def _layers() -> dict[str, int]:
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.LAYERS)


def _doc(package: Path) -> str:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc, f"{package.relative_to(SRC.parent)} has no docstring"
    return doc


def _never(doc: str) -> set[str]:
    """The names of the sentence 'Never imports a, b and c.' (empty if there is none)."""
    m = re.search(r"Never\s+imports\s+([^.(:;]*)", doc)
    if m is None:
        return set()
    return {w.strip() for w in re.split(r",|\s+and\s+|\s+or\s+", m.group(1)) if w.strip()}


def test_the_parser_reads_a_list() -> None:
    assert _never("x.\nNever imports a, b and\nc (see).") == {"a", "b", "c"}
    assert _never("Never imports run or cli.") == {"run", "cli"}
    assert _never("Nothing said.") == set()


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(SRC)))
def test_package_docstring_names_what_it_must_not_import(package: Path) -> None:
    doc = _doc(package)
    name = package.relative_to(SRC).as_posix()
    assert len(doc.split()) >= 25, f"{name}: the docstring should say what the package holds"
    layers = _layers()
    mine = layers[package.relative_to(SRC).parts[0]]
    above = {unit for unit, layer in layers.items() if layer > mine}
    if not above:
        assert "no other package imports it" in doc, f"{name}: say that nothing imports it"
        return
    assert _never(doc) == above, (
        f"{name}: its docstring should say 'Never imports {', '.join(sorted(above))}' "
        f"(the units above its layer in tools/structure.py), it says {sorted(_never(doc))}"
    )


def test_package_root_says_it_is_exempt() -> None:
    doc = ast.get_docstring(ast.parse((SRC / "__init__.py").read_text()))
    assert doc and "exempt from the layers" in doc
