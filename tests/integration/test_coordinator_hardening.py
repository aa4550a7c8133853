"""Malformed requests are the client's fault: a tensor schema with a dimension no tensor can
have is answered 400 naming the field, and HTTP the server cannot parse is one line in the log,
not a traceback (a real coordinator on loopback, in this process)."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.wire import PROTOCOL_VERSION

TOKEN = "hardening-token"


@pytest.fixture(scope="module")
def coord() -> Iterator[Coordinator]:
    c = Coordinator(CoordinatorConfig(token=TOKEN, port=0, host="127.0.0.1")).start()
    yield c
    c.stop()


def _post(c: Coordinator, path: str, body: str) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{c.port}{path}",
        data=body.encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize(
    ("dim", "problem"),
    [
        ("NaN", "expected an integer"),
        ("Infinity", "expected an integer"),
        ("-Infinity", "expected an integer"),
        ("-3", "is negative"),
        ("2.5", "expected an integer"),
        ("1e300", "expected an integer"),
        ("123456789012345678901234567890", "absurdly large"),
    ],
)
def test_a_schema_dimension_no_tensor_can_have_is_a_400_naming_it(
    coord: Coordinator, dim: str, problem: str
) -> None:
    status, reg = _post(
        coord, "/v1/register", json.dumps({"name": "h", "protocol": PROTOCOL_VERSION})
    )
    assert status == 200
    body = (
        f'{{"peer": {reg["peer_id"]}, "run": "{reg["run_id"]}", "nonce": "n", "revision": 0, '
        f'"schema": [["w", [4, 4], "torch.float32"], ["b", [2, {dim}], "torch.float32"]]}}'
    )
    status, answer = _post(coord, "/v1/begin", body)
    assert status == 400, answer
    text = json.dumps(answer)
    assert "schema[1][1][1]" in text and problem in text, answer


def test_too_many_elements_in_one_tensor_is_a_400(coord: Coordinator) -> None:
    body = json.dumps(
        {"peer": 0, "nonce": "n", "revision": 0, "schema": [["w", [2**30, 2**30], "f"]]}
    )
    status, answer = _post(coord, "/v1/begin", body)
    assert status == 400 and "schema[0][1]" in json.dumps(answer), answer


def test_a_header_too_long_is_one_line_in_the_log(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    with socket.create_connection(("127.0.0.1", coord.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n")
        reply = s.recv(200)
    assert reply.split(b"\r\n")[0].endswith(b"400 Bad Request"), reply
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records, "aiohttp logged nothing about the bad request"
    for r in records:
        assert r.exc_info is None and r.exc_text is None
        line = r.getMessage()
        assert "\n" not in line and line.startswith("malformed HTTP request: "), line
