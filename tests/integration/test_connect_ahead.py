"""The run's first round handed out before its epoch's group is connected (comm/ahead.py), with
real peer processes: the round commits without the group, a group that cannot connect fails
the next round's set-up with the connection's own error, a round 0 with a repair keeps its
group at the begin, and a member dying behind the first round leaves the survivors to form a
new epoch and end bit-identical."""

from __future__ import annotations

import signal

from conftest import assert_bitwise_equal

DILOCO = {"strategy": "diloco", "strategy_options": {"sync_every": 3}}


def test_round_0_commits_without_the_group_and_a_failed_connection_fails_round_1(cluster):
    # Peers given different `connections` cannot connect a group (the handshake refuses), so
    # the run cannot go past its first round that needs one: that round must be round 1, and
    # its set-up must fail naming the setting, with round 0 committed before it.
    c = cluster(start_peers=2)
    job = {**DILOCO, "steps": 6, "collective_timeout": 5.0, "round_timeout": 20.0}
    c.spawn("a", **job)
    c.spawn("b", **job, connections=2)
    codes = c.wait(timeout=120)
    assert codes["a"] != 0 and codes["b"] != 0  # neither could go on
    events = c.coord.events()
    commits = [e for e in events if e["kind"] == "commit"]
    aborts = [e for e in events if e["kind"] == "abort"]
    assert [(e["round"], e["revision"]) for e in commits] == [(0, 1)], commits
    assert aborts and all(e["round"] == 1 for e in aborts), aborts[:3]
    assert "peers disagree on connections" in aborts[0]["reason"]
    assert "setting up round 1 failed" in c.log("a") + c.log("b")


def test_a_member_killed_behind_round_0_and_a_repair_in_round_0_end_in_parity(cluster):
    # c starts from other weights: its round 0 transfers (a repair), so every member connects
    # that round's group at the begin, as before; b dies in the first phase, behind round 0.
    c = cluster(start_peers=3)
    job = {**DILOCO, "steps": 9}
    c.spawn("a", **job)
    c.spawn("b", **job, faults=["kill@step:step=1"])
    c.spawn("c", **job, seed=1)
    codes = c.wait()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0}
    fa, fc = c.final("a"), c.final("c")
    assert fa["step"] == 9
    first = fc["rounds"][0]
    assert (first["round"], first["outcome"], first["world"]) == (0, "committed", 3)
    assert first["resynced"] and not fa["rounds"][0]["resynced"]
    assert fa["rounds"][-1]["outcome"] == "committed" and fa["rounds"][-1]["world"] == 2
    assert_bitwise_equal(c.state("a"), c.state("c"))
