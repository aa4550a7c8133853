"""The coordinator's bounds during a long transfer, on a fake clock: a member whose heartbeats
say its transfer moves may go ``transfer_heartbeat_timeout`` without one (its heartbeats queue
behind the data on a thin link) while a partner in its round says the same, one that is not
transferring, or whose partners see nothing move, keeps ``heartbeat_timeout`` (one that
reported its round keeps the longer bound until the round ends), and the commit
bound counts from a member's last progress, not from the round's start."""

from __future__ import annotations

import pytest

from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import RoundPlan, TensorSpec

SCHEMA = [TensorSpec("w", (2, 3), "torch.float32")]
GOOD = {"w": "aa"}


def _mv(plan: RoundPlan, moving: bool) -> dict[str, object]:
    """A heartbeat's info from a member in ``plan``'s round (``comm.group.transfer_info``)."""
    return {"transfer": {"epoch": plan.epoch, "round": plan.round, "moving": moving}}


def _round(m: Membership, now: float, pids: list[int]) -> RoundPlan:
    for pid in pids:
        m.begin(pid, now, nonce="1", revision=m.revision, hashes=GOOD, schema=SCHEMA)
    d = m.poll_begin(pids[0], "1")
    assert d.kind == "go" and d.plan is not None
    return d.plan


def _two(**cfg: float) -> tuple[Membership, int, int, RoundPlan]:
    m = Membership(MembershipConfig(start_peers=2, **cfg))
    a, b = m.register("a", 0.0), m.register("b", 0.0)
    return m, a, b, _round(m, 0.0, [a, b])


def test_a_member_whose_transfer_moves_outlasts_the_heartbeat_timeout() -> None:
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    t = 0.0
    for _ in range(40):  # both heartbeat every 0.5 s, saying their transfer moves
        t += 0.5
        m.heartbeat(a, t, _mv(plan, True))
        m.heartbeat(b, t, _mv(plan, True))
    # b's heartbeats now queue behind its data for 8 s: more than heartbeat_timeout
    for _ in range(16):
        t += 0.5
        m.heartbeat(a, t, _mv(plan, True))
        m.tick(t)
    assert m.peers[b].state.value == "active"
    assert m.poll_commit(plan.epoch, plan.round).kind == "wait"
    # past transfer_heartbeat_timeout it is silent, transfer or not (stopped, or cut off)
    for _ in range(5):
        t += 0.5
        m.heartbeat(a, t, _mv(plan, True))
        m.tick(t)
    assert m.peers[b].state.value == "dead" and "no heartbeat" in m.peers[b].reason
    assert m.poll_commit(plan.epoch, plan.round).kind == "aborted"


def test_a_member_whose_partners_see_nothing_move_keeps_the_short_bound() -> None:
    # b stops inside the transfer: its last heartbeat said moving, but a, its partner, soon
    # sees nothing move on its connections (b takes no data) and says so; nobody vouches for b
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    m.heartbeat(a, 1.0, _mv(plan, True))
    m.heartbeat(b, 1.0, _mv(plan, True))
    t = 1.0
    while t < 4.5:
        t += 0.5
        m.heartbeat(a, t, _mv(plan, t < 3.0))
        m.tick(t)
    assert m.peers[b].state.value == "dead" and "no heartbeat for 3.5s" in m.peers[b].reason
    assert m.poll_commit(plan.epoch, plan.round).kind == "aborted"


def test_a_member_that_reported_keeps_the_longer_bound_until_the_round_ends() -> None:
    # b's collective completed once its last data was handed to its kernel, and it reported;
    # that data still drains over the thin link ahead of b's heartbeats, while a receives it
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    assert m.commit(b, 1.0, epoch=plan.epoch, round=plan.round, ok=True).kind == "wait"
    m.heartbeat(b, 1.0, {"transfer": None})  # out of the round, from b's side
    t = 1.0
    while t < 9.0:
        t += 0.5
        m.heartbeat(a, t, _mv(plan, True))
        m.tick(t)
    assert m.peers[b].state.value == "active"  # 8 s without a heartbeat, inside the round
    # a got the rest and reports: the round commits, b is outside a round and speaks again
    assert m.commit(a, t, epoch=plan.epoch, round=plan.round, ok=True).kind == "committed"
    m.heartbeat(b, t, {"transfer": None})
    m.tick(t + 3.5)  # now the short bound holds for b
    assert m.peers[b].state.value == "dead" and "no heartbeat for 3.5s" in m.peers[b].reason


def test_a_member_that_reported_is_held_to_the_short_bound_when_partners_see_nothing() -> None:
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    assert m.commit(b, 1.0, epoch=plan.epoch, round=plan.round, ok=True).kind == "wait"
    m.heartbeat(b, 1.0, {"transfer": None})
    m.heartbeat(a, 1.0, _mv(plan, True))
    m.heartbeat(a, 3.5, _mv(plan, False))  # nothing arrives from b any more
    m.tick(4.5)
    assert m.peers[b].state.value == "dead"
    assert m.peers[a].state.value == "active"


def test_at_the_start_of_a_transfer_no_heartbeat_may_arrive_at_all() -> None:
    # a thin link full of the round's data: neither member's heartbeats get through, and
    # nothing says a member stopped; both get the longer bound from the round's start
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    # a heartbeat a sent before its go arrives after the round formed: it speaks of no round
    # (or of an earlier one), so it is no evidence that nothing moves
    m.heartbeat(a, 0.3, {"transfer": None})
    earlier = {"transfer": {"epoch": plan.epoch, "round": plan.round - 1, "moving": False}}
    m.heartbeat(a, 0.4, earlier)
    m.tick(9.0)
    assert m.peers[a].state.value == m.peers[b].state.value == "active"
    m.tick(10.5)
    assert m.peers[a].state.value == m.peers[b].state.value == "dead"


def test_the_commit_bound_counts_from_the_last_progress() -> None:
    m, a, b, plan = _two(heartbeat_timeout=3.0, commit_timeout=30.0)
    assert m.commit(a, 1.0, epoch=plan.epoch, round=plan.round, ok=True).kind == "wait"
    t = 1.0
    while t < 100.0:  # b's transfer keeps moving for 100 s: three commit bounds
        t += 0.5
        m.heartbeat(a, t, _mv(plan, False))
        m.heartbeat(b, t, _mv(plan, True))
        m.tick(t)
    assert m.peers[b].state.value == "active"
    # then b's bytes stop (it still heartbeats): commit_timeout later it is evicted
    while t < 125.0:
        t += 0.5
        m.heartbeat(a, t, _mv(plan, False))
        m.heartbeat(b, t, _mv(plan, False))
        m.tick(t)
    assert m.peers[b].state.value == "active"
    while t < 135.0:
        t += 0.5
        m.heartbeat(a, t, _mv(plan, False))
        m.heartbeat(b, t, _mv(plan, False))
        m.tick(t)
    assert m.peers[b].state.value == "dead" and "last progress" in m.peers[b].reason


def test_the_transfer_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="transfer_heartbeat_timeout"):
        MembershipConfig(transfer_heartbeat_timeout=0.0)
    cfg = MembershipConfig(heartbeat_timeout=5.0, transfer_heartbeat_timeout=2.0)
    assert cfg.silence_bound(True) == 5.0 and cfg.silence_bound(False) == 5.0


def test_a_partner_that_reported_is_no_evidence() -> None:
    # a finished its part and reported; its heartbeats no longer say "moving", which says
    # nothing about b, still receiving over a thin link
    m, a, b, plan = _two(heartbeat_timeout=3.0, transfer_heartbeat_timeout=10.0)
    assert m.commit(a, 1.0, epoch=plan.epoch, round=plan.round, ok=True).kind == "wait"
    for t in (2.0, 4.0, 6.0, 8.0):
        m.heartbeat(a, t, _mv(plan, False))
        m.tick(t)
    assert m.peers[b].state.value == "active"
