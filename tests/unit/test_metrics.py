"""The coordinator's web side in one process: the run's history (RunView) and the Prometheus
families."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from isthmus.coordinator.web.metrics import RunMetrics
from isthmus.coordinator.web.view import SERIES_CAP, RunView


def _status(**over: Any) -> dict[str, Any]:
    peers = [
        {
            "id": 0,
            "name": "a",
            "state": "active",
            "member": True,
            "in_sync": True,
            "revision": 7,
            "last_heartbeat_s": 0.2,
            "info": {
                "step": 40,
                "loss": 2.5,
                "bytes_sent": 300,
                "bytes_by_op": {"all_reduce": 200, "broadcast": 100},
                "address": "10.0.0.1",
            },
        },
        # "b" registered twice (evicted, came back): its latest registration (id 2) counts
        {"id": 1, "name": "b", "state": "dead", "info": {"bytes_by_op": {"all_reduce": 50}}},
        {
            "id": 2,
            "name": "b",
            "state": "active",
            "member": True,
            "revision": 7,
            "info": {"bytes_sent": 80, "bytes_by_op": {"all_reduce": 80}, "loss": float("nan")},
        },
    ]
    base = {
        "revision": 7,
        "epoch": 3,
        "world": 2,
        "phase": "forming",
        "round": 7,
        "peers": peers,
        "counters": {"rounds_committed": 7, "rounds_aborted": 2, "parity_failures": 1},
        "checkpoint": {"written": 1, "failures": 0, "latest": {"revision": 5, "path": "x", "t": 1}},
    }
    return {**base, **over}


# ---------------------------------------------------------------------------- RunView


def test_the_view_times_rounds_from_formation_to_outcome_and_keeps_abort_reasons() -> None:
    v = RunView()
    assert v.update(1.0, world=0, running=None) == []
    assert v.world == []  # nothing before the first epoch
    v.update(2.0, world=3, running=(1, 0, 2.0), ready_since=[("a", 1.5), ("b", 1.9), ("c", 1.6)])
    done = v.update(
        2.5,
        world=3,
        running=None,
        events=[{"t": 2.4, "kind": "commit", "epoch": 1, "round": 0}],
    )
    assert done == [("committed", pytest.approx(0.4))]
    v.update(3.0, world=3, running=(1, 1, 3.0))
    done = v.update(
        3.2,
        world=2,
        running=None,
        events=[
            {"t": 3.1, "kind": "dead", "peer": 1},
            {"t": 3.1, "kind": "abort", "epoch": 1, "round": 1, "reason": "peer 1 (b) dead"},
        ],
    )
    assert done == [("aborted", pytest.approx(0.1))]
    assert [a["reason"] for a in v.aborts] == ["peer 1 (b) dead"]
    assert [e["kind"] for e in v.recent] == ["dead", "abort"]  # commits are only counted
    assert v.world == [[2.0, 3.0], [3.2, 2.0]]
    # b began round 0 last and the others waited 0.4 s for it
    assert (v.peers["b"].straggled, v.peers["b"].straggle_s) == (1, pytest.approx(0.4))


def test_steps_per_second_come_from_reported_steps_and_drop_to_zero_when_a_peer_stalls() -> None:
    v = RunView()
    for t, step in ((0.0, 0), (1.0, 5), (2.0, 10)):
        v.sample_peers(
            t, [{"name": "a", "state": "active", "last_heartbeat_s": 0, "info": {"step": step}}]
        )
    assert v.peers["a"].steps_per_s(2.0) == pytest.approx(5.0)
    assert v.peers["a"].steps_per_s(2.0 + 10) == 0.0


def test_series_are_thinned_not_cut_past_their_cap() -> None:
    v = RunView()
    for i in range(3 * SERIES_CAP):
        v.update(float(i), world=1 + i % 2, running=None)
    assert len(v.world) <= SERIES_CAP + 1
    assert v.world[0][0] == 0.0 and v.world[-1][0] == 3 * SERIES_CAP - 1  # still the whole run


# ---------------------------------------------------------------------------- Prometheus


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_and_carry_the_status_counters_and_per_peer_bytes() -> None:
    view = RunView()
    m = RunMetrics(lambda: _status(), view, lambda: 10.0)
    m.observe("committed", 0.03)
    fams = _families(m.render().decode())
    one = {n: f.samples[0].value for n, f in fams.items() if len(f.samples) == 1}
    assert one["isthmus_rounds_committed"] == 7 and one["isthmus_rounds_aborted"] == 2
    assert one["isthmus_parity_failures"] == 1 and one["isthmus_resyncs"] == 0
    assert one["isthmus_world_size"] == 2 and one["isthmus_epoch"] == 3
    assert one["isthmus_checkpoint_latest_revision"] == 5
    sent = {
        (s.labels["peer"], s.labels["op"]): s.value for s in fams["isthmus_peer_bytes_sent"].samples
    }
    assert sent == {("a", "all_reduce"): 200, ("a", "broadcast"): 100, ("b", "all_reduce"): 80}
    losses = {s.labels["peer"]: s.value for s in fams["isthmus_peer_loss"].samples}
    assert losses == {"a": 2.5}  # b's NaN is not a loss
    hist = {
        (s.name, s.labels.get("outcome"), s.labels.get("le")): s.value
        for s in fams["isthmus_round_duration_seconds"].samples
    }
    assert hist[("isthmus_round_duration_seconds_count", "committed", None)] == 1
    assert hist[("isthmus_round_duration_seconds_bucket", "committed", "0.05")] == 1
    assert hist[("isthmus_round_duration_seconds_count", "aborted", None)] == 0


def test_isolated_peers_are_a_gauge_and_a_column_of_the_peer_rows() -> None:
    why = "isolated: cannot reach a at 10.0.0.1:4100 (refused)"
    st = _status(isolated={"2": why})
    st["peers"][2]["isolated"] = why
    fams = _families(RunMetrics(lambda: st, RunView(), lambda: 10.0).render().decode())
    assert fams["isthmus_isolated_peers"].samples[0].value == 1
    fams = _families(RunMetrics(lambda: _status(), RunView(), lambda: 10.0).render().decode())
    assert fams["isthmus_isolated_peers"].samples[0].value == 0
    rows = {r["id"]: r["isolated"] for r in RunView().peer_rows(10.0, st)}
    assert rows[2] == why and rows[0] is None
