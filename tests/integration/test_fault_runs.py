"""Fault tolerance with real processes: SIGKILL mid-collective, joins, SIGSTOP, corruption."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import assert_bitwise_equal


def test_sigkill_mid_collective_survivors_retry_and_end_bitwise_equal(cluster):
    c = cluster(start_peers=3)
    c.spawn("a", steps=30)
    c.spawn("b", steps=30, faults=["kill@collective:step=10"])
    c.spawn("c", steps=30)
    codes = c.wait()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0}, c.log("b")
    st = c.coord.status(events=500)
    # the round b was in never committed: it aborted for everyone and was retried
    assert st["counters"]["rounds_aborted"] >= 1
    assert st["counters"]["rounds_committed"] == 30
    aborts = [e for e in st["events"] if e["kind"] == "abort"]
    assert any(e["round"] == 10 for e in aborts)
    fa, fc = c.final("a"), c.final("c")
    assert fa["step"] == fc["step"] == 30 and fa["revision"] == 30
    assert fa["digest"] == fc["digest"]
    assert_bitwise_equal(c.state("a"), c.state("c"))
    # the survivors' record of round 10: one aborted attempt, then a commit with world 2
    r10 = [r for r in fa["rounds"] if r["round"] == 10]
    assert r10[0]["outcome"] == "aborted" and r10[-1]["outcome"] == "committed"
    assert r10[-1]["world"] == 2


@pytest.mark.slow  # the DiLoCo family's kill in a collective: test_strategies (streaming)
def test_diloco_kill_during_outer_allreduce_keeps_parity(cluster):
    c = cluster(start_peers=3)
    opts = {"sync_every": 5}
    c.spawn("a", strategy="diloco", strategy_options=opts, steps=30)
    c.spawn(
        "b", strategy="diloco", strategy_options=opts, steps=30, faults=["kill@collective:step=10"]
    )
    c.spawn("c", strategy="diloco", strategy_options=opts, steps=30)
    codes = c.wait()
    assert codes["b"] == -signal.SIGKILL and codes["a"] == 0 and codes["c"] == 0
    assert c.coord.status()["counters"]["rounds_aborted"] >= 1
    assert c.final("a")["step"] == 30
    assert_bitwise_equal(c.state("a"), c.state("c"))


@pytest.mark.slow  # joiners are in make test through the checkpoint, model-state and compression runs
def test_joiner_receives_verified_state_and_contributes(cluster):
    c = cluster(start_peers=2)
    # a long enough run that the joiner (a fresh interpreter: seconds to start) arrives mid-run
    c.spawn("a", steps=80, step_delay=0.1)
    c.spawn("b", steps=80, step_delay=0.1)
    c.wait_until(lambda s: s["revision"] >= 5, "5 committed rounds")
    c.spawn("j", steps=80, step_delay=0.1)
    assert c.wait() == {"a": 0, "b": 0, "j": 0}
    st = c.coord.status(events=500)
    assert st["counters"]["resyncs"] >= 1
    resync = [e for e in st["events"] if e["kind"] == "resync"]
    assert resync, "the joiner was never resynced"
    fj = c.final("j")
    first = fj["rounds"][0]
    assert first["resynced"] and first["outcome"] == "committed"
    # after its resync round it contributed to committed rounds of world 3
    later = [r for r in fj["rounds"][1:] if r["outcome"] == "committed"]
    assert later and all(not r["resynced"] for r in later)
    assert any(r["world"] == 3 for r in later)
    assert fj["bytes_sent"] > 0
    assert_bitwise_equal(c.state("a"), c.state("j"))
    assert_bitwise_equal(c.state("a"), c.state("b"))


@pytest.mark.slow  # test_silent_peer.py stops and resumes a member inside a collective
def test_sigstop_peer_is_dropped_then_resynced_after_sigcont(cluster):
    c = cluster(start_peers=3, heartbeat_timeout=2.0)
    for n in ("a", "b", "s"):
        c.spawn(n, steps=60, step_delay=0.05, collective_timeout=5.0)
    c.wait_until(lambda st: st["revision"] >= 5, "5 committed rounds")
    stopped = c.procs["s"]
    os.kill(stopped.pid, signal.SIGSTOP)
    st = c.wait_until(
        lambda st: any(p["name"] == "s" and p["state"] == "dead" for p in st["peers"]),
        "the stopped peer to be evicted",
    )
    evicted_at = st["revision"]
    # the others keep training without it
    c.wait_until(lambda st: st["revision"] >= evicted_at + 5, "rounds after the eviction")
    os.kill(stopped.pid, signal.SIGCONT)
    assert c.wait() == {"a": 0, "b": 0, "s": 0}, c.log("s")
    fs = c.final("s")
    assert fs["evictions"] >= 1
    assert any(r["resynced"] for r in fs["rounds"]), "the resumed peer was never resynced"
    st = c.coord.status(events=1000)
    reasons = [e.get("reason", "") for e in st["events"] if e["kind"] == "dead"]
    assert any("no heartbeat" in r for r in reasons)
    assert_bitwise_equal(c.state("a"), c.state("s"))
    assert_bitwise_equal(c.state("a"), c.state("b"))


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "waiting"])
def test_flipped_bit_is_caught_by_hash_and_repaired(cluster, pipelined):
    # x flips a bit of its shared state at the start of its step 10's round. The waiting path
    # hashes the state when it begins round 10: repaired there. A pipelined peer's begin of
    # round 10 went out with its vote on round 9, hashed right after round 9 was applied: the
    # flip shows in the hashes taken after round 10, checked when round 11 forms.
    c = cluster(start_peers=3)
    job = {"steps": 25, "pipeline_commit": pipelined}
    c.spawn("a", **job)
    c.spawn("b", **job)
    c.spawn("x", faults=["corrupt@step:step=10"], **job)
    assert c.wait() == {"a": 0, "b": 0, "x": 0}
    st = c.coord.status(events=500)
    assert st["counters"]["parity_failures"] == 1
    assert st["counters"]["rounds_aborted"] == 0  # a clean end: no round begun after the last
    failures = [e for e in st["events"] if e["kind"] == "parity_failure"]
    assert len(failures) == 1 and failures[0]["tensors"] == [failures[0]["tensors"][0]]
    fx = c.final("x")
    repaired = [r for r in fx["rounds"] if r["resynced"]]
    assert len(repaired) == 1 and repaired[0]["round"] == (11 if pipelined else 10), repaired
    assert_bitwise_equal(c.state("a"), c.state("x"))


def test_coordinator_restart_mid_run_resumes_at_the_highest_revision(cluster):
    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    c = cluster(start_peers=2)
    port = c.coord.port
    c.spawn("a", steps=60, step_delay=0.05, connect_timeout=30.0)
    c.spawn("b", steps=60, step_delay=0.05, connect_timeout=30.0)
    c.wait_until(lambda s: s["revision"] >= 10, "10 committed rounds")
    c.coord.stop()
    # a new coordinator, same address, knows nothing about the run
    c.coord = Coordinator(
        CoordinatorConfig(
            token=c.coord.config.token,
            port=port,
            heartbeat_interval=0.25,
            membership=MembershipConfig(heartbeat_timeout=3.0, start_peers=2),
        )
    ).start()
    assert c.wait() == {"a": 0, "b": 0}, c.log("a")
    fa, fb = c.final("a"), c.final("b")
    assert fa["step"] == fb["step"] == 60 and fa["revision"] == 60
    assert fa["evictions"] >= 1  # told by the new coordinator that its old id is unknown
    st = c.coord.status(events=500)
    assert st["revision"] == 60 and st["counters"]["rounds_committed"] < 60
    assert_bitwise_equal(c.state("a"), c.state("b"))


def test_pipelined_commit_a_kill_after_the_vote_and_an_abort_after_others_voted(cluster):
    # pipeline_commit: each peer votes in the background and applies its result tentatively.
    # b dies at the start of step 10, after its vote on round 9 went out; c fails round 20 at
    # its commit, after a and c's partner had voted ok and applied it: they undo, and round 20
    # is retried from the restored state.
    c = cluster(start_peers=3)
    job = {"steps": 30}  # pipeline_commit is the default
    c.spawn("a", **job)
    c.spawn("b", faults=["kill@step:step=10"], **job)
    c.spawn("c", faults=["fail@commit:round=20"], **job)
    codes = c.wait()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0}, c.log("a")
    st = c.coord.status(events=500)
    assert st["counters"]["rounds_committed"] == 30
    aborts = [e["round"] for e in st["events"] if e["kind"] == "abort"]
    # b's death may abort round 9 or 10 (it voted on 9 in the background, its begin of 10
    # may have formed it); nothing after 20: the last round (29) began no round 30
    assert 20 in aborts and max(aborts) == 20, aborts
    fa, fc = c.final("a"), c.final("c")
    assert fa["revision"] == fc["revision"] == 30 and fa["step"] == fc["step"] == 30
    assert fa["digest"] == fc["digest"]
    assert_bitwise_equal(c.state("a"), c.state("c"))
    # a learned round 20's abort after it had applied it: one aborted attempt, then a commit
    r20 = [r for r in fa["rounds"] if r["round"] == 20]
    assert [r["outcome"] for r in r20] == ["aborted", "committed"], r20
    assert "undone" in c.log("a")
