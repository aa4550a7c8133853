"""The membership with the partition rule wired in (one process, a fake clock): members that
report each other unreachable sit out one of them, the isolated one is told why and waits, is
taken back after a probe connects, a failed pair is never formed again without a change, and a
round that keeps aborting for one cause stops with it."""

from __future__ import annotations

from typing import Any

from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import ProbeOutcome, RoundPlan, TensorSpec, Unreached

SCHEMA = [TensorSpec("w", (2, 3), "torch.float32")]
GOOD = {"w": "aa"}


class Run:
    def __init__(self, **cfg: Any) -> None:
        self.now = 0.0
        self.m = Membership(MembershipConfig(**cfg))
        self.nonce: dict[int, int] = {}

    def add(self, name: str) -> int:
        return self.m.register(name, self.now, {"probe": f"10.0.0.{len(self.m.peers) + 2}:4100"})

    def begin(self, pid: int, hashes: dict[str, str] | None = GOOD) -> Any:
        self.nonce[pid] = self.nonce.get(pid, 0) + 1
        return self.m.begin(
            pid,
            self.now,
            nonce=str(self.nonce[pid]),
            revision=self.m.peers[pid].revision or 0,
            hashes=hashes,
            schema=SCHEMA,
        )

    def poll(self, pid: int) -> Any:
        return self.m.poll_begin(pid, str(self.nonce[pid]))

    def commit(self, pid: int, plan: RoundPlan, ok: bool = True, **kw: Any) -> Any:
        return self.m.commit(pid, self.now, epoch=plan.epoch, round=plan.round, ok=ok, **kw)

    def tick(self, dt: float) -> None:
        self.now += dt
        for p in self.m.peers.values():
            p.last_seen = self.now
        self.m.tick(self.now)


def _four() -> tuple[Run, list[int], RoundPlan]:
    r = Run(start_peers=4)
    pids = [r.add(n) for n in ("peer0", "peer1", "peer2", "peer3")]
    for pid in pids:
        r.begin(pid)
    plan = r.poll(pids[0]).plan
    assert plan is not None and plan.members == tuple(pids)
    for pid in pids:
        r.commit(pid, plan)
    assert r.m.revision == 1
    return r, pids, plan


def _cut(r: Run, pids: list[int], how: str = "timed out") -> RoundPlan:
    """Round 1 forms with all four; peer1 and peer2 report each other unreachable."""
    for pid in pids:
        r.begin(pid)
    plan = r.poll(pids[0]).plan
    assert plan is not None and len(plan.members) == 4
    # the plan carries every member's probe listener
    assert plan.reach == {str(p): r.m.peers[p].info["probe"] for p in pids}
    a, b = pids[1], pids[2]
    r.commit(a, plan, ok=False, error="x", unreached=(Unreached(b, "10.0.0.4:4100", how),))
    r.commit(b, plan, ok=False, error="y", unreached=(Unreached(a, "10.0.0.3:4100", how),))
    assert r.m.counters["rounds_aborted"] == 1
    return plan


def test_two_of_four_that_cannot_reach_each_other_leave_three_and_the_fourth_is_told_why() -> None:
    r, pids, _ = _four()
    _cut(r, pids)
    for pid in pids:
        r.begin(pid)
    plan = r.poll(pids[0]).plan
    assert plan is not None
    # the more junior end of the broken pair sits out; the three others form a new epoch
    assert plan.members == (pids[0], pids[1], pids[3]) and plan.new_epoch
    d = r.poll(pids[2])
    assert d.kind == "wait"
    assert d.reason == "isolated: cannot reach peer1 at 10.0.0.3:4100 (timed out)"
    st = r.m.status(r.now)
    assert st["isolated"] == {str(pids[2]): d.reason}
    assert [p["isolated"] for p in st["peers"]] == [None, None, d.reason, None]
    assert st["down_pairs"] == [["peer1", "peer2"]]
    assert r.m.counters["isolations"] == 1
    ev = [e for e in r.m.events if e["kind"] == "isolated"]
    assert len(ev) == 1 and ev[0]["name"] == "peer2" and ev[0]["reason"] == d.reason
    # the three commit without waiting for the isolated one; it keeps waiting, still active
    for pid in plan.members:
        r.commit(pid, plan)
    assert r.m.revision == 2
    assert r.m.peers[pids[2]].state.value == "active"


def test_a_failed_pair_is_not_formed_again_until_a_probe_connects() -> None:
    r, pids, _ = _four()
    _cut(r, pids, how="refused")
    r.begin(pids[2])  # it waits in this begin from now on
    for _ in range(3):  # round after round, the pair stays apart
        for pid in (pids[0], pids[1], pids[3]):
            r.begin(pid)
        plan = r.poll(pids[0]).plan
        assert plan is not None and pids[2] not in plan.members
        for pid in plan.members:
            r.commit(pid, plan)
        r.tick(1.0)
    # a failed probe changes nothing
    r.m.heartbeat(pids[1], r.now, {}, probes=(ProbeOutcome(pids[2], False, "refused"),))
    assert r.m.peers[pids[2]].isolated is not None


def test_the_coordinator_asks_the_kept_end_to_probe_and_a_probe_that_connects_readmits() -> None:
    r, pids, _ = _four()
    _cut(r, pids)
    for pid in pids:
        r.begin(pid)
    plan = r.poll(pids[0]).plan
    for pid in plan.members:
        r.commit(pid, plan)
    r.m.take_notices()
    r.tick(5.0)  # probe_every_s after the failure
    probes = [(to, msg) for to, msg in r.m.take_notices() if msg["type"] == "probe"]
    # the kept end (peer1) probes the isolated one's listener
    assert probes == [
        ((pids[1],), {"type": "probe", "reason": "", "peer": pids[2], "address": "10.0.0.4:4100"})
    ]
    r.tick(1.0)  # not asked again within probe_every_s
    assert not [m for _, m in r.m.take_notices() if m["type"] == "probe"]
    r.m.heartbeat(pids[1], r.now, {}, probes=(ProbeOutcome(pids[2], True),))
    assert r.m.peers[pids[2]].isolated is None
    # the back member missed a commit: its state differs (its hashes say so)
    r.begin(pids[2], hashes={"w": "old"})
    for pid in plan.members:
        r.begin(pid)
    plan2 = r.poll(pids[0]).plan
    assert plan2 is not None and plan2.members == tuple(pids) and plan2.new_epoch
    # it takes part as a stale peer: repaired from an in-sync member first
    assert [t.dst for t in plan2.transfers] == [pids[2]]
    assert r.m.counters["readmissions"] == 1
    assert [e["name"] for e in r.m.events if e["kind"] == "readmitted"] == ["peer2"]


def test_a_new_process_under_an_isolated_name_starts_afresh() -> None:
    r, pids, _ = _four()
    _cut(r, pids)
    r.m.remove(pids[2], r.now, "gone")
    assert r.m.reach.down_pairs(["peer1", "peer2"]) == []


def test_a_round_that_aborts_again_and_again_for_one_cause_stops_naming_it() -> None:
    r = Run(start_peers=2, abort_limit=3)
    a, b = r.add("peer0"), r.add("peer1")
    for attempt in range(3):
        r.begin(a)
        r.begin(b)
        plan = r.poll(a).plan
        assert plan is not None, attempt
        r.commit(a, plan, ok=False, error=f"all_reduce did not complete within {30 + attempt}.0s")
    d = r.begin(a)
    assert d.kind == "stopped"
    assert d.reason.startswith("the round aborted 3 times in a row for the same cause: peer 0")
    assert "all_reduce did not complete" in d.reason
    assert r.m.status(r.now)["stopped"] == d.reason
    assert [e["kind"] for e in r.m.events].count("stopped") == 1


def test_different_causes_or_a_commit_end_the_streak() -> None:
    r = Run(start_peers=2, abort_limit=2)
    a, b = r.add("peer0"), r.add("peer1")
    for err in ("boom", "bang", "boom"):
        r.begin(a)
        r.begin(b)
        plan = r.poll(a).plan
        r.commit(a, plan, ok=False, error=err)
    r.begin(a)
    r.begin(b)
    plan = r.poll(a).plan
    assert plan is not None  # never two in a row with one cause
    r.commit(a, plan)
    r.commit(b, plan)
    assert r.m.streak.count == 0
