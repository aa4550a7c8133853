"""The authenticated rendezvous: process groups meet through the coordinator's own API.

torch's ``TCPStore`` has no authentication: anyone who can reach its port can read and
overwrite the keys peers use to find each other (and so redirect a peer's Gloo connections or
stall group formation). Here the coordinator keeps the rendezvous keys itself and serves them at
``POST /v1/store``, behind the same TLS and tokens as every other request; a peer's
:class:`~isthmus.coordinator.store_client.CoordinatorStore` (a ``torch.distributed.Store``)
sends its ``set/get/add/compare_set/wait/check/delete_key`` there.

A request names the peer it comes from (``peer``): the server's gate checks that the token may
act for that peer, so only registered, unrevoked identities reach the keys. A request that names
another run (``run``, from before a coordinator restart) is answered 409. Keys must lie under
``isthmus/<run id>/`` (the session's per-epoch prefixes do). Values are base64 in JSON.

Ops (the body's ``op``) and answers:

* ``set`` key, value -> ``{}``;  ``add`` key, amount -> ``{"value": n}``
* ``compare_set`` key, expected, desired -> ``{"value": current}`` (set when the current value
  is ``expected``, or the key is absent and ``expected`` is empty, like TCPStore)
* ``get`` key, ``wait`` keys: held until present or ``hold_s`` (at most ``poll_s``), then
  ``{"value": ...}`` / ``{}``, or ``{"missing": true}`` (the client asks again, bounded by its
  own timeout)
* ``check`` keys -> ``{"present": bool}``;  ``delete`` key -> ``{"deleted": bool}``;
  ``num_keys`` -> ``{"value": n}``

Bounded: values up to ``max_store_value_bytes``, keys up to 1 KB, at most ``max_store_keys``
keys (the oldest, from finished epochs, are dropped first).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

from isthmus.coordinator.bodies import BadRequest, error, read_json

__all__ = ["RendezvousStore", "StoreError", "StoreRoute"]

MAX_KEY_CHARS = 1024


class StoreError(BadRequest, ValueError):
    """A malformed store request (answered 400 with this message)."""


def _b64(body: dict[str, Any], name: str, limit: int) -> bytes:
    v = body.get(name)
    if not isinstance(v, str):
        raise StoreError(f"field {name!r} must be a base64 string")
    if len(v) > limit * 4 // 3 + 4:
        raise StoreError(f"field {name!r} is longer than the store's limit of {limit} bytes")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as e:
        raise StoreError(f"field {name!r} is not base64: {e}") from None


def _enc(v: bytes) -> str:
    return base64.b64encode(v).decode()


class RendezvousStore:
    """The keys, and the ops on them (call from the coordinator's event loop only)."""

    def __init__(
        self,
        prefix: Callable[[], str],
        *,
        max_keys: int,
        max_value_bytes: int,
        poll_s: float,
    ) -> None:
        self._prefix = prefix
        self.max_keys = max_keys
        self.max_value_bytes = max_value_bytes
        self.poll_s = poll_s
        self.data: OrderedDict[str, bytes] = OrderedDict()
        self.dropped = 0
        self._changed: asyncio.Event | None = None
        self.ops = 0

    def _key(self, v: object) -> str:
        if not isinstance(v, str) or not v:
            raise StoreError("store keys must be non-empty strings")
        if len(v) > MAX_KEY_CHARS:
            raise StoreError(f"store keys are at most {MAX_KEY_CHARS} characters")
        p = self._prefix()
        if not v.startswith(p):
            raise StoreError(f"store keys of this run start with {p!r}")
        return v

    def _keys(self, body: dict[str, Any]) -> list[str]:
        keys = body.get("keys")
        if not isinstance(keys, list) or not 0 < len(keys) <= 1024:
            raise StoreError("field 'keys' must be a list of 1 to 1024 keys")
        return [self._key(k) for k in keys]

    def _put(self, key: str, value: bytes) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.max_keys:
            self.data.popitem(last=False)
            self.dropped += 1
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _until(self, present: Callable[[], bool], hold_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        while not present():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one store request. Raises :class:`StoreError` for a malformed one."""
        self.ops += 1
        op = body.get("op")
        hold = body.get("hold_s", self.poll_s)
        if not isinstance(hold, (int, float)) or isinstance(hold, bool) or hold != hold:
            raise StoreError("field 'hold_s' must be a number")
        hold_s = min(max(float(hold), 0.0), self.poll_s)
        if op == "set":
            self._put(self._key(body.get("key")), _b64(body, "value", self.max_value_bytes))
            return {}
        if op == "get":
            key = self._key(body.get("key"))
            if await self._until(lambda: key in self.data, hold_s):
                return {"value": _enc(self.data[key])}
            return {"missing": True}
        if op == "wait":
            keys = self._keys(body)
            ok = await self._until(lambda: all(k in self.data for k in keys), hold_s)
            return {} if ok else {"missing": True}
        if op == "check":
            keys = self._keys(body)
            return {"present": all(k in self.data for k in keys)}
        if op == "add":
            key = self._key(body.get("key"))
            amount = body.get("amount")
            if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) > 2**62:
                raise StoreError("field 'amount' must be an integer")
            try:
                cur = int(self.data.get(key, b"0"))
            except ValueError:
                raise StoreError(f"key {key!r} does not hold an integer") from None
            new = cur + amount
            if abs(new) > 2**62:
                raise StoreError(f"key {key!r} would overflow")
            self._put(key, str(new).encode())
            return {"value": new}
        if op == "compare_set":
            key = self._key(body.get("key"))
            expected = _b64(body, "expected", self.max_value_bytes)
            desired = _b64(body, "desired", self.max_value_bytes)
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._put(key, desired)
                return {"value": _enc(desired)}
            return {"value": _enc(expected if cur is None else cur)}
        if op == "delete":
            key = self._key(body.get("key"))
            return {"deleted": self.data.pop(key, None) is not None}
        if op == "num_keys":
            return {"value": len(self.data)}
        raise StoreError(
            f"unknown store op {op!r} (set, get, add, compare_set, wait, check, delete, num_keys)"
        )


class StoreRoute:
    """``POST /v1/store`` of one coordinator: a request naming another run (``stale_run(run)``
    says why) is answered 409, any other goes to ``store``."""

    def __init__(self, store: RendezvousStore, stale_run: Callable[[object], str | None]) -> None:
        self.store = store
        self.stale_run = stale_run

    def install(self, app: web.Application) -> None:
        app.add_routes([web.post("/v1/store", self._handle)])

    async def _handle(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        stale = self.stale_run(body.get("run"))
        if stale is not None:
            return error(409, stale)
        return web.json_response(await self.store.handle(body))
