"""The membership with hundreds of peers (pure): a round that waits for one member is answered
without a pass over everyone, yet forms exactly when the last member begins and leaves out a
blocker that went quiet; the stamp that wakes waiting requests moves exactly when an answer may
have changed."""

from __future__ import annotations

import random

import pytest

from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import TensorSpec

SCHEMA = [TensorSpec("w", (2, 3), "torch.float32")]
GOOD = {"w": "aa"}
N = 100


def _run(order: list[int]) -> tuple[Membership, list[int]]:
    m = Membership(MembershipConfig(start_peers=N, heartbeat_timeout=30.0))
    pids = [m.register(f"p{i:03d}", 0.0) for i in range(N)]
    for i in order:  # the first round
        m.begin(pids[i], 0.0, nonce="a", revision=0, hashes=GOOD, schema=SCHEMA)
    plan = m.poll_begin(pids[0], "a").plan
    assert plan is not None and len(plan.members) == N
    for pid in pids:
        m.commit(pid, 0.0, epoch=plan.epoch, round=0, ok=True)
    assert m.revision == 1
    return m, pids


def test_the_round_forms_at_the_last_begin_in_any_order() -> None:
    for order in (list(range(N)), list(range(N))[::-1], random.Random(1).sample(range(N), N)):
        m, pids = _run(order)
        for k, i in enumerate(order):
            d = m.begin(pids[i], 1.0, nonce="b", revision=1, hashes=GOOD, schema=None)
            assert d.kind == ("go" if k == N - 1 else "wait"), (k, d)
        assert m.running is not None and m.running.members == tuple(pids)


def test_a_blocker_that_goes_quiet_is_not_waited_for() -> None:
    m, pids = _run(list(range(N)))
    quiet_after = m.config.quiet_after_s
    for pid in pids[:-1]:
        assert m.begin(pid, 1.0, nonce="b", revision=1, hashes=GOOD, schema=None).kind == "wait"
    assert m.blocker is not None and m.blocker[1] == pids[-1]
    for p in m.peers.values():  # everyone but the blocker keeps speaking
        if p.id != pids[-1]:
            p.last_seen = 1.0 + quiet_after + 1
    # a member asks again (same attempt) after the blocker went quiet: the round forms without it
    d = m.begin(pids[0], 1.0 + quiet_after + 1, nonce="b", revision=1, hashes=GOOD, schema=None)
    assert d.kind == "go" and pids[-1] not in d.plan.members and len(d.plan.members) == N - 1
    assert [e["peer"] for e in m.events if e["kind"] == "quiet"] == [pids[-1]]


def test_the_stamp_moves_only_when_a_waiting_answer_may_change() -> None:
    m, pids = _run(list(range(N)))
    s0 = m.stamp()
    m.begin(pids[0], 1.0, nonce="b", revision=1, hashes=GOOD, schema=None)
    assert m.stamp() == s0  # an in-sync member's begin: nobody else's answer changes
    joiner = m.register("late", 1.0)
    s1 = m.stamp()
    assert s1 != s0  # an event
    m.begin(joiner, 1.0, nonce="j", revision=0, hashes=GOOD, schema=SCHEMA)
    assert m.stamp() != s1  # a joiner: the others may owe their hashes
    for pid in pids[1:]:
        m.begin(pid, 1.0, nonce="b", revision=1, hashes=GOOD, schema=None)
    plan = m.running
    assert plan is not None and len(plan.members) == N + 1
    s2 = m.stamp()
    for pid in plan.members[:-1]:
        m.commit(pid, 1.0, epoch=plan.epoch, round=1, ok=True)
        assert m.stamp() == s2  # a commit report in the middle of the round
        assert m.poll_commit(plan.epoch, 1, explain=False).reason == ""
    assert "waiting for commit reports" in m.poll_commit(plan.epoch, 1).reason
    m.commit(plan.members[-1], 1.0, epoch=plan.epoch, round=1, ok=True)
    assert m.stamp() != s2 and m.revision == 2


def test_a_waiting_reason_names_twenty_members_and_counts_the_rest() -> None:
    m, pids = _run(list(range(N)))
    m.begin(pids[0], 1.0, nonce="b", revision=1, hashes=GOOD, schema=None)
    why = m.poll_begin(pids[0], "b").reason
    assert why.startswith("waiting for members to begin round 1: 1 (p001), 2 (p002)")
    assert why.endswith(f" and {N - 1 - 20} more") and why.count("(p") == 20
    # reused for a moment while only in-sync members begin, worked out afresh after that
    assert m.poll_begin(pids[0], "b", now=1.0).reason == why
    m.begin(pids[1], 1.1, nonce="b", revision=1, hashes=GOOD, schema=None)
    assert m.poll_begin(pids[0], "b", now=1.1).reason == why
    assert "1 (p001)" not in m.poll_begin(pids[0], "b", now=2.0).reason


def test_a_round_of_begins_looks_at_every_peer_a_constant_number_of_times(monkeypatch) -> None:
    """A begin checks the member the last attempt waited for, then the next of those it waited
    for: the full pass (sorting out who sits out) runs at the round's first begin and its
    last, not once per member that happened to be the one waited for."""
    from isthmus.coordinator import forming

    passes: list[int] = []
    real = forming.sit_out

    def counted(s, ready, now):  # type: ignore[no-untyped-def]
        passes.append(len(ready))
        return real(s, ready, now)

    for order in (list(range(N)), list(range(N))[::-1], random.Random(2).sample(range(N), N)):
        m, pids = _run(order)
        monkeypatch.setattr(forming, "sit_out", counted)
        passes.clear()
        for k, i in enumerate(order):
            d = m.begin(pids[i], 1.0, nonce="b", revision=1, hashes=GOOD, schema=None)
            assert d.kind == ("go" if k == N - 1 else "wait"), (k, d)
        assert len(passes) <= 3, passes
        monkeypatch.setattr(forming, "sit_out", real)


def test_with_no_pair_down_and_nobody_isolated_nobody_is_looked_at_to_sit_out() -> None:
    """The full pass's question "who sits out" has the answer "nobody" while no pair is known
    down and nobody was ever isolated: it is answered without listing every member (the
    expected members, the voters, the seniority) and gives the ready peers back."""
    from isthmus.coordinator.isolation import sit_out

    m, pids = _run(list(range(N)))

    def everyone() -> list[int]:
        raise AssertionError("listed every member although nobody can sit out")

    m.expected = everyone  # type: ignore[method-assign]
    ready = pids[: N // 2]
    assert sit_out(m, ready, 1.0) is ready
    m.counters["isolations"] = 1  # once somebody was isolated, the pass looks again
    with pytest.raises(AssertionError, match="listed every member"):
        sit_out(m, ready, 1.0)


def test_with_parity_every_k_the_waiting_begins_share_one_look_at_whether_hashes_are_needed(
    monkeypatch,
) -> None:
    """Between parity rounds a begin carries no hashes, and each waiting one asks whether the
    round needs them (someone ready not in sync): a pass over every peer. It is asked once per
    change of the run, not once per begin and per poll (which made a round O(n^2))."""
    from isthmus.coordinator import forming

    m = Membership(MembershipConfig(start_peers=N, heartbeat_timeout=30.0, parity_every=10))
    pids = [m.register(f"p{i:03d}", 0.0) for i in range(N)]
    for pid in pids:
        m.begin(pid, 0.0, nonce="a", revision=0, hashes=GOOD, schema=SCHEMA)
    plan = m.running
    assert plan is not None
    for pid in pids:
        m.commit(pid, 0.0, epoch=plan.epoch, round=0, ok=True)
    looks: list[int] = []
    real = forming.hashes_needed

    def counted(s, ready):  # type: ignore[no-untyped-def]
        looks.append(len(ready))
        return real(s, ready)

    monkeypatch.setattr(forming, "hashes_needed", counted)
    for k, pid in enumerate(pids):
        d = m.begin(pid, 1.0, nonce="b", revision=1, hashes=None, schema=None)
        assert d.kind == ("go" if k == N - 1 else "wait"), (k, d)
        for other in pids[:k]:  # every waiting begin is asked again
            assert m.poll_begin(other, "b", explain=False).kind in ("wait", "go")
    assert 0 < len(looks) <= 3, len(looks)
    # a joiner (not in sync) among the ready peers: the waiting begins are asked for hashes
    plan = m.running
    assert plan is not None
    for pid in pids:
        m.commit(pid, 1.0, epoch=plan.epoch, round=1, ok=True)
    assert m.revision == 2
    m.begin(pids[0], 2.0, nonce="c", revision=2, hashes=None, schema=None)
    joiner = m.register("new", 2.0)
    m.begin(joiner, 2.0, nonce="j", revision=0, hashes=GOOD, schema=SCHEMA)
    assert m.poll_begin(pids[0], "c", explain=False).kind == "hashes"
