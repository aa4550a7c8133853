"""An island's word on its round, in one process: the leader merges each follower's relayed
transfer (``moving``, ``silent``) into the island's ``info.transfer``
(:func:`~isthmus.comm.island_watch.island_transfer`), a rank that reached the round's outcome
says nothing moves unless its transfer still does, and the coordinator's cut-link rule applies
to an island's merged heartbeat as to a plain peer's: a follower's silent claim on a reported
island, with every rank of the waiting island still, aborts the round naming the pair."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from isthmus.comm.group import CollectiveError
from isthmus.comm.island import IslandSession
from isthmus.comm.island_watch import MAX_MERGED, island_transfer
from isthmus.comm.peer_reach import named_unreached
from isthmus.comm.session import Session
from isthmus.comm.session_config import RoundFailed
from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import RoundPlan, TensorSpec, Transfer


def _in(epoch: int, rnd: int, moving: bool, *silent: tuple[int, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"epoch": epoch, "round": rnd, "moving": moving}
    if silent:
        out["silent"] = [{"epoch": epoch, "rank": r, "for_s": s} for r, s in silent]
    return out


def _claims(*silent: tuple[int, int, float]) -> dict[str, Any]:
    return {"silent": [{"epoch": e, "rank": r, "for_s": s} for e, r, s in silent]}


def test_the_island_moves_unless_every_rank_says_nothing_moves_in_this_round() -> None:
    still = _in(3, 9, False)
    assert island_transfer(still, {1: still, 2: still}, 3) == still
    assert island_transfer(still, {1: still, 2: _in(3, 9, True)}, 3)["moving"] is True
    assert island_transfer(_in(3, 9, True), {1: still}, 2)["moving"] is True
    # a rank not heard from lately, or that said nothing, or not yet in this round: moving
    assert island_transfer(still, {1: still}, 3)["moving"] is True
    assert island_transfer(still, {1: None}, 2)["moving"] is True
    assert island_transfer(still, {1: _in(3, 8, False)}, 2)["moving"] is True
    assert island_transfer(still, {1: _claims((3, 0, 12.0))}, 2)["moving"] is True
    # an island of one is its leader
    assert island_transfer(still, {}, 1) == still


def test_every_ranks_silent_claims_are_merged_outside_a_round_too() -> None:
    followers = {
        1: _claims((3, 0, 12.0), (3, 2, 4.0)),
        2: {**_claims((3, 0, 15.0)), "moving": "yes"},  # a relayed dict is not trusted blindly
        3: {"silent": [{"epoch": 3, "rank": True, "for_s": 1.0}, "junk", {"epoch": 3}]},
    }
    merged = island_transfer(_claims((3, 1, 6.0)), followers, 4)
    assert merged == {
        "silent": [
            {"epoch": 3, "rank": 0, "for_s": 15.0},  # the longest claim per member and epoch
            {"epoch": 3, "rank": 1, "for_s": 6.0},
            {"epoch": 3, "rank": 2, "for_s": 4.0},
        ]
    }
    assert island_transfer(None, {1: None, 2: {}}, 3) is None
    inside = island_transfer(_in(3, 9, False), {1: _in(3, 9, False, (0, 11.0))}, 2)
    assert inside == {**_in(3, 9, False), "silent": [{"epoch": 3, "rank": 0, "for_s": 11.0}]}
    many = {1: _claims(*((3, r, float(r)) for r in range(2 * MAX_MERGED)))}
    assert len(island_transfer(None, many, 2)["silent"]) == MAX_MERGED


class _Group:
    def __init__(
        self, *, busy: bool, moving: bool, silent: list[tuple[int, float]], epoch: int = 3
    ) -> None:
        self.epoch, self._busy, self._moving, self._silent = epoch, busy, moving, silent

    def busy(self) -> bool:
        return self._busy

    def moving(self) -> bool:
        return self._moving and self._busy

    def silent_members(self) -> list[tuple[int, float]]:
        return self._silent


def _rank(plan: Any, group: _Group, done: tuple[int, int] | None, extra=()) -> Any:
    me = SimpleNamespace(_in_round=plan, _group=group, _rank_done=done, _extra=list(extra))
    return IslandSession._rank_transfer(me)  # type: ignore[arg-type]


def test_a_rank_at_the_outcome_says_nothing_moves_and_keeps_its_claims() -> None:
    plan = SimpleNamespace(epoch=3, round=9)
    idle = _Group(busy=False, moving=False, silent=[(0, 12.04)])
    # between its collectives a rank is about to transfer; at the outcome it is done
    assert _rank(plan, idle, None)["moving"] is True
    done = _rank(plan, idle, (3, 9))
    assert done == _in(3, 9, False, (0, 12.0))
    assert _rank(plan, idle, (3, 8))["moving"] is True  # an earlier round's outcome
    assert _rank(plan, _Group(busy=True, moving=True, silent=[]), (3, 9))["moving"] is True
    # after the island reported: only the claims, of every group the rank holds
    other = _Group(busy=False, moving=False, silent=[(2, 5.0)])
    assert _rank(None, idle, (3, 9), [other]) == _claims((3, 0, 12.0), (3, 2, 5.0))
    assert _rank(None, _Group(busy=False, moving=False, silent=[]), None) is None


def test_a_rank_beside_islands_of_other_sizes_judges_every_group_it_is_in() -> None:
    # beside islands of other sizes a rank holds one group per tuple of owners; its round may
    # wait on any of them
    plan = SimpleNamespace(epoch=3, round=9)
    idle = _Group(busy=False, moving=False, silent=[])
    stuck = _Group(busy=True, moving=False, silent=[(0, 4.0)])
    flowing = _Group(busy=True, moving=True, silent=[])
    # its main group is idle, another waits with nothing moving: nothing moves on this rank
    assert _rank(plan, idle, None, [stuck]) == _in(3, 9, False, (0, 4.0))
    # its main group waits with nothing moving while another still receives: it moves
    assert _rank(plan, stuck, None, [flowing])["moving"] is True
    assert _rank(plan, idle, None, [idle])["moving"] is True  # between collectives
    # at the outcome, a transfer still moving on another group keeps the rank moving
    assert _rank(plan, idle, (3, 9), [flowing])["moving"] is True
    assert _rank(plan, idle, (3, 9), [idle])["moving"] is False
    # the claims of every group, the longest per member; a retired epoch's group says nothing
    longer = _Group(busy=True, moving=False, silent=[(0, 9.0), (2, 1.0)])
    old = _Group(busy=True, moving=False, silent=[(1, 30.0)], epoch=2)
    assert _rank(plan, stuck, None, [longer, old]) == _in(3, 9, False, (0, 9.0), (2, 1.0))


def test_the_leaders_heartbeat_works_out_its_transfer_once() -> None:
    asked: list[str] = []

    class Counted(_Group):
        def busy(self) -> bool:
            asked.append("busy")
            return super().busy()

        def moving(self) -> bool:
            asked.append("moving")
            return super().moving()

        def silent_members(self) -> list[tuple[int, float]]:
            asked.append("silent")
            return super().silent_members()

    me = IslandSession.__new__(IslandSession)  # a leader's heartbeat, with no other rank heard
    stats = SimpleNamespace(bytes_sent=0, by_op={})
    reach = SimpleNamespace(take_outcomes=list)
    island = SimpleNamespace(size=2)
    me.__dict__.update(info={}, revision=4, stats=stats, _graveyard=[], reach=reach, _watch=None)
    me.__dict__.update(island=island, island_bytes=[0, 0], _rank_done=None, _extra=[])
    me.__dict__.update(_in_round=SimpleNamespace(epoch=3, round=9))
    me.__dict__.update(_group=Counted(busy=True, moving=False, silent=[(1, 6.0)]))
    info = me._heartbeat_info()
    # the follower was not heard: the island moves; the leader's claim rides along
    assert info["transfer"] == {
        **_in(3, 9, True),
        "silent": [{"epoch": 3, "rank": 1, "for_s": 6.0}],
    }
    assert sorted(asked) == ["busy", "moving", "silent"]


def test_the_member_a_followers_failure_names_rides_on_the_islands_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a cut between two followers: the leader's own connections are clean, its follower's wait
    # gave up on a silent connection naming its remote by rank (the round plan's order)
    reported: dict[str, Any] = {}

    def report(_self: Any, _plan: Any, **kw: Any) -> bool:
        reported.update(kw)
        return False

    monkeypatch.setattr(Session, "_report_outcome", report)
    remote = "rank 0 at 10.0.0.12:41234"
    follower = (
        False,
        f"all_reduce made no progress: no acknowledgement from {remote}",
        7,
        (remote,),
    )
    island = SimpleNamespace(
        leader=True, size=2, gather=lambda mine: [mine, follower], broadcast=lambda obj=None: obj
    )
    me = IslandSession.__new__(IslandSession)
    me.__dict__.update(island=island, stats=SimpleNamespace(bytes_sent=5), _extra=[], _reach_of={})
    plan = RoundPlan(9, 3, (4, 7), (), {}, False, reach={"4": "10.0.0.2:4100"})
    assert me._report_outcome(plan, ok=True, error="", t0=0.0) is False
    assert reported["ok"] is False and reported["error"].startswith("rank 1: all_reduce")
    cause = reported["cause"]
    assert isinstance(cause, CollectiveError) and cause.unreached == (remote,)
    # the peer's naming rule reads it as the other island, at its probe listener
    u = named_unreached(cause.unreached[0], plan, {4: "10.0.0.2:4100"})
    assert u is not None and (u.peer, u.address, u.how) == (4, "10.0.0.2:4100", "stalled")
    assert me.island_bytes == [5, 7]
    # nobody named: the leader's own cause (none when it succeeded), as before
    follower = (False, "a transfer failed", 7, ())
    me._report_outcome(plan, ok=True, error="", t0=0.0)
    assert reported["cause"] is None


def _setup_collectives(monkeypatch: pytest.MonkeyPatch, *, leader: bool) -> list[str]:
    """The island's collectives one rank makes setting up a round with a resync, where the
    follower's cross-island group does not connect (a cut between followers) and the leader's
    does."""
    calls: list[str] = []
    monkeypatch.setattr(
        "isthmus.comm.island.island_transfers", lambda *a, **k: calls.append("transfers")
    )
    plan = RoundPlan(9, 3, (4, 7), (Transfer(4, 7, ("w",)),), {"w": "aa"}, True)

    def group_for(_plan: RoundPlan) -> Any:
        if not leader:
            raise CollectiveError("epoch3 did not connect")
        return SimpleNamespace(rank=0, world=2)

    def gather(obj: Any) -> list[Any]:
        calls.append("gather")
        return [True, False]

    def report(_plan: RoundPlan, **kw: Any) -> bool:
        calls.append("report")
        return False

    me = IslandSession.__new__(IslandSession)
    me.__dict__.update(
        _closed=False,
        _graveyard=SimpleNamespace(reap=lambda: None),
        config=SimpleNamespace(round_timeout=60.0, max_attempts=1),
        _ask_for_round=lambda deadline: plan,
        _group_for=group_for,
        _report_outcome=report,
        island=SimpleNamespace(leader=leader, size=2, gather=gather),
        state=None,
        peer_id=7,
        pieces=None,
        island_sizes=[2, 2],
    )
    with pytest.raises(RoundFailed):
        me.begin()
    return calls


def test_a_round_whose_followers_group_alone_did_not_connect_is_given_up_by_every_rank_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every rank makes the same island collectives in the same order: none starts the resync
    # when one rank's group did not connect, and every rank reports the attempt
    leader = _setup_collectives(monkeypatch, leader=True)
    follower = _setup_collectives(monkeypatch, leader=False)
    assert leader == follower == ["gather", "report"]


SCHEMA = [TensorSpec("w", (2, 3), "torch.float32")]


def _two_islands() -> tuple[Membership, list[int], RoundPlan]:
    m = Membership(MembershipConfig(start_peers=2, heartbeat_timeout=3.0))
    pids = [
        m.register(f"island{i}", 0.0, {"probe": f"10.0.0.{i + 2}:4100", "island": {"size": 2}})
        for i in range(2)
    ]
    for pid in pids:
        m.begin(pid, 0.0, nonce="a", revision=0, hashes={"w": "aa"}, schema=SCHEMA)
    d = m.poll_begin(pids[0], "a")
    assert d.kind == "go" and d.plan is not None, d
    return m, pids, d.plan


def _run(receiver_follower_moving: bool) -> tuple[Membership, list[int], RoundPlan]:
    """Islands A and B of two ranks; rank 1's link between them is cut after A's rank 1
    handed its data to its kernel: A reports, B's rank 1 waits with nothing in flight."""
    m, pids, plan = _two_islands()
    a, b = pids
    ra, rb = plan.rank_of(a), plan.rank_of(b)
    assert m.commit(a, 0.5, epoch=plan.epoch, round=plan.round, ok=True).kind == "wait"
    e, n = plan.epoch, plan.round
    # A's leader is clean; its follower's data to island B is not acknowledged
    sender = island_transfer(None, {1: {"silent": [{"epoch": e, "rank": rb, "for_s": 9.0}]}}, 2)
    # B's leader reached the outcome (nothing moves); its follower waits
    receiver = island_transfer(_in(e, n, False), {1: _in(e, n, receiver_follower_moving)}, 2)
    assert ra != rb
    now = 0.5
    for _ in range(4):
        now += 0.5
        m.heartbeat(a, now, {"transfer": sender})
        m.heartbeat(b, now, {"transfer": receiver})
        m.tick(now)
    return m, pids, plan


def test_a_followers_cut_link_aborts_the_round_naming_the_islands() -> None:
    m, (a, b), plan = _run(receiver_follower_moving=False)
    d = m.poll_commit(plan.epoch, plan.round)
    assert d.kind == "aborted", d
    assert "peer 0 (island0) reported" in d.reason and "peer 1 (island1)" in d.reason, d.reason
    assert "link between them is cut" in d.reason
    # the pair is down, as a failure report of A's naming B would mark it
    unreachable = [e for e in m.events if e["kind"] == "unreachable"]
    assert [(e["peer"], e["remote"], e["how"]) for e in unreachable] == [(a, b, "stalled")]
    assert unreachable[0]["address"] == "10.0.0.3:4100"  # B's probe listener


def test_a_follower_that_still_receives_keeps_the_round() -> None:
    m, _pids, plan = _run(receiver_follower_moving=True)
    assert m.poll_commit(plan.epoch, plan.round).kind == "wait"
    assert not [e for e in m.events if e["kind"] == "unreachable"]
