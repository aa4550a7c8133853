"""A link cut after its data was handed to the kernel, on a fake clock: the sending end's
collective completed and it reported, the receiving end waits with nothing in flight. The
coordinator aborts the round once the receiver says nothing moves and the sender's heartbeat
says its data to the receiver has gone unacknowledged past the stall rule, naming the pair (the
partition rule then sits one end out); not while the receiver still sees data arrive (a thin
link), not on a reported member's "nothing moves" alone, and not on evidence about another
epoch, another member or from a member that has not reported."""

from __future__ import annotations

from typing import Any

from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import RoundPlan, TensorSpec

SCHEMA = [TensorSpec("w", (2, 3), "torch.float32")]
GOOD = {"w": "aa"}
NAMES = ("peer0", "peer1", "peer2", "peer3")


class Run:
    """Four peers on a fake clock; every peer heartbeats at each step of :meth:`tick`."""

    def __init__(self, *, no_listener: int | None = None) -> None:
        self.now = 0.0
        self.m = Membership(MembershipConfig(start_peers=4, heartbeat_timeout=3.0))
        self.pids = [
            self.m.register(n, 0.0, {} if i == no_listener else {"probe": f"10.0.0.{i + 2}:4100"})
            for i, n in enumerate(NAMES)
        ]
        self.info: dict[int, dict[str, Any]] = {p: {"transfer": None} for p in self.pids}
        self.nonce = 0

    def round(self) -> RoundPlan:
        self.nonce += 1
        for pid in self.pids:
            if self.m.is_active(pid):
                self.m.begin(
                    pid,
                    self.now,
                    nonce=str(self.nonce),
                    revision=self.m.peers[pid].revision or 0,
                    hashes=GOOD,
                    schema=SCHEMA,
                )
        d = self.m.poll_begin(self.pids[0], str(self.nonce))
        assert d.kind == "go" and d.plan is not None, d
        return d.plan

    def report(self, pid: int, plan: RoundPlan) -> str:
        return self.m.commit(pid, self.now, epoch=plan.epoch, round=plan.round, ok=True).kind

    def tick(self, seconds: float, step: float = 0.5) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += step
            for pid in self.pids:
                self.m.heartbeat(pid, self.now, self.info[pid])
            self.m.tick(self.now)

    def state(self, plan: RoundPlan) -> str:
        return self.m.poll_commit(plan.epoch, plan.round).kind


def _receiving(plan: RoundPlan, moving: bool) -> dict[str, Any]:
    """The heartbeat of a member inside ``plan``'s round (``comm.group.transfer_info``)."""
    return {"transfer": {"epoch": plan.epoch, "round": plan.round, "moving": moving}}


def _silent(plan: RoundPlan, rank: int, for_s: float, epoch: int | None = None) -> dict[str, Any]:
    """The heartbeat of a member that reported: its data to ``rank`` is not acknowledged."""
    e = plan.epoch if epoch is None else epoch
    return {"transfer": {"silent": [{"epoch": e, "rank": rank, "for_s": for_s}]}}


def _cut_at_the_end() -> tuple[Run, RoundPlan, int, int]:
    """Round 0 commits with all four; in round 1 peer0, peer2 and peer3 report and peer1, whose
    last data from peer2 is lost on the cut link, waits with nothing moving."""
    r = Run()
    first = r.round()
    for pid in r.pids:
        r.report(pid, first)
    plan = r.round()
    receiver, sender = r.pids[1], r.pids[2]
    for pid in r.pids:
        if pid != receiver:
            assert r.report(pid, plan) == "wait"
    r.info[receiver] = _receiving(plan, False)
    return r, plan, receiver, sender


def test_the_round_is_held_until_the_sender_sees_its_data_unacknowledged_then_aborts() -> None:
    r, plan, receiver, sender = _cut_at_the_end()
    # the sender finished sending and reported: "nothing moves" on its side is no evidence,
    # and before its stall rule holds it names nobody; the round waits (for commit_timeout,
    # as it did before any of this)
    r.tick(60.0)
    assert r.state(plan) == "wait"
    assert not [e for e in r.m.events if e["kind"] == "unreachable"]
    # the sender's data to the receiver has gone unacknowledged past stall_s, retransmitted
    r.info[sender] = _silent(plan, plan.members.index(receiver), 10.4)
    r.tick(0.5)
    assert r.state(plan) == "aborted"
    abort = [e for e in r.m.events if e["kind"] == "abort"][-1]
    assert "peer2" in abort["reason"] and "peer1" in abort["reason"], abort
    assert "link between them is cut" in abort["reason"]
    unreachable = [e for e in r.m.events if e["kind"] == "unreachable"]
    assert [(e["name"], e["remote_name"], e["how"]) for e in unreachable] == [
        ("peer2", "peer1", "stalled")
    ]
    assert unreachable[0]["address"] == "10.0.0.3:4100"  # the receiver's probe listener
    # the next round sits one end of the pair out, told why; the other three go on
    for pid in r.pids:
        r.info[pid] = {"transfer": None}
    nxt = r.round()
    assert len(nxt.members) == 3 and not {receiver, sender} <= set(nxt.members)
    out = ({receiver, sender} - set(nxt.members)).pop()
    assert (r.m.peers[out].isolated or "").startswith("isolated: "), r.m.peers[out].isolated


def test_a_receiver_that_still_sees_data_arrive_is_not_aborted() -> None:
    # a thin link: the receiver's partner's segments still arrive (it says it moves), so a
    # sender's unacknowledged data says nothing yet; once nothing moves there, it aborts
    r, plan, receiver, sender = _cut_at_the_end()
    r.info[receiver] = _receiving(plan, True)
    r.info[sender] = _silent(plan, plan.members.index(receiver), 12.0)
    r.tick(120.0)
    assert r.state(plan) == "wait"
    r.info[receiver] = _receiving(plan, False)
    r.tick(0.5)
    assert r.state(plan) == "aborted"


def test_evidence_about_another_epoch_member_or_from_an_unreported_member_is_not_used() -> None:
    r, plan, receiver, sender = _cut_at_the_end()
    rank = plan.members.index(receiver)
    # about an earlier epoch (a heartbeat from before this round formed)
    r.info[sender] = _silent(plan, rank, 30.0, epoch=plan.epoch - 1)
    r.tick(5.0)
    # about a member that reported (peer3): its data was received, the sender's view is stale
    r.info[sender] = _silent(plan, plan.members.index(r.pids[3]), 30.0)
    r.tick(5.0)
    # malformed entries are ignored
    r.info[sender] = {"transfer": {"silent": [{"epoch": plan.epoch, "rank": "1"}, 7]}}
    r.tick(5.0)
    assert r.state(plan) == "wait"
    # the receiver's heartbeats say nothing of this round (none arrived since the go)
    r.info[receiver] = {"transfer": None}
    r.info[sender] = _silent(plan, rank, 30.0)
    r.tick(5.0)
    assert r.state(plan) == "wait"
    assert not [e for e in r.m.events if e["kind"] == "unreachable"]


def test_a_member_that_has_not_reported_names_the_member_itself() -> None:
    # two members wait; one of them has data in flight to the other: its own wait gives up
    # on the silent connection and reports the failure naming it, so its heartbeat is not
    # taken for a report
    r = Run()
    first = r.round()
    for pid in r.pids:
        r.report(pid, first)
    plan = r.round()
    a, b = r.pids[1], r.pids[2]
    for pid in (r.pids[0], r.pids[3]):
        r.report(pid, plan)
    r.info[a] = _receiving(plan, False)
    r.info[b] = {**_receiving(plan, False)}
    r.info[b]["transfer"]["silent"] = _silent(plan, plan.members.index(a), 20.0)["transfer"][
        "silent"
    ]
    r.tick(30.0)
    assert r.state(plan) == "wait"


def test_a_receiver_without_a_probe_listener_is_marked_down_and_probes_the_sender() -> None:
    # peer2 (the receiver, the junior end) registered no probe listener: the pair is down all
    # the same, or the next round would form it again and lose another stall_s to the cut
    r = Run(no_listener=2)
    first = r.round()
    for pid in r.pids:
        r.report(pid, first)
    plan = r.round()
    receiver, sender = r.pids[2], r.pids[1]
    assert str(receiver) not in (plan.reach or {})
    for pid in r.pids:
        if pid != receiver:
            r.report(pid, plan)
    r.info[receiver] = _receiving(plan, False)
    r.info[sender] = _silent(plan, plan.members.index(receiver), 10.4)
    r.tick(0.5)
    assert r.state(plan) == "aborted"
    unreachable = [e for e in r.m.events if e["kind"] == "unreachable"]
    assert [(e["name"], e["remote_name"], e["how"], e["address"]) for e in unreachable] == [
        ("peer1", "peer2", "stalled", None)
    ]
    assert r.m.reach.down_pairs(NAMES) == [("peer1", "peer2")]
    for pid in r.pids:
        r.info[pid] = {"transfer": None}
    nxt = r.round()
    assert nxt.members == (r.pids[0], sender, r.pids[3])
    why = "isolated: peer1 cannot reach it at no known address (stalled)"
    assert r.m.peers[receiver].isolated == why
    # the kept end cannot probe a listener the other end lacks: the other end probes its own
    r.m.take_notices()
    r.tick(5.0)
    probes = [(to, msg) for to, msg in r.m.take_notices() if msg["type"] == "probe"]
    assert probes == [
        ((receiver,), {"type": "probe", "reason": "", "peer": sender, "address": "10.0.0.3:4100"})
    ], probes
