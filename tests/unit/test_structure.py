"""The tree keeps its architecture (docs/ARCHITECTURE.md): imports point down the layers, no two
folders import each other, no module grows past about 600 lines. tools/structure.py prints the
same findings for a person."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_imports_point_downward_and_folders_do_not_import_each_other() -> None:
    back, cycles, _ = _tool().check(ROOT / "src" / "isthmus")
    assert back == [], "imports that point up the layers:\n" + "\n".join(back)
    assert cycles == [], f"folders that import each other: {cycles}"


def test_every_top_level_unit_has_a_layer() -> None:
    tool = _tool()
    units = {p.name.removesuffix(".py") for p in (ROOT / "src" / "isthmus").iterdir()}
    units -= {"__pycache__", "py.typed", *tool.EXEMPT}
    assert units <= set(tool.LAYERS), (
        f"give these a layer in tools/structure.py: {units - set(tool.LAYERS)}"
    )


def test_no_module_is_two_things() -> None:
    _, _, long = _tool().check(ROOT / "src" / "isthmus")
    assert long == [], f"modules over 600 lines (split them): {long}"


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two files named
    alike in tests/unit and tests/integration stop the whole collection on a clean checkout."""
    seen: dict[str, Path] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a basename"
        seen[p.name] = p
