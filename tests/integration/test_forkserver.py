"""Peers forked from the warm server behave like processes started with ``python``: their own
environment, directory, session and log, the exit status they chose, signals that reach them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.run import forkserver
from isthmus.run.forkserver import ForkedProcess
from isthmus.run.record import LATE_JOINER_EXIT

SCRIPT = """
import atexit, os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"))
print("session", os.getsid(0) == os.getpid())
print("comm", open("/proc/self/comm").read().strip())
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("the script failed")
if mode == "late":
    from isthmus.comm.session_config import RunFinished
    raise RunFinished("peer1.1 cannot join: the run is over")
if mode == "sleep":
    print("sleeping")
    import time
    time.sleep(600)
"""


def start(tmp_path: Path, *args: str, **env: str) -> tuple[forkserver.PeerProcess, Path]:
    script = tmp_path / "peer.py"
    script.write_text(SCRIPT)
    log = tmp_path / f"{args[0]}.log"
    log.write_bytes(b"")
    p = forkserver.popen(
        [sys.executable, str(script), *args],
        env={"PATH": os.environ["PATH"], "PROBE": "yes", **env},
        log_path=log,
        cwd=str(tmp_path),
    )
    return p, log


def test_a_forked_peer_gets_its_argv_env_directory_session_log_and_exit_code(
    tmp_path: Path,
) -> None:
    p, log = start(tmp_path, "exit", "5")
    assert isinstance(p, ForkedProcess), "the fork server was not used"
    assert p.wait(60) == 5 and p.returncode == 5 and p.poll() == 5
    text = log.read_text()
    assert f"argv ['exit', '5'] cwd {tmp_path} env yes" in text
    assert "session True" in text and "to stderr" in text
    assert "comm isthmus:peer" in text  # what top shows for it
    assert "atexit ran" in text  # the interpreter's shutdown work is done, as with python


def test_an_exception_is_printed_and_exits_1(tmp_path: Path) -> None:
    p, log = start(tmp_path, "raise")
    assert p.wait(60) == 1
    text = log.read_text()
    assert "ValueError: the script failed" in text and "Traceback" in text


def test_a_peer_that_came_after_the_run_ended_exits_as_a_late_joiner(tmp_path: Path) -> None:
    # as the built-in job does: the launcher counts it as a late joiner, not as a crash
    p, log = start(tmp_path, "late")
    assert p.wait(60) == LATE_JOINER_EXIT
    text = log.read_text()
    assert "cannot join: the run is over" in text and "Traceback" not in text


def test_signals_reach_the_forked_peer_and_wait_is_bounded(tmp_path: Path) -> None:
    p, log = start(tmp_path, "sleep")
    deadline = time.monotonic() + 60
    while "sleeping" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)  # the launcher signals the peer's process group
    assert p.wait(30) == -signal.SIGKILL


def test_the_switch_starts_peers_from_a_fresh_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(forkserver.SWITCH, "0")
    p, log = start(tmp_path, "exit", "7")
    assert isinstance(p, subprocess.Popen)
    assert p.wait(60) == 7
    assert "session True" in log.read_text()
