"""One peer of ``isthmus run --nproc-per-peer N``: an *island* of N local processes.

The launcher starts this agent in the peer's slot instead of the script
(``python -m isthmus.run.island N SCRIPT ARGS...``); the agent starts the N ranks of the
island as torchrun would: ``python SCRIPT ARGS...`` with ``RANK`` and ``LOCAL_RANK`` (0 to
N - 1), ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (N), and ``MASTER_ADDR``/``MASTER_PORT`` (a free
port on this host: the island's own rendezvous), plus the peer's isthmus environment and
``ISTHMUS_NPROC_PER_PEER`` (which the session reads: a rank that never initialized a process
group is refused with an error saying so). With CUDA devices visible, rank ``i`` sees device
``i`` of them. Each rank is forked from the agent (which the launcher's fork server started
with torch imported), or started from a fresh interpreter with ``ISTHMUS_FORKSERVER=0``.

An island fails as a whole: when any rank exits with an error (or is killed), the agent kills
the others and exits with that rank's status, so that the launcher's ``--max-restarts`` starts
the whole island again. The ranks share the agent's process group, so the launcher's signals
to the slot (stop, kill, teardown) reach all of them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

__all__ = ["Forked", "free_port", "main", "rank_env"]

POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the island's rendezvous port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(
    base: dict[str, str], *, rank: int, size: int, port: int, devices: list[str]
) -> dict[str, str]:
    """The environment of rank ``rank`` of an island of ``size`` (see the module docstring)."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ISTHMUS_NPROC_PER_PEER=str(size),
        ISTHMUS_LOCAL_RANK=str(rank),
    )
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
    if rank:  # the ranks of one peer share its name in the coordinator's view; logs tell them
        env["ISTHMUS_NAME"] = base.get("ISTHMUS_NAME", "peer")
    return env


class Forked:
    """A rank forked from this process (which the launcher's fork server started with torch
    already imported, so a rank costs no interpreter start), with ``Popen``'s ``poll``,
    ``wait``, ``kill``, ``send_signal`` and ``returncode``."""

    def __init__(self, script: str, args: list[str], env: dict[str, str]) -> None:
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the rank: become `python script args...`, then exit
            code: Any = 0
            try:
                os.environ.clear()
                os.environ.update(env)
                sys.argv = [script, *args]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code if isinstance(code, int) else (0 if code is None else 1))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def main(argv: list[str]) -> int:
    """``N SCRIPT ARGS...``: run the island, return its exit status (the first failing rank's,
    -signal for a rank killed by a signal, 0 when every rank succeeded)."""
    if len(argv) < 2:
        print("usage: python -m isthmus.run.island N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    size, script, args = int(argv[0]), argv[1], argv[2:]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = [d for d in visible.split(",") if d.strip()]
    port = free_port()
    fork = os.environ.get("ISTHMUS_FORKSERVER", "1") != "0"
    procs: list[Any] = []
    for r in range(size):
        env = rank_env(dict(os.environ), rank=r, size=size, port=port, devices=devices)
        if fork:
            procs.append(Forked(script, args, env))
        else:
            procs.append(subprocess.Popen([sys.executable, script, *args], env=env))

    def stop(signum: int, _frame: object) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            print(f"isthmus island: a rank exited with {status}; stopping the island", flush=True)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(POLL_S)
    codes = [p.returncode for p in procs]
    if status == 0:
        status = next((c for c in codes if c != 0), 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
