"""Members that went quiet are not waited for when a round forms (MembershipConfig.quiet_after):
a second silent member must not hold the survivors until its own eviction."""

import pytest
from test_membership import GOOD, Run, full_round

from isthmus.coordinator.membership import MembershipConfig


def _three(**cfg):
    r = Run(start_peers=3, heartbeat_timeout=3.0, **cfg)
    r.silent = set()
    a, b, c = r.add("a"), r.add("b"), r.add("c")
    full_round(r, [a, b, c])
    return r, a, b, c


def test_quiet_after_defaults_to_a_third_of_the_heartbeat_timeout():
    assert MembershipConfig(heartbeat_timeout=3.0).quiet_after_s == 1.0
    assert MembershipConfig(heartbeat_timeout=3.0, quiet_after=0.5).quiet_after_s == 0.5
    with pytest.raises(ValueError, match="quiet_after"):
        MembershipConfig(quiet_after=0)


def test_a_quiet_member_is_not_waited_for_and_evicted_later():
    r, a, b, c = _three()
    r.silent = {c}  # c stops: no heartbeat from now on
    r.begin(a)
    r.begin(b)
    r.advance(0.5)
    assert r.poll(a).kind == "wait"  # c has been silent for 0.5 s only: waited for
    r.advance(0.6)
    d = r.poll(a)
    assert d.kind == "go" and d.plan.members == (a, b) and d.plan.new_epoch
    quiet = [e for e in r.m.events if e["kind"] == "quiet"]
    assert [e["peer"] for e in quiet] == [c] and "left out of round 1" in quiet[0]["reason"]
    assert r.m.peers[c].state.value == "active"  # not evicted: that is heartbeat_timeout's job
    r.advance(2.0)
    assert r.m.peers[c].state.value == "dead"


def test_a_slow_member_that_heartbeats_is_waited_for():
    r, a, b, c = _three()
    r.begin(a)
    r.begin(b)
    r.advance(2.5)  # c heartbeats but takes its time to begin
    assert r.poll(a).kind == "wait"
    assert r.begin(c).kind == "go"
    assert not [e for e in r.m.events if e["kind"] == "quiet"]


def test_a_quiet_member_left_out_rejoins_resynced_after_missing_a_commit():
    r, a, b, c = _three()
    r.silent = {c}
    r.begin(a)
    r.begin(b)
    r.advance(1.1)
    plan = r.poll(a).plan
    assert plan.members == (a, b)
    assert r.commit(a, plan).kind == "wait" and r.commit(b, plan).kind == "committed"
    r.silent = set()  # c speaks again, one commit behind
    r.begin(c, hashes={"w": "old", "b": "bb"}, revision=1)
    r.begin(a, hashes=GOOD)
    d = r.begin(b, hashes=GOOD)
    assert d.kind == "go" and d.plan.members == (a, b, c)
    assert [t.dst for t in d.plan.transfers] == [c]  # resynced before it takes part


def test_a_ready_peer_that_went_quiet_is_left_out():
    r, a, b, c = _three()
    r.begin(c)  # c is waiting for the round, then stops
    r.silent = {c}
    r.advance(1.1)
    r.begin(a)
    d = r.begin(b)
    assert d.kind == "go" and d.plan.members == (a, b)
