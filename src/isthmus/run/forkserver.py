"""Peer processes forked from a warm server instead of started from a fresh interpreter.

A fresh peer process spends seconds of CPU before it trains: importing torch and, on its
optimizer's first call, torch._dynamo (torch's optimizers import it unconditionally). A run that restarts or adds peers pays that on every start, and on a small
machine that hosts several peers the starts compete with the peers that are training.

So peers start the way a zygote starts apps: Python's ``multiprocessing`` fork server imports
torch, torch._dynamo and isthmus's job once, and forks every peer from that warm state, a small
fraction of a fresh start (docs/BENCHMARKS.md, "Peer start-up: forked from the warm server
against fresh interpreters"). The server never runs a tensor operation, starts no thread pool and never touches CUDA,
which is what makes forking it safe (the state a fork must not copy is created lazily, in the
peer). Each peer is a real, separate process: its own pid, its own session (signals go to its
process group, as a fresh process's do), its environment and working directory set from the request, its
output to its log. Its exit status comes back through the server.

What differs from ``python script.py``: modules the server preloaded were imported with the
environment of the process that started the server (one launcher), not the peer's; variables
that torch reads at import time (``OMP_NUM_THREADS`` for instance) therefore come from the
launcher's environment. ``ISTHMUS_FORKSERVER=0`` starts every peer from a fresh interpreter
instead (also the fallback when the server cannot start).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import multiprocessing
import multiprocessing.process
import os
import runpy
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",  # a checkpointer imports it when it is built
    "isthmus.run.job",
]
"""What the server imports before it forks: what every peer needs and is slow to import."""

ENTRY_POINTS = {"isthmus.run.job": "entry"}
"""``python -m MODULE`` commands whose module the server preloaded: running them with runpy
would execute the module a second time as ``__main__`` (a second set of its classes); their
``entry(argv)`` function does what their ``__main__`` block does."""

SWITCH = "ISTHMUS_FORKSERVER"

_lock = threading.Lock()
_broken: str | None = None


class PeerProcess(Protocol):
    """What the launcher needs of a peer's process: ``subprocess.Popen``'s subset."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A peer forked from the server, with the part of ``subprocess.Popen``'s interface the
    launcher and the tests use (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``kill``). ``wait`` raises ``subprocess.TimeoutExpired`` like Popen's."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._proc = proc
        self.args = args
        pid = proc.pid
        assert pid is not None
        self.pid: int = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._proc.exitcode
            if code is not None:
                self._reaped(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._reaped(self._proc.exitcode)
        assert self.returncode is not None
        return self.returncode

    def _reaped(self, code: int) -> None:
        self.returncode = code
        # the server's status pipe for this child is an open descriptor until closed: a long run
        # that restarts peers thousands of times must not keep one per past process
        with contextlib.suppress(ValueError):
            self._proc.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)


def enabled() -> bool:
    """False when ``ISTHMUS_FORKSERVER=0`` or the server failed to start before."""
    return os.environ.get(SWITCH, "1") != "0" and _broken is None


def popen(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    log_path: str | os.PathLike[str],
    cwd: str | None = None,
) -> PeerProcess:
    """Start ``argv`` (``[python, -m, MODULE, ...]`` or ``[python, SCRIPT, ...]``) as a peer in
    a session of its own, ``env`` as its whole environment, stdout and stderr appended to
    ``log_path``. Forked from the warm server when :func:`enabled`; a fresh interpreter when it
    is not, when ``argv`` is not a Python command of this interpreter, or when the server cannot
    start (logged once, then every later peer starts fresh)."""
    global _broken
    args = list(argv)
    cwd = cwd or os.getcwd()
    if enabled() and _forkable(args):
        try:
            with _lock:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(PRELOAD)
                proc = ctx.Process(
                    target=_child, args=(args, dict(env), os.fspath(log_path), cwd), daemon=False
                )
                proc.start()
            # multiprocessing joins its non-daemon children at interpreter exit: a peer the
            # launcher left (it never should) must not hold the launcher's exit, as a Popen
            # child would not
            multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]
            return ForkedProcess(proc, args)
        except Exception as e:  # any failure of the server: peers start fresh
            _broken = f"{type(e).__name__}: {e}"
            log.warning("fork server unavailable (%s): peers start from a fresh interpreter", e)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def _forkable(argv: list[str]) -> bool:
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return not argv[1].startswith("-")


def _uncaught(e: BaseException) -> int:
    """The exit status for an exception that ended the program: the interpreter's (print it,
    1), except for a peer whose run was over before it could join, as the built-in job's."""
    from isthmus.comm.session_config import RunFinished
    from isthmus.run.record import LATE_JOINER_EXIT

    if isinstance(e, RunFinished):
        print(f"{e}", file=sys.stderr)
        return LATE_JOINER_EXIT
    traceback.print_exc()
    return 1


def _child(argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """Runs in the forked peer: become what ``argv`` would have started, then exit."""
    os.setsid()  # its own process group: the launcher signals the group, Ctrl-C does not reach it
    # every forked peer shows the server's command line in ps; top and ps -o comm show this name
    what = argv[-1] if argv[1] == "-m" else argv[1]  # the job's file (peer0.job.json), a script
    name = env.get("ISTHMUS_NAME") or Path(what).name.split(".")[0]
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"isthmus:{name}"[:15])
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # unbuffered like PYTHONUNBUFFERED: a killed peer's last lines are what a log is read for
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    code: Any = 0
    try:
        if argv[1] == "-m":
            module, rest = argv[2], argv[3:]
            entry = ENTRY_POINTS.get(module)
            if entry is not None:
                mod = __import__(module, fromlist=[entry])
                sys.argv = [mod.__file__ or module, *rest]
                getattr(mod, entry)(rest)
            else:
                sys.argv = [module, *rest]
                sys.path[0] = cwd  # what ``python -m`` puts first
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, rest = argv[1], argv[2:]
            sys.argv = [script, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = _uncaught(e)
    # what an interpreter's shutdown would run: the user's atexit handlers, flushed output
    atexit._run_exitfuncs()
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code)
