"""The soak's judgement on a hand-made run directory: stalls between commits (and at both ends),
failure-to-commit and detection times on Unix timestamps, hangs, parity, and the report."""

from __future__ import annotations

import json

import pytest

from isthmus.run.record import RunDir, Summary
from isthmus.run.soak import SoakOptions, analyze, write_report

T0 = 1_800_000_000.0


def _run_dir(tmp_path, *, commits, churn, extra=(), parity_failures=0, resources=()):
    rd = RunDir(tmp_path)
    events = [{"t": 5.0, "ts": T0, "kind": "epoch", "members": [0, 1, 2], "epoch": 1}]
    events += [
        {"t": 99.0, "ts": T0 + c, "kind": "commit", "round": i} for i, c in enumerate(commits)
    ]
    events += [{"t": 99.0, "ts": T0 + dt, **e} for dt, e in extra]
    rd.write_jsonl("events.jsonl", sorted(events, key=lambda e: e["ts"]))
    rd.write_jsonl(
        "churn.jsonl",
        [{"ts": T0 + dt, "t": dt - 6.0, "action": a, "name": n} for dt, a, n in churn],
    )
    rd.write_jsonl("resources.jsonl", [{"ts": T0 + dt, **r} for dt, r in resources])
    rd.write_summary(
        Summary(
            strategy="ddp",
            rounds_committed=len(commits),
            rounds_aborted=1,
            parity_failures=parity_failures,
        )
    )
    return rd


def test_options_are_validated():
    with pytest.raises(ValueError, match="minutes"):
        SoakOptions(minutes=0, max_stall_s=4)
    with pytest.raises(ValueError, match="hang_s"):
        SoakOptions(minutes=1, max_stall_s=4, hang_s=-1)
    assert SoakOptions(minutes=1, max_stall_s=4).hang_bound_s == 60.0
    assert SoakOptions(minutes=1, max_stall_s=10).hang_bound_s == 100.0


def test_stalls_failures_and_detection_use_unix_time(tmp_path):
    commits = [0.5, 1.0, 1.5, 6.0, 6.5, 7.0]  # a 4.5 s stall after the stop at 1.6
    extra = [
        (4.6, {"kind": "dead", "name": "p2", "reason": "no heartbeat for 3.0s"}),
        (4.6, {"kind": "abort", "round": 3, "reason": "peer 2 (p2) dead: no heartbeat"}),
        (7.5, {"kind": "dead", "name": "p0", "reason": "heartbeat connection closed"}),
        (7.6, {"kind": "dead", "name": "p1", "reason": "heartbeat connection closed"}),
    ]
    # churn t counts from another origin (6 s off): only ts may be compared with events
    rd = _run_dir(tmp_path, commits=commits, churn=[(1.6, "stop", "p2")], extra=extra)
    rep = analyze(rd, SoakOptions(minutes=1, max_stall_s=4.0), scenario="s")
    assert rep.longest_stall_s == 4.5
    assert rep.stalls_over_bound == 1 and not rep.ok
    assert "stall" in rep.reasons[0]
    top = rep.stalls[0]
    assert (top["from_s"], top["to_s"]) == (1.5, 6.0)
    assert any("churn: stop p2" in line for line in top["events"])
    assert rep.failure_to_commit_s["max"] == pytest.approx(4.4)
    assert rep.detection_s["median"] == pytest.approx(3.0)
    assert rep.eviction_to_commit_s["max"] == pytest.approx(1.4)
    # the tail: from the last commit (7.0) to the teardown departures (7.5): no stall
    assert all(s["gap_s"] < 4.5 for s in rep.stalls[1:])
    md = write_report(rd, rep).read_text()
    assert "FAIL" in md and "4.5 s, from 1.5 s to 6.0 s" in md
    assert json.loads((tmp_path / "soak.json").read_text())["longest_stall_s"] == 4.5


def test_a_stall_at_the_end_counts_and_parity_and_hangs_fail(tmp_path):
    commits = [0.5, 1.0]
    extra = [(9.0, {"kind": "dead", "name": "p0", "reason": "heartbeat connection closed"})]
    rows = [
        (float(t), {"name": "p0", "pid": 7, "rss_mb": 300.0 + t, "threads": 7, "fds": 18})
        for t in range(0, 120, 10)
    ]
    rd = _run_dir(
        tmp_path, commits=commits, churn=[], extra=extra, parity_failures=1, resources=rows
    )
    hung = [{"name": "p1", "pid": 8, "why": "no step record for 70s"}]
    rep = analyze(rd, SoakOptions(minutes=10, max_stall_s=4.0), hung=hung)
    assert rep.longest_stall_s == 8.0  # last commit at 1.0, the run ended at 9.0
    assert len(rep.reasons) == 3 and not rep.ok
    res = rep.resources["p0 (pid 7)"]
    assert (
        res["rss_mb_first"] == 360.0 and res["rss_mb_growth"] == 50.0
    )  # after the warm-up (60 s here)
    assert res["fds_growth"] == 0


def test_a_clean_soak_passes(tmp_path):
    commits = [0.2 * i for i in range(1, 50)]
    rd = _run_dir(tmp_path, commits=commits, churn=[])
    rep = analyze(rd, SoakOptions(minutes=1, max_stall_s=1.0))
    assert rep.ok and rep.reasons == [] and rep.longest_stall_s == pytest.approx(0.2)


def test_a_stop_while_not_a_member_is_not_a_detection(tmp_path):
    """p1 is stopped while it is between an eviction and its registration: nobody evicts it, and
    the teardown's departure after its resume is not a detection time."""
    commits = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    extra = [(9.2, {"kind": "dead", "name": "p1", "reason": "heartbeat connection closed"})]
    churn = [(1.0, "stop", "p1"), (9.0, "cont", "p1")]
    rd = _run_dir(tmp_path, commits=commits, churn=churn, extra=extra)
    rep = analyze(rd, SoakOptions(minutes=1, max_stall_s=8.0), scenario="s")
    assert rep.detection_s["n"] == 0
