"""isthmus declares Python >= 3.10: the whole package compiles under 3.10, and its pure modules
run there (torch is not installed for 3.10 on these machines, so modules that need it are only
compiled). Skipped, with the reason, where no Python 3.10 is found."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _python310() -> str | None:
    """A working Python 3.10 (pyenv's shims are skipped unless they run)."""
    pyenv = Path(os.path.expanduser("~/.pyenv/versions"))
    candidates = [str(p) for p in sorted(pyenv.glob("3.10*/bin/python3.10"))]
    candidates.append(shutil.which("python3.10") or "")
    for c in candidates:
        if c and Path(c).exists():
            ok = subprocess.run([c, "--version"], capture_output=True, text=True, check=False)
            if ok.returncode == 0 and ok.stdout.startswith("Python 3.10"):
                return c
    return None


PY310 = _python310()


@pytest.mark.skipif(PY310 is None, reason="no Python 3.10 interpreter on this machine")
def test_the_package_compiles_and_its_pure_modules_run_on_python_310(tmp_path: Path) -> None:
    assert PY310 is not None
    out = subprocess.run(
        [PY310, "-m", "compileall", "-q", str(SRC / "isthmus")],
        capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # spec.py, lab/rates.py (which takes spec's "did you mean") and lab/churn_plan.py import
    # nothing that needs torch; the package's own __init__ does, so a bare module stands in for it
    script = f"""
import importlib.util, sys, types
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod
sys.modules["isthmus"] = types.ModuleType("isthmus")
spec = load("isthmus.spec", {str(SRC / "isthmus" / "spec.py")!r})
import dataclasses, typing
@dataclasses.dataclass(kw_only=True)
class C:
    ratio: float = 0.1
    mode: typing.Literal["a", "b"] = "a"
    n: int | None = None
c = spec.config_from(C, {{"ratio": "0.5", "mode": "B", "n": "none"}})
assert (c.ratio, c.mode, c.n) == (0.5, "b", None), c
rates = load("rates", {str(SRC / "isthmus" / "lab" / "rates.py")!r})
assert rates.parse_rate("100mbit") == 1e8
churn = load("churn", {str(SRC / "isthmus" / "lab" / "churn_plan.py")!r})
assert churn.random_schedule(failures_per_minute=6, seed=1, kind="kill", recover_after_seconds=2.0, min_peers=1, peers=3, duration_s=60)
print("ok")
"""
    run = subprocess.run(
        [PY310, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
