"""Gossip training with real processes: a single final merge makes every peer bit-identical; a
peer killed mid-exchange leaves the graph rewired and the others training to the end; a joiner
starts from a copy of a member's model."""

from __future__ import annotations

import os
import signal

import pytest


def _gossip(c, name, steps, **options):
    fields = options.pop("job", {})
    return c.spawn(
        name,
        strategy="gossip",
        strategy_options=options,
        steps=steps,
        shard="contiguous",  # non-IID: the peers' models really drift apart between merges
        **fields,
    )


@pytest.mark.slow  # the kill and join runs below end with the same merge
def test_single_final_merge_makes_every_peer_bitwise_identical(cluster):
    c = cluster(start_peers=3)
    for n in ("a", "b", "c"):
        _gossip(c, n, 12, topology="ring", schedule="single_merge")
    assert c.wait() == {"a": 0, "b": 0, "c": 0}
    finals = {n: c.final(n) for n in "abc"}
    digests = {f["model_digest"] for f in finals.values()}
    assert len(digests) == 1, digests
    for f in finals.values():
        m = f["strategy"]
        assert f["step"] == 12
        # one start round, no gossip at all, one merge
        assert m["rounds_by_kind"] == {"membership": 0, "gossip": 0, "merge": 1, "start": 1}
        assert m["trained_steps"] == 12
        # the peers trained on different shards, so they had drifted apart before the merge
        assert m["merge_consensus_distance"] > 1e-3
        assert "send" not in f["bytes_by_op"]  # no point-to-point gossip was sent
    # the shared state is only the step counter, identical too
    assert len({f["digest"] for f in finals.values()}) == 1
    assert c.coord.status()["counters"]["rounds_committed"] == 2


def test_peer_killed_mid_exchange_rewires_the_graph_and_the_rest_finish(cluster):
    # a 10 s heartbeat bound: x's death is seen at once (its sockets close); a live peer left
    # out of a later round (quiet under make test's load) is allowed below
    c = cluster(start_peers=4, heartbeat_timeout=10.0)
    opts = {"topology": "barabasi-albert:m=2", "schedule": "constant:every=2", "rebuild": "repair"}
    for n in ("a", "b", "d"):
        _gossip(c, n, 24, **opts)
    _gossip(c, "x", 24, job={"faults": ["kill@collective:step=10"]}, **opts)
    codes = c.wait()
    assert codes == {"a": 0, "b": 0, "d": 0, "x": -signal.SIGKILL}, c.log("x")
    st = c.coord.status(events=1000)
    # x died inside a round: that round aborted for everyone and was retried without it
    assert st["counters"]["rounds_aborted"] >= 1
    finals = [c.final(n) for n in ("a", "b", "d")]
    assert len({f["model_digest"] for f in finals}) == 1
    dead = {e["peer"] for e in st["events"] if e["kind"] == "dead"}
    assert len(dead) == 1
    (x_id,) = dead
    for f in finals:
        assert f["step"] == 24
        m = f["strategy"]
        # the graph was rebuilt without x over the three survivors, and x never came back;
        # under make test's load a survivor was twice left out of one later round (quiet) and
        # taken back, each a change of its own, so only the first rebuild is counted exactly
        changes = m["graph_changes"]
        assert len(changes) >= 2 and changes[1]["departed"] == [x_id], changes
        assert all(x_id not in ch["members"] for ch in changes[1:]), changes
        assert x_id not in m["graph"]["members"] and len(m["graph"]["members"]) == 3
        assert all(x_id not in e for e in m["graph"]["edges"])
        # repair keeps the survivors connected (three peers with min degree 2: a triangle)
        assert len(m["graph"]["edges"]) == 3
        aborted = [r for r in f["rounds"] if r["outcome"] == "aborted"]
        assert aborted and all(r["world"] == 4 for r in aborted)
        later = [
            r
            for r in f["rounds"]
            if r["outcome"] == "committed" and r["round"] > aborted[-1]["round"]
        ]
        assert later and all(r["world"] <= 3 for r in later) and later[-1]["world"] == 3
        assert m["rounds_by_kind"]["merge"] == 1


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow  # the kill run above covers the rewiring; joiners elsewhere
def test_joiner_starts_from_a_copy_and_ends_identical(cluster):
    # The members pause themselves (SIGSTOP, between rounds) until the joiner is waiting for a
    # round, so the joiner arrives mid-run however slowly its interpreter starts; the long
    # heartbeat timeout keeps the paused members from being evicted meanwhile.
    c = cluster(start_peers=2, heartbeat_timeout=120.0)
    opts = {"topology": "ring", "schedule": "constant:every=2"}
    for n in ("a", "b"):
        _gossip(c, n, 30, job={"faults": ["stop@step:step=6"]}, **opts)
    c.wait_until(lambda s: all(_stopped(c.procs[n].pid) for n in "ab"), "a and b to pause", 120)
    _gossip(c, "j", 30, **opts)
    c.wait_until(
        lambda s: any(p["name"] == "j" and p["revision"] is not None for p in s["peers"]),
        "the joiner to wait for a round",
        120,
    )
    for n in "ab":
        os.kill(c.procs[n].pid, signal.SIGCONT)
    assert c.wait() == {"a": 0, "b": 0, "j": 0}, c.log("j")
    fa, fb, fj = c.final("a"), c.final("b"), c.final("j")
    assert fa["model_digest"] == fb["model_digest"] == fj["model_digest"]
    mj = fj["strategy"]
    first = fj["rounds"][0]
    assert first["resynced"] and first["outcome"] == "committed" and first["round"] >= 4
    # the joiner adopted a member's model once, then trained and gossiped as a member
    assert mj["copies_received"] == 1 and mj["rounds_by_kind"]["start"] == 0
    assert 0 < mj["trained_steps"] < 30
    assert any(r["world"] == 3 for r in fj["rounds"][1:])
    assert len(mj["graph"]["members"]) == 3
    for f in (fa, fb):
        assert f["strategy"]["copies_received"] == 0 and f["strategy"]["trained_steps"] == 30
