"""The coordinator's rendezvous store: torch's store semantics and its bounds (one process)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from isthmus.coordinator.store_service import RendezvousStore, StoreError

P = "isthmus/run1/"


def b64(v: bytes) -> str:
    return base64.b64encode(v).decode()


def make(**kw: Any) -> RendezvousStore:
    kw.setdefault("max_keys", 100)
    kw.setdefault("max_value_bytes", 1024)
    kw.setdefault("poll_s", 0.5)
    return RendezvousStore(lambda: P, **kw)


def test_set_get_add_compare_set_check_delete() -> None:
    async def go() -> None:
        s = make()
        assert await s.handle({"op": "set", "key": P + "a", "value": b64(b"1.2.3.4 5")}) == {}
        assert await s.handle({"op": "get", "key": P + "a"}) == {"value": b64(b"1.2.3.4 5")}
        assert (await s.handle({"op": "add", "key": P + "n", "amount": 2}))["value"] == 2
        assert (await s.handle({"op": "add", "key": P + "n", "amount": 3}))["value"] == 5
        cs = {"op": "compare_set", "key": P + "c", "expected": b64(b""), "desired": b64(b"x")}
        assert (await s.handle(cs))["value"] == b64(b"x")
        cs2 = {**cs, "expected": b64(b"y"), "desired": b64(b"z")}
        assert (await s.handle(cs2))["value"] == b64(b"x"), "a wrong expectation changes nothing"
        assert (await s.handle({"op": "check", "keys": [P + "a", P + "c"]}))["present"]
        assert not (await s.handle({"op": "check", "keys": [P + "a", P + "zz"]}))["present"]
        assert (await s.handle({"op": "delete", "key": P + "a"}))["deleted"]
        assert (await s.handle({"op": "get", "key": P + "a", "hold_s": 0})) == {"missing": True}

    asyncio.run(go())


def test_a_get_waits_for_the_set_and_a_wait_is_bounded() -> None:
    async def go() -> None:
        s = make(poll_s=5.0)
        getter = asyncio.ensure_future(s.handle({"op": "get", "key": P + "k", "hold_s": 5}))
        waiter = asyncio.ensure_future(s.handle({"op": "wait", "keys": [P + "k"], "hold_s": 5}))
        await asyncio.sleep(0.01)
        assert not getter.done()
        await s.handle({"op": "set", "key": P + "k", "value": b64(b"v")})
        assert await getter == {"value": b64(b"v")}
        assert await waiter == {}
        # held no longer than asked (and than poll_s)
        assert await s.handle({"op": "wait", "keys": [P + "q"], "hold_s": 0.01}) == {
            "missing": True
        }

    asyncio.run(go())


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"op": "set", "key": "other/run/a", "value": b64(b"x")}, "start with"),
        ({"op": "set", "key": P + "a", "value": "not base64!"}, "base64"),
        ({"op": "set", "key": P + "a", "value": b64(b"x" * 2000)}, "limit"),
        ({"op": "set", "key": P + "a" * 2000, "value": b64(b"x")}, "at most"),
        ({"op": "add", "key": P + "a", "amount": "1"}, "integer"),
        ({"op": "wait", "keys": []}, "1 to 1024"),
        ({"op": "explode"}, "unknown store op"),
        ({"op": "get", "key": P + "a", "hold_s": "x"}, "number"),
    ],
)
def test_malformed_requests_are_refused_with_a_reason(body: dict[str, Any], match: str) -> None:
    with pytest.raises(StoreError, match=match):
        asyncio.run(make().handle(body))


def test_the_oldest_keys_go_first_beyond_the_bound() -> None:
    async def go() -> RendezvousStore:
        s = make(max_keys=10)
        for i in range(25):
            await s.handle({"op": "set", "key": f"{P}e{i}", "value": b64(b"v")})
        return s

    s = asyncio.run(go())
    assert len(s.data) == 10 and s.dropped == 15 and f"{P}e24" in s.data and f"{P}e0" not in s.data
