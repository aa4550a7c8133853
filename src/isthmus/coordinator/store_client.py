"""A ``torch.distributed.Store`` whose keys live on the coordinator, reached over its
authenticated (and, with TLS, encrypted) API: the peer's side of
:mod:`isthmus.coordinator.store_service`.

torch calls these methods from its own threads (Gloo's rendezvous); each call is one HTTP
request on the :class:`~isthmus.coordinator.client.CoordinatorClient`'s connection pool, or a
few for a ``get``/``wait`` that waits (each held by the coordinator up to ``hold_s``). Every
call is bounded by the store's timeout, and :meth:`CoordinatorStore.cut` ends every call in
flight and refuses later ones at once: an aborted epoch's rendezvous must not hold its thread
until the timeout (what :class:`~isthmus.comm.wires.Wires` does for TCP sockets).

Failures raise ``torch.distributed.DistStoreError`` (a ``RuntimeError``) naming the key, which
torch passes on to whoever was forming the group.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import time
from typing import Any

import torch.distributed as dist

from isthmus.coordinator.client import CoordinatorClient, CoordinatorError

__all__ = ["CoordinatorStore"]

_StoreError: type[RuntimeError] = getattr(dist, "DistStoreError", RuntimeError)


def _enc(v: bytes | str) -> str:
    return base64.b64encode(v.encode() if isinstance(v, str) else bytes(v)).decode()


class CoordinatorStore(dist.Store):
    """Rendezvous keys on the coordinator, for peer ``peer_id`` of the client's run.

    ``timeout_s`` bounds every call (torch's ``set_timeout`` changes it). Thread-safe."""

    def __init__(
        self, client: CoordinatorClient, peer_id: int, run_id: str, *, timeout_s: float
    ) -> None:
        super().__init__()
        self._client = client
        self._peer = peer_id
        self._run = run_id
        self._timeout_s = timeout_s
        self.cut_reason: str | None = None
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self.requests = 0

    # -- plumbing ---------------------------------------------------------------------------------
    def cut(self, reason: str) -> None:
        """End every call in flight (they raise with ``reason``) and refuse later ones."""
        self.cut_reason = reason
        for f in list(self._inflight):
            f.cancel()

    def _call(self, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        if self.cut_reason is not None:
            raise _StoreError(f"rendezvous store closed: {self.cut_reason}")
        body = {**body, "peer": self._peer, "run": self._run}
        hold = max(0.0, min(2.0, deadline - time.monotonic()))
        body["hold_s"] = hold
        fut = self._client.submit("/v1/store", body, hold + 10.0)
        self._inflight.add(fut)
        self.requests += 1
        try:
            while True:
                try:
                    return fut.result(0.05)  # type: ignore[no-any-return]
                except concurrent.futures.TimeoutError:
                    if self.cut_reason is not None:
                        fut.cancel()
                        raise _StoreError(f"rendezvous store closed: {self.cut_reason}") from None
                    if time.monotonic() > deadline + 15.0:  # hold + the request's own bound
                        fut.cancel()
                        raise _StoreError("rendezvous store request timed out") from None
        except concurrent.futures.CancelledError:
            raise _StoreError(f"rendezvous store closed: {self.cut_reason}") from None
        except CoordinatorError as e:
            raise _StoreError(f"rendezvous store: {e}") from None
        finally:
            self._inflight.discard(fut)

    def _waiting(
        self, body: dict[str, Any], what: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        bound = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            reply = self._call(body, deadline)
            if not reply.get("missing"):
                return reply
            if time.monotonic() >= deadline:
                raise _StoreError(f"rendezvous store: {what} not set within {bound:.0f}s")

    # -- torch.distributed.Store ------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call({"op": "set", "key": key, "value": _enc(value)}, time.monotonic())

    def get(self, key: str) -> bytes:
        reply = self._waiting({"op": "get", "key": key}, f"key {key!r}")
        return base64.b64decode(reply["value"])

    def add(self, key: str, value: int) -> int:
        return int(
            self._call({"op": "add", "key": key, "amount": value}, time.monotonic())["value"]
        )

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        reply = self._call(
            {"op": "compare_set", "key": key, "expected": _enc(expected), "desired": _enc(desired)},
            time.monotonic(),
        )
        return base64.b64decode(reply["value"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        bound = timeout.total_seconds() if timeout is not None else None
        self._waiting({"op": "wait", "keys": list(keys)}, f"keys {list(keys)!r}", bound)

    def check(self, keys: list[str]) -> bool:
        reply = self._call({"op": "check", "keys": list(keys)}, time.monotonic())
        return bool(reply["present"])

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key}, time.monotonic())["deleted"])

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"}, time.monotonic())["value"])

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
