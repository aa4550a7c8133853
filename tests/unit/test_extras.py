"""Optional extras: one list (isthmus.extras) that pyproject.toml agrees with, a clear error naming
the extra when a part is used without its dependency, and a run's summary published without
matplotlib. (That every core module imports without any extra needs a fresh interpreter:
tests/integration/test_extras_missing.py.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from isthmus.extras import EXTRAS, MissingExtra, install_hint, require
from isthmus.run.builtin_run import publish
from isthmus.run.record import RunDir, Summary

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in reqs}


def test_pyproject_lists_each_extra_as_isthmus_extras_does() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    core = _names(project["dependencies"])
    for extra, packages in EXTRAS.items():
        assert _names(optional[extra]) == set(packages), extra
        assert not core & set(packages), f"{extra}'s packages must not be core dependencies"
        assert set(packages) <= _names(optional["dev"]), f"dev must install the {extra} extra"
    assert install_hint("lab") == "pip install 'isthmus[lab]'"
    with pytest.raises(KeyError, match="no extra 'plots'"):
        install_hint("plots")


def test_plots_without_matplotlib_name_the_lab_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from isthmus.run.report import compare_runs, plot_run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(MissingExtra, match=re.escape("pip install 'isthmus[lab]'")):
        plot_run(tmp_path)
    with pytest.raises(MissingExtra, match="plotting a run needs matplotlib"):
        compare_runs([tmp_path], tmp_path / "cmp")
    with pytest.raises(ImportError, match="needs nosuchmodule"):  # MissingExtra is an ImportError
        require("nosuchmodule", extra="lab", what="this")
    # a run's results are kept, and the user learns why there is no report
    run_dir = RunDir.create(str(tmp_path / "run"), "r")
    publish(Summary(strategy="ddp"), run_dir)
    assert (run_dir.path / "summary.json").is_file()
    assert not (run_dir.path / "report.md").exists()
    assert "isthmus[lab]" in capsys.readouterr().err
