"""How a failed attempt's error becomes the failure report's ``unreached``: a member an epoch's
connect named, a stalled connection's remote as the group labels it (``rank R at host:port``),
or a bare address matched to the one member on that host; anything else names nobody (the peer
then probes). One process, no sockets."""

from __future__ import annotations

from isthmus.comm.peer_reach import PeerReach, named_unreached
from isthmus.coordinator.protocol import RoundPlan, Unreached

PLAN = RoundPlan(round=4, epoch=2, members=(3, 5, 7), transfers=(), expected={}, new_epoch=False)
PROBES = {3: "10.0.0.2:4100", 5: "10.0.0.3:4100", 7: "10.0.0.4:4100"}


def test_a_connect_failure_names_the_member_itself() -> None:
    got = named_unreached((5, "10.0.0.3:4100", "refused"), PLAN, PROBES)
    assert got == Unreached(5, "10.0.0.3:4100", "refused")
    assert named_unreached((9, "10.0.0.9:1", "refused"), PLAN, PROBES) is None  # not a member


def test_a_stalled_connection_is_the_member_of_that_rank() -> None:
    # the group's label names rank 2's Gloo listener; the report gives the member's probe address
    got = named_unreached("rank 2 at 10.0.0.4:41234", PLAN, PROBES)
    assert got == Unreached(7, "10.0.0.4:4100", "stalled")
    assert named_unreached("rank 3 at 10.0.0.9:1", PLAN, PROBES) is None  # no such rank


def test_a_bare_address_is_matched_by_host_only_when_one_member_is_there() -> None:
    assert named_unreached("10.0.0.3:55000", PLAN, PROBES) == Unreached(
        5, "10.0.0.3:4100", "stalled"
    )
    same_host = {m: f"127.0.0.1:{4100 + m}" for m in PLAN.members}
    assert named_unreached("127.0.0.1:55000", PLAN, same_host) is None  # several: probe instead
    assert named_unreached(42, PLAN, PROBES) is None


def test_only_an_isolated_wait_escapes_the_round_bound() -> None:
    # Session.begin gives a peer a fresh round_timeout whenever the coordinator says it sits out
    reach = PeerReach.__new__(PeerReach)  # no probe listener: no socket in a unit test
    reach.owner, reach._isolated = "p", ""
    assert reach.waiting("isolated: cannot reach peer2 at 10.0.0.4:41234")
    assert reach.waiting("isolated: cannot reach peer2 at 10.0.0.4:41234")  # logged once
    assert not reach.waiting("waiting for 2 more peers")
    assert not reach.waiting("")
