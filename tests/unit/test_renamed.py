"""Old module paths still import, as the very module at the new path, with a DeprecationWarning
naming it; every new path exists and no old one is a file of its own again."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import isthmus  # installs the finder
from isthmus.renamed import RENAMED


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_path_is_the_new_module_with_a_warning(old: str) -> None:
    new = RENAMED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"module {old} is deprecated: import {new}"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    sys.modules.pop(old, None)


def test_no_old_path_is_a_module_of_its_own() -> None:
    root = Path(isthmus.__file__).parent
    for old in RENAMED:
        base = root.joinpath(*old.split(".")[1:])
        assert not base.with_suffix(".py").exists(), f"{old} is a file again: drop it from RENAMED"
        assert not (base / "__init__.py").exists(), f"{old} is a package again: drop it"


def test_an_old_class_is_the_new_class() -> None:
    with pytest.warns(DeprecationWarning):
        from isthmus.comm.config import SessionConfig as Old  # type: ignore[import-not-found]
    from isthmus.comm.session_config import SessionConfig

    assert Old is SessionConfig
