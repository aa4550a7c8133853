"""isthmus as a user installs it: a wheel built with ``python -m build``, installed into a fresh
virtual environment outside the source tree, runs ``isthmus --help``, ``isthmus run --help``
(every run setting's help intact, with no source file to read it from) and a two-peer demo.

The fresh environment reaches the test's own third-party packages (torch and the rest) through a
``.pth`` file rather than installing them again; isthmus itself comes only from the wheel, which
the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None and not (ROOT / "pyproject.toml").exists(),
    reason="needs the source tree",
)


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["ISTHMUS_FORKSERVER"] = "0"  # peers from the installed console script's interpreter
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_wheel_installs_and_runs_outside_the_source_tree(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="python -m build is a dev dependency (make test has it)")
    # build from a copy, so the checkout gets no build/ or egg-info of this test's making
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp_path / "dist"
    b = _run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=src,
        timeout=300,
    )
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    (wheel,) = dist.glob("isthmus-*.whl")

    venv = tmp_path / "venv"
    # no pip of its own (ensurepip is most of a venv's making): this one installs into it
    v = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, timeout=120)
    assert v.returncode == 0, v.stderr
    py = venv / "bin" / "python"
    site = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp_path,
        timeout=60,
    ).stdout.strip()
    # torch and the other dependencies from this interpreter's environment; not its isthmus
    # (an editable install is a .pth of its own there, which a path added this way never reads)
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    i = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert i.returncode == 0, i.stdout + i.stderr

    where = tmp_path / "elsewhere"
    where.mkdir()
    # one interpreter for what needs no console script (each start imports torch again): where
    # isthmus comes from, the dashboard's files it ships, and the command's own help
    probe = (
        "import isthmus; print(isthmus.__file__)\n"
        "from importlib.resources import files\n"
        "print(sorted(p.name for p in (files('isthmus.coordinator.web') / 'static').iterdir()))\n"
        "from isthmus.cli import build_parser; print(build_parser().format_help())\n"
    )
    loc = _run([str(py), "-c", probe], cwd=where, timeout=120)
    assert loc.returncode == 0, loc.stdout + loc.stderr
    file, static, top = loc.stdout.split("\n", 2)
    assert file.startswith(str(venv)), loc.stdout + loc.stderr
    assert "dashboard.js" in static and "index.html" in static, loc.stdout
    assert "demo" in top and "lab" in top, loc.stdout

    # the console script: `isthmus run --help` and a demo
    isthmus = str(venv / "bin" / "isthmus")
    rh = _run([isthmus, "run", "--help"], cwd=where, timeout=120)
    assert rh.returncode == 0, rh.stderr
    # a run setting's help comes from the config's own metadata, not from reading the source
    flat = " ".join(rh.stdout.split())
    assert "--heartbeat-timeout X The coordinator evicts a peer whose heartbeat" in flat, flat
    assert "--no-progress" in flat and "--quiet" in flat, flat

    out = tmp_path / "summary.json"
    d = _run(
        [
            isthmus, "demo", "--peers", "2", "--steps", "20", "--model", "tiny", "--no-progress",
            "--run-dir", str(tmp_path / "run"), "--summary-json", str(out),
        ],
        cwd=where,
        timeout=300,
    )  # fmt: skip
    assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["peers_final"] == 2 and s["parity_failures"] == 0, s
