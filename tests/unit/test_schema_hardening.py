"""A tensor schema with a dimension no tensor can have is a malformed request naming the field
(the server answers it 400), and aiohttp's record of a request it cannot parse becomes one line."""

from __future__ import annotations

import logging
import math
import sys

import pytest
from aiohttp.http_exceptions import LineTooLong

from isthmus.coordinator import protocol as p
from isthmus.coordinator.httplog import OneLineBadRequests
from isthmus.coordinator.wire import WireError, decode


@pytest.mark.parametrize(
    ("dim", "problem"),
    [
        (math.nan, "expected an integer"),
        (math.inf, "expected an integer"),
        (-1, "is negative"),
        (2.5, "expected an integer"),
        (3.0, "expected an integer"),
        (True, "expected an integer"),
        ("4", "expected an integer"),
        (2**41, "absurdly large"),
    ],
)
def test_a_bad_dimension_is_named(dim: object, problem: str) -> None:
    body = {
        "peer": 1,
        "nonce": "n",
        "revision": 0,
        "schema": [["w", [2, 2], "f"], ["b", [1, dim], "f"]],
    }
    with pytest.raises(WireError) as e:
        decode(p.Begin, body)
    assert e.value.field == "schema[1][1][1]" and problem in str(e.value)


def test_too_many_elements_or_dimensions_are_named() -> None:
    with pytest.raises(WireError, match=r"schema\[0\]\[1\]' declares"):
        decode(
            p.Begin, {"peer": 1, "nonce": "n", "revision": 0, "schema": [["w", [2**30] * 2, "f"]]}
        )
    with pytest.raises(WireError, match="at most 64"):
        decode(p.Begin, {"peer": 1, "nonce": "n", "revision": 0, "schema": [["w", [1] * 65, "f"]]})


def test_good_shapes_still_decode() -> None:
    msg = decode(
        p.Begin,
        {"peer": 1, "nonce": "n", "revision": 0, "schema": [["w", [0, 3], "f"], ["s", [], "f"]]},
    )
    assert msg.schema == (p.TensorSpec("w", (0, 3), "f"), p.TensorSpec("s", (), "f"))


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        "aiohttp.server", logging.ERROR, "x", 1, "Error handling request", (), info
    )


def test_a_malformed_request_is_logged_as_one_line() -> None:
    r = _record(
        LineTooLong("Got more than 8190 bytes when reading Header value is too long.", "8190")
    )
    assert OneLineBadRequests().filter(r)
    assert r.exc_info is None and r.levelno == logging.WARNING
    line = r.getMessage()
    assert line.startswith("malformed HTTP request: LineTooLong: ") and "\n" not in line


def test_a_handler_bug_keeps_its_traceback() -> None:
    r = _record(KeyError("oops"))
    assert OneLineBadRequests().filter(r)
    assert r.exc_info is not None and r.levelno == logging.ERROR
