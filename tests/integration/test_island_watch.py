"""IslandWatch over real UDP sockets: the ranks of an island hear each other, a silent rank
is reported, a rank that says goodbye is not, and the leader's aborts reach the followers."""

from __future__ import annotations

import threading

import pytest

from isthmus.comm.island_watch import IslandWatch, bind_watch


def _watches(n: int) -> tuple[list[IslandWatch], list[threading.Event], list[list]]:
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
