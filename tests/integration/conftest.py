"""Multi-process test harness: an embedded coordinator and real peer processes running the
built-in job (isthmus.run.job)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus import Fault, FaultInjector, Session, SessionConfig
from isthmus.comm.state import tensor_bytes
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.protocol import RestorePoint
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.lab.netns import cleanup_stale, list_namespaces, unavailable_reason
from isthmus.run import forkserver
from isthmus.run.forkserver import PeerProcess
from isthmus.run.job import PeerJob

TOKEN = "integration-test-token"


class Cluster:
    """A coordinator in this process plus peer processes it launched; cleans up after itself."""

    def __init__(self, tmp: Path, restore_from: RestorePoint | None = None, **membership: Any):
        self.dir = tmp
        membership.setdefault("heartbeat_timeout", 3.0)
        self.coord = Coordinator(
            CoordinatorConfig(
                token=TOKEN,
                port=0,
                heartbeat_interval=0.25,
                membership=MembershipConfig(**membership),
                restore_from=restore_from,
            )
        ).start()
        self.procs: dict[str, PeerProcess] = {}

    def spawn(self, name: str, **job: Any) -> PeerProcess:
        job.setdefault("model", "tiny")
        job.setdefault("corpus_bytes", 200_000)
        job.setdefault("steps", 30)
        job.setdefault("collective_timeout", 10.0)
        job.setdefault("connect_timeout", 10.0)
        job.setdefault("round_timeout", 60.0)
        job.setdefault("batch_size", 8)
        job.setdefault("strategy", "ddp")  # the harness's peers do data parallel unless told
        if "strategy_options" in job:  # the flat name of strategy.options is "option"
            job["option"] = job.pop("strategy_options")
        j = PeerJob.from_flat(
            coordinator=self.coord.address, token=TOKEN, name=name, out_dir=str(self.dir), **job
        )
        path = self.dir / f"{name}.job.json"
        path.write_text(j.to_json())
        log = self.dir / f"{name}.log"
        log.write_bytes(b"")
        # started like the launcher starts peers: forked from the warm server
        p = forkserver.popen(
            [sys.executable, "-m", "isthmus.run.job", str(path)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            log_path=log,
        )
        self.procs[name] = p
        return p

    def wait(self, *names: str, timeout: float = 120.0) -> dict[str, int]:
        """Wait for these peers (default: all) to exit; returns their exit codes."""
        deadline = time.monotonic() + timeout
        out = {}
        for n in names or tuple(self.procs):
            p = self.procs[n]
            try:
                out[n] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"peer {n} still running after {timeout}s; log:\n{self.log(n)}"
                ) from None
        return out

    def wait_until(
        self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.coord.status(events=200)
            if pred(st):
                return st
            time.sleep(0.05)
        raise AssertionError(
            f"timed out after {timeout}s waiting for {what}; status: {self.coord.status()}"
        )

    def log(self, name: str) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else "(no log)"

    def final(self, name: str) -> dict[str, Any]:
        p = self.dir / f"{name}.final.json"
        assert p.exists(), f"{name} wrote no final record; log:\n{self.log(name)}"
        return json.loads(p.read_text())

    def state(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.dir / f"{name}.state.pt")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                p.wait(10)
        self.coord.stop()


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b), "different tensor names"
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert bytes(tensor_bytes(a[n])) == bytes(tensor_bytes(b[n])), f"tensor {n} differs"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**membership: Any) -> Cluster:
        c = Cluster(tmp_path, **membership)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def one_peer(tmp_path: Path) -> Iterator[Callable[..., Session]]:
    """Sessions that are the only peer of their own run (each with its own coordinator);
    ``make(*faults)`` injects the given fault specs. Every session and coordinator is closed
    after the test."""
    made: list[tuple[Cluster, Session]] = []

    def make(*faults: str) -> Session:
        d = tmp_path / f"run{len(made)}"
        d.mkdir()
        c = Cluster(d, start_peers=1)
        s = Session(
            SessionConfig(coordinator=c.coord.address, token=TOKEN, connect_timeout=5),
            faults=FaultInjector([Fault.parse(f) for f in faults]),
        )
        made.append((c, s))
        return s

    yield make
    for c, s in made:
        s.close()
        c.close()


NETNS_REASON = unavailable_reason()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh name prefix for a test's network namespaces; everything under it is removed after
    the test, and the test fails if anything was left. Skips (with the reason) without root."""
    if NETNS_REASON is not None:
        pytest.skip(f"needs root and iproute2: {NETNS_REASON}")
    p = "t" + secrets.token_hex(4)
    try:
        yield p
    finally:
        cleanup_stale(p, include_live=True)
        assert not [n for n in list_namespaces() if n.startswith(p + "-")]
