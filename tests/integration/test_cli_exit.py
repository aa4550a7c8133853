"""A Ctrl-C that ``isthmus`` handled ends the process with 130, whatever code it passed through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# a KeyboardInterrupt raised inside string-compiled code (as in a dataclass or namedtuple
# defined by a module imported mid-run) and caught by the caller
SCRIPT = """
import sys
from isthmus.cli import forget_handled_interrupt
try:
    exec("raise KeyboardInterrupt")
except KeyboardInterrupt:
    pass
if sys.argv[1] == "forget":
    forget_handled_interrupt()
sys.exit(130)
"""


def _status(tmp_path: Path, mode: str) -> int:
    # run with -m, as ``python -m isthmus.cli`` is: the module's SystemExit returns to the
    # interpreter's main, which looks at the mark (a script file's exits without looking)
    (tmp_path / "interrupted.py").write_text(SCRIPT)
    argv = [sys.executable, "-m", "interrupted", mode]
    return subprocess.run(argv, cwd=tmp_path, timeout=60).returncode


def test_a_handled_interrupt_exits_130(tmp_path: Path) -> None:
    assert _status(tmp_path, "forget") == 130


def test_without_the_reset_the_interpreter_dies_of_sigint(tmp_path: Path) -> None:
    # the CPython behaviour the reset exists for; if a Python version stops doing this, the
    # reset is harmless and this test says the workaround can go
    assert _status(tmp_path, "keep") == -2
