"""Rank-to-rank probes of a pair of islands over real sockets: the leader probes its own path
and relays its follower's (through a stand-in for the island's watch, which
tests/integration/test_island_watch.py covers over UDP), and reports one outcome: failed while
the followers' path is refused, ok once every path connects, none when the follower's answer
never comes."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

from isthmus.comm.island_probe import IslandProber
from isthmus.comm.reach import ProbeListener
from isthmus.coordinator.protocol import ProbePush


class _Watch:
    """The island's watch, reduced to its two messages: delivered at once, or lost."""

    def __init__(self) -> None:
        self.leader: IslandProber | None = None
        self.follower: IslandProber | None = None
        self.lose = False

    def tell_probe(self, rank: int, token: int, addresses: list[str]) -> None:
        if not self.lose and self.follower is not None:
            self.follower.asked(token, addresses)

    def tell_probed(self, token: int, hows: list[str | None]) -> None:
        if not self.lose and self.leader is not None:
            self.leader.answered(1, token, hows)


def _island_pair() -> tuple[IslandProber, list[dict[str, Any]], _Watch]:
    outcomes: list[dict[str, Any]] = []
    reach = SimpleNamespace(probe_timeout=1.0, source="127.0.0.1", add_outcome=outcomes.append)
    watch = _Watch()
    probers = []
    for _ in range(2):
        p = IslandProber(size=2, shapes=list, limit_s=4.0)
        p.reach, p.watch = reach, watch  # type: ignore[assignment]
        probers.append(p)
    watch.leader, watch.follower = probers
    return probers[0], outcomes, watch


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: a connect is refused
    return f"127.0.0.1:{port}"


def _wait(outcomes: list[dict[str, Any]], n: int) -> None:
    deadline = time.monotonic() + 10.0
    while len(outcomes) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_leader_reports_one_outcome_for_every_path_of_its_ranks() -> None:
    leader, outcomes, watch = _island_pair()
    assert leader.start(ProbePush(peer=4, address="127.0.0.1:1")) is False  # no ranks: as before
    with ProbeListener("127.0.0.1") as l0, ProbeListener("127.0.0.1") as l1:
        # the followers' path refused, the leaders' connects: the pair stays down
        assert leader.start(
            ProbePush(peer=4, address=l0.address, ranks=(l0.address, _closed_port()))
        )
        _wait(outcomes, 1)
        assert outcomes == [{"peer": 4, "ok": False, "how": "refused"}]
        # both paths connect (the link healed): one outcome, ok
        assert leader.start(ProbePush(peer=4, address=l0.address, ranks=(l0.address, l1.address)))
        _wait(outcomes, 2)
        assert outcomes[1] == {"peer": 4, "ok": True}
        assert l0.accepted >= 2 and l1.accepted >= 1
        # the follower's answer is lost (or it died): no outcome, the probe is dropped later
        watch.lose = True
        assert leader.start(ProbePush(peer=4, address=l0.address, ranks=(l0.address, l1.address)))
        deadline = time.monotonic() + 10.0
        while l0.accepted < 3 and time.monotonic() < deadline:  # the leader's own path connects
            time.sleep(0.02)
        time.sleep(0.3)  # its answer is in the book; the follower's never comes
        assert len(outcomes) == 2 and len(leader.book) == 1
        assert len(leader.book.expire(time.monotonic() + 4.5)) == 1 and len(leader.book) == 0
        assert len(outcomes) == 2
