"""The guard of tests/unit/conftest.py: inside a unit test, opening a socket, starting a process
or building a Gloo group raises with the message that says where the test belongs, while
in-process pipes (``socket.socketpair``, an asyncio event loop) keep working."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch.distributed as dist

from isthmus.testing import local_groups

MESSAGE = "unit tests run in one process: move this test to tests/integration"


def _spawn_context_process() -> None:
    multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.parametrize(
    "attempt",
    [
        pytest.param(lambda: socket.socket(), id="socket"),
        pytest.param(lambda: socket.create_connection(("127.0.0.1", 9)), id="connect"),
        pytest.param(lambda: subprocess.run([sys.executable, "-c", "pass"]), id="subprocess.run"),
        pytest.param(lambda: subprocess.Popen(["true"]), id="Popen"),
        pytest.param(lambda: os.system("true"), id="os.system"),
        pytest.param(lambda: os.fork(), id="os.fork"),
        pytest.param(lambda: multiprocessing.Process(target=print).start(), id="multiprocessing"),
        pytest.param(_spawn_context_process, id="multiprocessing-spawn"),
        pytest.param(lambda: dist.TCPStore("127.0.0.1", 0, 1, True), id="TCPStore"),
        pytest.param(lambda: local_groups(2), id="local_groups"),
    ],
)
def test_leaving_the_process_is_refused_naming_tests_integration(
    attempt: Callable[[], object],
) -> None:
    with pytest.raises(RuntimeError, match=MESSAGE):
        attempt()


def test_in_process_pipes_still_work() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"

    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    assert asyncio.run(answer()) == 7
