"""The coordinator's web side over HTTP, without peers: who may see what (page, login, cookie,
stream, /metrics, metrics port)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from isthmus.coordinator.server import Coordinator, CoordinatorConfig

TOKEN = "unit-test-token"


# ---------------------------------------------------------------------------- Prometheus


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


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
