"""Probes of a pair of islands rank to rank, in one process: which paths each rank probes, the
listeners a rank's group names, the leader's book that turns every rank's answer into one
outcome (and drops a probe a rank never answers), and the coordinator's push that carries the
other island's rank listeners only when both islands sent theirs (the probes over real
sockets: tests/integration/test_island_probes.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from isthmus.comm.island_probe import (
    RankProbes,
    group_addresses,
    owner_pairs,
    probe_paths,
    rank_unreached,
)
from isthmus.coordinator.isolation import ask_probes, plan_reach, rank_listeners, unreached
from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.partition import PartitionConfig, ProbeResult
from isthmus.coordinator.protocol import RoundPlan, Unreached


def test_each_rank_probes_the_ranks_its_groups_meet() -> None:
    # equal sizes: rank i meets rank i only (a cut between rank 1 and rank 0 is no path)
    assert probe_paths(2, 2) == {0: [0], 1: [1]}
    assert probe_paths(3, 3, [(0, 2)]) == {0: [0], 1: [1], 2: [2]}
    # different sizes: the owners' pairs of the groups, or every pair when they are not known
    assert probe_paths(2, 1, [(0, 0), (1, 0)]) == {0: [0], 1: [0]}
    assert probe_paths(2, 3) == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert probe_paths(2, 3, [(0, 0), (1, 2), (5, 0), (0, 9)]) == {0: [0], 1: [2]}
    # the owners' pairs come from the layout of the island's sharded tensors
    assert owner_pairs([], 2, 1) is None
    pairs = owner_pairs([(8, 4)], 2, 1)
    assert pairs is not None and {a for a, _ in pairs} == {0, 1} and {b for _, b in pairs} == {0}
    assert owner_pairs([(8, 4)], 2, 2) == [(0, 0), (1, 1)]


PLAN = RoundPlan(
    9,
    3,
    (4, 7),
    (),
    {},
    False,
    reach={"4": "10.0.0.2:4100", "4.1": "10.0.0.12:4101", "7": "10.0.0.3:4100"},
)


def test_a_rank_names_the_other_island_at_the_rank_its_group_holds() -> None:
    # rank 1 of island 7 meets rank 1 of island 4: its listener, not the leader's
    assert group_addresses(PLAN, 7, (1, 1)) == {4: "10.0.0.12:4101"}
    assert group_addresses(PLAN, 7, (0, 0)) == {4: "10.0.0.2:4100"}
    assert group_addresses(PLAN, 4, (1, 1)) == {}  # island 7 sent no follower's listener
    # a silent connection's remote (the group's rank 0 is member 4) at that listener
    named = rank_unreached(["rank 0 at 10.0.0.12:29500"], PLAN, {4: "10.0.0.12:4101"})
    assert named == ((4, "10.0.0.12:4101", "stalled"),)
    # unknown there (an island of an earlier release): kept, the leader names it as before
    assert rank_unreached(["rank 0 at 10.0.0.12:29500"], PLAN, {}) == ("rank 0 at 10.0.0.12:29500",)
    assert rank_unreached(["nonsense"], PLAN, {4: "10.0.0.12:4101"}) == ("nonsense",)


def test_one_outcome_once_every_rank_answered_and_none_for_a_rank_that_never_does() -> None:
    book = RankProbes(limit_s=8.0)
    t = book.start(4, [0, 1], now=0.0)
    assert book.answer(t, 0, [None], now=0.5) is None  # rank 1 has not answered
    assert book.answer(t, 2, [None], now=0.6) is None  # a rank it did not ask: ignored
    assert book.answer(t, 1, [None], now=3.1) == {"peer": 4, "ok": True}
    assert book.answer(t, 1, [None], now=3.2) is None  # answered already: gone
    # one path that fails fails the probe: the followers' path keeps the pair down
    t = book.start(4, [0, 1], now=10.0)
    assert book.answer(t, 1, ["timed out"], now=13.0) is None
    assert book.answer(t, 0, [None], now=10.2) == {"peer": 4, "ok": False, "how": "timed out"}
    # a follower that dies mid-probe never answers: dropped at the bound, no outcome at all
    t = book.start(4, [0, 1], now=20.0)
    assert book.answer(t, 0, [None], now=20.1) is None
    assert len(book) == 1
    assert book.expire(now=27.0) == [] and len(book) == 1
    assert book.expire(now=28.5) == [t] and len(book) == 0 and book.dropped == 1
    assert book.answer(t, 1, [None], now=28.6) is None  # a late answer says nothing
    # a late answer to a probe not yet expired is not taken either
    t = book.start(4, [0], now=40.0)
    assert book.answer(t, 0, [None], now=48.5) is None and book.dropped == 2


def _islands(
    *, probes: tuple[bool, bool] = (True, True)
) -> tuple[Membership, int, int, list[tuple[Any, Any]]]:
    m = Membership(
        MembershipConfig(
            start_peers=2, heartbeat_timeout=3.0, partition=PartitionConfig(probe_every_s=3.0)
        )
    )
    pids = []
    for i, with_ranks in enumerate(probes):
        info: dict[str, Any] = {"probe": f"10.0.0.{i + 2}:4100", "island": {"size": 2}}
        if with_ranks:
            info["rank_probes"] = [f"10.0.0.{i + 2}:4100", f"10.0.0.{i + 12}:4101"]
        pids.append(m.register(f"island{i}", 0.0, info))
    a, b = pids
    for pid in pids:  # a heartbeat's info (its own "island") must not lose the listeners
        m.heartbeat(pid, 0.5, {"island": {"size": 2, "bytes_sent": [0, 0]}})
    unreached(m, m.peers[a], [Unreached(b, "10.0.0.13:4101", "timed out")], 1.0)
    m.take_notices()
    ask_probes(m, 5.0)
    pushes = [(to, msg) for to, msg in m.take_notices() if msg["type"] == "probe"]
    return m, a, b, pushes


def test_the_coordinator_asks_for_rank_to_rank_probes_between_islands_that_sent_listeners() -> None:
    m, a, b, pushes = _islands()
    assert rank_listeners(m.peers[b]) == ("10.0.0.3:4100", "10.0.0.13:4101")
    assert plan_reach(m, [a, b]) == {
        str(a): "10.0.0.2:4100",
        f"{a}.1": "10.0.0.12:4101",
        str(b): "10.0.0.3:4100",
        f"{b}.1": "10.0.0.13:4101",
    }
    assert len(pushes) == 1
    to, msg = pushes[0]
    prober = to[0]
    target = b if prober == a else a
    assert msg["peer"] == target and msg["ranks"] == list(rank_listeners(m.peers[target]) or ())
    # a failed outcome keeps the pair down; one that connected (every path) brings it up
    m.reach.probe(ProbeResult("island0", "island1", False, 6.0))
    assert m.reach.pair_state("island0", "island1").down
    m.reach.probe(ProbeResult("island0", "island1", True, 9.0))
    assert not m.reach.pair_state("island0", "island1").down


def test_an_island_of_an_earlier_release_is_probed_at_its_leader_as_before() -> None:
    for probes in ((True, False), (False, True)):
        _m, _a, _b, pushes = _islands(probes=probes)
        assert len(pushes) == 1 and "ranks" not in pushes[0][1], pushes
    # a malformed list is no list: it would break every plan that carried it
    bad = SimpleNamespace(info={"island": {"size": 2}, "rank_probes": ["10.0.0.2:4100", "x"]})
    assert rank_listeners(bad) is None  # type: ignore[arg-type]
    short = SimpleNamespace(info={"island": {"size": 3}, "rank_probes": ["10.0.0.2:4100"]})
    assert rank_listeners(short) is None  # type: ignore[arg-type]
    assert rank_listeners(SimpleNamespace(info={"probe": "10.0.0.2:4100"})) is None  # type: ignore[arg-type]


def test_a_group_that_does_not_connect_probes_the_ranks_it_holds(monkeypatch: Any) -> None:
    from isthmus.comm import epoch
    from isthmus.comm.group import CollectiveError
    from isthmus.coordinator.partition import How

    probed: list[dict[int, str]] = []

    def probe_all(addresses: dict[int, str], **_kw: Any) -> list[tuple[int, str, How]]:
        probed.append(dict(addresses))
        return [(m, a, How.TIMED_OUT) for m, a in sorted(addresses.items())]

    monkeypatch.setattr(epoch, "probe_all", probe_all)
    failed = CollectiveError("could not connect the process group of epoch 3 within 30s")
    # rank 1 of island 7: the listener of island 4's rank 1, not its leader's
    rank1 = group_addresses(PLAN, 7, (1, 1))
    err = epoch._name_unreached(failed, PLAN, 7, 3.0, "10.0.0.13", rank1)
    assert probed[-1] == {4: "10.0.0.12:4101"}
    assert err.unreached == ((4, "10.0.0.12:4101", How.TIMED_OUT),)  # type: ignore[attr-defined]
    assert "cannot reach peer 4 at 10.0.0.12:4101 (timed out)" in str(err)
    # no rank listener known (an island of an earlier release): nobody probed, nobody named
    assert (
        epoch._name_unreached(failed, PLAN, 4, 3.0, None, group_addresses(PLAN, 4, (1, 1)))
        is failed
    )
    assert len(probed) == 1
    # a plain peer (no addresses given): the plan's members' listeners, as before
    epoch._name_unreached(failed, PLAN, 7, 3.0, None, None)
    assert probed[-1] == {4: "10.0.0.2:4100"}
