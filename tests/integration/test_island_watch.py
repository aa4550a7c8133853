"""IslandWatch over real UDP sockets: the ranks of an island hear each other, a silent rank
is reported, a rank that says goodbye is not, the leader's aborts reach the followers, and the
followers' transfers reach the leader."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from isthmus.comm.island_watch import MAX_RELAYED, IslandWatch, bind_watch


def _watches(
    n: int, status: Any = None
) -> tuple[list[IslandWatch], list[threading.Event], list[list]]:
    bound = [bind_watch() for _ in range(n)]
    addresses = [a for _, a in bound]
    lost = [threading.Event() for _ in range(n)]
    seen: list[list] = [[] for _ in range(n)]
    watches = [
        IslandWatch(
            r,
            sock,
            addresses,
            interval=0.05,
            timeout=0.6,
            on_lost=lambda ranks, r=r: (seen[r].append(("lost", ranks)), lost[r].set()),
            on_abort=lambda *a, r=r: seen[r].append(("abort", *a)),
            status=None if status is None else lambda r=r: status(r),
        )
        for r, (sock, _) in enumerate(bound)
    ]
    return watches, lost, seen


def test_a_silent_rank_is_reported_and_aborts_are_relayed() -> None:
    watches, lost, seen = _watches(3)
    try:
        watches[0].tell_abort(4, 7, "peer 2 failed")
        assert not lost[0].wait(1.0)  # all alive: nobody is reported for longer than the bound
        for r in (1, 2):
            assert ("abort", 4, 7, "peer 2 failed") in seen[r], seen[r]
        # rank 2 goes silent without a goodbye (as a SIGSTOPped process would)
        watches[2]._stop.set()
        assert lost[0].wait(5.0) and lost[1].wait(5.0)
        assert ("lost", [2]) in seen[0] and ("lost", [2]) in seen[1]
        assert watches[0].lost == [2]
    finally:
        for w in watches:
            w.close()


def test_a_rank_that_closes_its_watch_is_no_failure() -> None:
    watches, lost, seen = _watches(2)
    try:
        watches[1].close()
        assert not lost[0].wait(1.5), seen[0]
    finally:
        watches[0].close()


def test_bounds_are_checked() -> None:
    sock, address = bind_watch()
    with pytest.raises(ValueError, match="interval < timeout"):
        IslandWatch(0, sock, [address], interval=1.0, timeout=1.0, on_lost=print)
    sock.close()


def test_followers_relay_their_transfer_to_the_leader() -> None:
    many = [{"epoch": 2, "rank": r, "for_s": float(r)} for r in range(3 * MAX_RELAYED)]

    def status(rank: int) -> dict[str, Any] | None:
        if rank == 2:
            raise RuntimeError("a broken status")  # its beats still go out
        return {"epoch": 2, "round": 5, "moving": False, "silent": many}

    watches, lost, seen = _watches(3, status)
    try:
        end = time.monotonic() + 5.0
        while 1 not in watches[0].transfers() and time.monotonic() < end:
            time.sleep(0.02)
        relayed = watches[0].transfers()
        assert relayed[1] is not None and relayed[1]["moving"] is False, relayed
        silent = relayed[1]["silent"]
        assert len(silent) == MAX_RELAYED and silent[0]["for_s"] == 3 * MAX_RELAYED - 1
        assert relayed.get(2) is None  # heard, with nothing to say
        assert watches[1].transfers() == {}  # only the leader keeps them
        assert not lost[0].wait(0.5) and not lost[2].is_set(), seen
        watches[1].close()  # a rank that left says nothing any more
        time.sleep(0.2)
        assert 1 not in watches[0].transfers()
    finally:
        for w in watches:
            w.close()


def test_the_leader_asks_a_follower_to_probe_and_hears_its_answer() -> None:
    bound = [bind_watch() for _ in range(2)]
    addresses = [a for _, a in bound]
    asked: list[tuple[int, list[str]]] = []
    answered: list[tuple[int, int, list[str | None]]] = []
    watches = [
        IslandWatch(
            r,
            sock,
            addresses,
            interval=0.05,
            timeout=5.0,
            on_lost=lambda ranks: None,
            on_probe=lambda t, a: asked.append((t, a)),
            on_probed=lambda r, t, h: answered.append((r, t, h)),
        )
        for r, (sock, _) in enumerate(bound)
    ]
    try:
        watches[0].tell_probe(1, 7, ["10.0.0.13:4101"])
        deadline = time.monotonic() + 5.0
        while not asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked == [(7, ["10.0.0.13:4101"])]
        watches[1].tell_probed(7, ["timed out"])
        watches[1].tell_probed(8, [None])
        while len(answered) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answered == [(1, 7, ["timed out"]), (1, 8, [None])]
        # a follower's "probe" word is not taken from anyone but the leader
        watches[1]._send_to(0, {"probe": [9, ["10.0.0.2:4100"]]})
        time.sleep(0.3)
        assert len(asked) == 1
    finally:
        for w in watches:
            w.close()
