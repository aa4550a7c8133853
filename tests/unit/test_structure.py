"""The tree keeps its architecture (docs/ARCHITECTURE.md): imports point down the layers, no two
folders and no two files import each other, a strategy's pure math never imports the network, no
module grows past about 600 lines. tools/structure.py prints the same findings for a person."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "isthmus"


@functools.cache
def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _check():  # type: ignore[no-untyped-def]
    # every module parsed once for the tests below (read-only results)
    return _tool().check(SRC)


@functools.cache
def _file_cycles() -> list[list[str]]:
    return _tool().file_cycles(SRC)


def test_imports_point_downward_and_folders_do_not_import_each_other() -> None:
    back, cycles, _ = _check()
    assert back == [], "imports that point up the layers:\n" + "\n".join(back)
    assert cycles == [], f"folders that import each other: {cycles}"


def test_no_two_files_import_each_other() -> None:
    cycles = _file_cycles()
    assert cycles == [], f"modules that import each other (TYPE_CHECKING included): {cycles}"


def test_pure_math_imports_neither_comm_nor_torch_distributed() -> None:
    impure = _tool().impure_math(SRC)
    assert impure == [], "pure math modules that import the network:\n" + "\n".join(impure)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "isthmus" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "isthmus"


def test_file_cycles_are_found_behind_type_checking_but_not_in_functions(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "run/__init__.py": "",
            "run/a.py": "from isthmus.run.b import B\n",
            "run/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from isthmus.run import a\n"
            ),
            "run/c.py": "from .d import D\n",
            "run/d.py": "def f():\n    from isthmus.run.c import C\n",
            "lab/__init__.py": "",
            "lab/e.py": "from isthmus.lab import f\n",
            "lab/f.py": "import isthmus.lab.e\n",
        },
    )
    assert _tool().file_cycles(src) == [
        ["isthmus.lab.e", "isthmus.lab.f"],
        ["isthmus.run.a", "isthmus.run.b"],
    ]


def test_impure_math_is_found_by_module_name_and_at_any_depth(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "strategies/__init__.py": "",
            "strategies/x/__init__.py": "",
            "strategies/x/math.py": "import torch.distributed as dist\n",
            "strategies/y_math.py": "def f():\n    from isthmus.comm.group import Group\n",
            "strategies/z/math/__init__.py": "from torch import distributed\n",
            "strategies/z/math/ok.py": "import torch\nfrom isthmus.spec import parse\n",
            "strategies/z/exchange.py": "from isthmus.comm.group import Group\n",
        },
    )
    found = [line.split(":")[0] for line in _tool().impure_math(src)]
    assert found == [
        "isthmus/strategies/x/math.py",
        "isthmus/strategies/y_math.py",
        "isthmus/strategies/z/math/__init__.py",
    ]


def test_every_top_level_unit_has_a_layer() -> None:
    tool = _tool()
    units = {p.name.removesuffix(".py") for p in SRC.iterdir()}
    units -= {"__pycache__", "py.typed", *tool.EXEMPT}
    assert units <= set(tool.LAYERS), (
        f"give these a layer in tools/structure.py: {units - set(tool.LAYERS)}"
    )


def test_no_module_is_two_things() -> None:
    _, _, long = _check()
    assert long == [], f"modules over 600 lines (split them): {long}"


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two files named
    alike in tests/unit and tests/integration stop the whole collection on a clean checkout."""
    seen: dict[str, Path] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a basename"
        seen[p.name] = p
