"""The core without the optional extras: in a fresh interpreter where every extra's packages fail
to import, every module of the package imports (the command line parses ``demo`` and ``run``),
except the Hugging Face integration, which raises the error naming its extra."""

from __future__ import annotations

import subprocess
import sys

from isthmus.extras import EXTRAS

BLOCK = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked by the test")
        return None
sys.meta_path.insert(0, Block())
import isthmus
from isthmus.cli import build_parser
from isthmus.extras import MissingExtra
build_parser().parse_args(["demo", "--peers", "2"])
build_parser().parse_args(["run", "--peers", "2", "train.py"])
failed = []
for m in pkgutil.walk_packages(isthmus.__path__, "isthmus."):
    if m.name.endswith("__main__"):  # runs the command line
        continue
    try:
        importlib.import_module(m.name)
    except MissingExtra:
        failed.append(m.name)
print(sorted(failed))
"""


def test_the_core_imports_without_any_extra() -> None:
    """Every module of the package imports with every extra's packages missing, except the
    Hugging Face integration, which says which extra it needs."""
    blocked = sorted({p for ps in EXTRAS.values() for p in ps})
    p = subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=blocked)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "['isthmus.integrations.hf']"
