"""Unit tests run in one process: no sockets, no subprocesses, no forks, no Gloo groups.

While a test under tests/unit is set up, runs and is torn down, everything that would open a
network socket or start another process raises ``UnitTestIsolationError``: creating a socket
(``socket.socket``; wrapping an existing descriptor, as ``socket.socketpair`` and asyncio's
self-pipe do, stays allowed), starting a subprocess (``subprocess``, ``os.system``,
``os.posix_spawn``: everything that reaches ``_posixsubprocess.fork_exec``), ``os.fork``,
starting a ``multiprocessing`` process, and building a Gloo process group or a TCPStore (they
open sockets from C++, where the socket patch cannot see them; ``isthmus.testing.local_groups``
builds such groups). A test that needs any of them belongs in tests/integration.

The guard is applied per test through the ``pytest_runtest_*`` hooks of this directory, so
integration tests run in the same pytest session are not affected.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MESSAGE = "unit tests run in one process: move this test to tests/integration"


class UnitTestIsolationError(RuntimeError):
    """A unit test tried to open a socket or start a process."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnitTestIsolationError(f"{MESSAGE} (it {what})")

    return refuse


def _refusing_subclass(cls: type, what: str) -> type:
    """A subclass of ``cls`` whose construction raises: class attributes and ``isinstance``
    checks against the real class keep working."""
    return type(cls.__name__, (cls,), {"__init__": _refuse(what), "__module__": cls.__module__})


class _GuardedSocket(socket.socket):
    """``socket.socket`` that refuses to open a new socket but may wrap an existing descriptor
    (``socketpair``, ``fromfd``: in-process pipes, not the network)."""

    def __init__(
        self,
        family: int = -1,
        type: int = -1,
        proto: int = -1,
        fileno: int | None = None,
    ) -> None:
        if fileno is None:
            raise UnitTestIsolationError(f"{MESSAGE} (it opened a socket)")
        super().__init__(family, type, proto, fileno)


@contextmanager
def one_process() -> Iterator[None]:
    """Everything that opens a socket or starts a process raises while inside."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(socket, "socket", _GuardedSocket)
        mp.setattr(_posixsubprocess, "fork_exec", _refuse("started a subprocess"))
        mp.setattr(
            subprocess, "Popen", _refusing_subclass(subprocess.Popen, "started a subprocess")
        )
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse(f"called os.{name}"))
        mp.setattr(
            multiprocessing.process.BaseProcess,
            "start",
            _refuse("started a multiprocessing process"),
        )
        gloo = _refusing_subclass(dist.ProcessGroupGloo, "built a Gloo process group")
        store = _refusing_subclass(dist.TCPStore, "opened a TCPStore")
        for mod in (dist, c10d):
            mp.setattr(mod, "ProcessGroupGloo", gloo, raising=False)
            mp.setattr(mod, "TCPStore", store, raising=False)
            mp.setattr(mod, "init_process_group", _refuse("initialized a process group"))
            mp.setattr(mod, "new_group", _refuse("created a process group"))
        yield
    finally:
        mp.undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with one_process():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with one_process():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with one_process():
        return (yield)
