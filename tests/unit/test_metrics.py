"""The coordinator's web side without peers: the run's history (RunView), the Prometheus
families, and who may see what over HTTP (page, login, cookie, stream, /metrics, metrics port)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.web.metrics import RunMetrics
from isthmus.coordinator.web.view import SERIES_CAP, RunView

TOKEN = "unit-test-token"


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


# ---------------------------------------------------------------------------- over HTTP


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    c = Coordinator(CoordinatorConfig(token=TOKEN, port=0, metrics_port=0)).start()
    yield c
    c.stop()


def _call(
    url: str, *, headers: dict[str, str] | None = None, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    hdrs = {**(headers or {}), **({"Content-Type": "application/json"} if body else {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_without_the_token_the_page_loads_but_no_run_data_does(coordinator: Coordinator) -> None:
    base = f"http://{coordinator.address}"
    status, headers, page = _call(base + "/")
    assert status == 200 and b"needs its token" in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    for path in ("/v1/dashboard/stream", "/v1/dashboard/snapshot", "/v1/dashboard/session",
                 "/metrics", "/v1/status"):  # fmt: skip
        code, _, body = _call(base + path)
        assert code == 401, path
        assert coordinator.run_id.encode() not in body
    assert (
        _call(base + "/v1/dashboard/snapshot", headers={"Authorization": "Bearer nope"})[0] == 401
    )
    assert _call(base + "/login", body={"token": "nope"})[0] == 401
    assert _call(base + "/static/../server.py")[0] == 404


def test_the_login_cookie_opens_the_dashboard_but_not_the_peers_api(
    coordinator: Coordinator,
) -> None:
    base = f"http://{coordinator.address}"
    status, headers, _ = _call(base + "/login", body={"token": TOKEN})
    assert status == 200
    cookie = headers["Set-Cookie"].split(";")[0]
    assert TOKEN not in cookie and "HttpOnly" in headers["Set-Cookie"]
    assert "SameSite=Strict" in headers["Set-Cookie"]
    code, _, body = _call(base + "/v1/dashboard/snapshot", headers={"Cookie": cookie})
    assert code == 200 and json.loads(body)["run"]["id"] == coordinator.run_id
    assert _call(base + "/metrics", headers={"Cookie": cookie})[0] == 200
    # a page elsewhere that rides on the cookie cannot act as a peer
    assert _call(base + "/v1/status", headers={"Cookie": cookie})[0] == 401
    assert _call(base + "/v1/register", headers={"Cookie": cookie}, body={"name": "x"})[0] == 401


def test_the_metrics_port_serves_metrics_without_a_token(coordinator: Coordinator) -> None:
    port = coordinator.web.metrics_port
    assert port is not None and port != coordinator.port
    code, headers, body = _call(f"http://127.0.0.1:{port}/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    assert "isthmus_world_size" in _families(body.decode())
    assert _call(f"http://127.0.0.1:{port}/v1/dashboard/snapshot")[0] == 404  # metrics only


def test_the_event_stream_sends_snapshots(coordinator: Coordinator) -> None:
    req = urllib.request.Request(
        f"http://{coordinator.address}/v1/dashboard/stream",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        lines = [r.readline() for _ in range(4)]
    assert lines[0] == b"retry: 2000\n" and lines[2] == b"event: snapshot\n"
    snap = json.loads(lines[3].removeprefix(b"data: "))
    assert snap["run"]["id"] == coordinator.run_id and snap["peers"] == []


def test_a_metrics_port_that_is_taken_stops_the_coordinator_with_the_address() -> None:
    with Coordinator(CoordinatorConfig(token=TOKEN, port=0)) as first:
        taken = first.port
        with pytest.raises(OSError, match=f"cannot serve /metrics on 127.0.0.1:{taken}"):
            Coordinator(CoordinatorConfig(token=TOKEN, port=0, metrics_port=taken)).start()
