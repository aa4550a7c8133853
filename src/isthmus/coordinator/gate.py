"""The coordinator's front door: every request passes :meth:`Gate.middleware` before a handler.

In order: ``/healthz`` and the dashboard's own routes pass (the dashboard checks access itself);
the token is checked (:mod:`.auth`) - a refused one costs the caller's address a token of its
failure bucket, and an empty bucket is answered 429; the identity's request bucket (:mod:`.limits`);
admin routes (``/v1/admin/...``) need the admin token (403); requests in a peer's name
(``begin``, ``commit``, ``leave``, ``checkpoint``, ``store``, the websocket) must come from the
identity that registered that peer (403); registrations are bounded per identity and in all
(429). A handler's malformed-request error is answered 400 with its message; anything
unexpected is logged with its traceback and answered 500 with a one-line JSON error (never the
traceback).

The gate also serves the admin API (``POST /v1/admin/revoke {"name"}``) and the rendezvous
store (``POST /v1/store``, :mod:`.store_service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from isthmus.coordinator.auth import Identities, Identity
from isthmus.coordinator.limits import Buckets, Limits, TokenBucket
from isthmus.coordinator.peers import PeerState
from isthmus.coordinator.store_service import RendezvousStore, StoreError

if TYPE_CHECKING:
    from isthmus.coordinator.server import Coordinator

__all__ = ["BadRequest", "Gate"]

log = logging.getLogger("isthmus.coordinator")

_PEER_PATHS = frozenset(
    {"/v1/begin", "/v1/commit", "/v1/leave", "/v1/checkpoint", "/v1/store", "/v1/ws"}
)


class BadRequest(Exception):
    """A malformed request: answered 400 with this message."""


def _error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


class Gate:
    """Authentication, authorization and limits for one coordinator (see the module doc)."""

    def __init__(self, coordinator: Coordinator, limits: Limits, revoked: tuple[str, ...]):
        self.c = coordinator
        self.limits = limits
        self.identities = Identities(coordinator.config.token, revoked)
        self.requests = Buckets(limits.requests_per_s, limits.request_burst)
        self.failures = Buckets(limits.auth_failures_per_s, limits.auth_failure_burst)
        self.registrations = Buckets(limits.registrations_per_s, limits.registration_burst)
        self.store = RendezvousStore(
            lambda: f"isthmus/{coordinator.run_id}/",
            max_keys=limits.max_store_keys,
            max_value_bytes=limits.max_store_value_bytes,
            poll_s=coordinator.config.poll_s,
        )
        self.refused = 0  # requests answered 401/403/429 (for tests and the log)

    def install(self, app: web.Application) -> None:
        app.add_routes(
            [
                web.post("/v1/store", self._store),
                web.post("/v1/admin/revoke", self._revoke),
            ]
        )

    # -- the middleware ---------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if request.path == "/healthz" or self.c.web.handles(request.path):
                return await handler(request)  # the dashboard's routes check access themselves
            refusal = await self._admit(request)
            if refusal is not None:
                self.refused += 1
                return refusal
            return await handler(request)
        except (BadRequest, StoreError) as e:
            return _error(400, f"bad request to {request.path}: {e}")
        except web.HTTPException:
            raise  # aiohttp's own answers (404, 405, 413 ...)
        except Exception:
            log.exception("error handling %s %s", request.method, request.path)
            return _error(500, f"internal error handling {request.path} (see the coordinator log)")

    async def _admit(self, request: web.Request) -> web.Response | None:
        now = time.monotonic()
        who = self.who(request)
        if not isinstance(who, Identity):
            if not self.failures.take(request.remote or "?", now):
                return _error(429, f"too many refused requests from {request.remote}; slow down")
            return _error(401, who)
        if not self.requests.take(who.name, now):
            return _error(429, f"{who.name} is over its request rate; slow down")
        if request.path.startswith("/v1/admin/") and not who.admin:
            return _error(
                403, f"{request.path} needs the admin token ({who.name} holds a join token)"
            )
        if request.path in _PEER_PATHS and not who.admin:
            pid = await self._peer_of(request)
            if not self.identities.may_act_for(who, pid):
                return _error(403, f"the token of {who.name!r} may not act for peer {pid}")
        if request.path == "/v1/register":
            return self._may_register(who, now)
        return None

    def who(self, request: web.Request) -> Identity | str:
        """The identity the request's bearer token proves, or why none."""
        header = request.headers.get("Authorization", "")
        return self.identities.check(header[7:] if header.startswith("Bearer ") else "")

    async def _peer_of(self, request: web.Request) -> int:
        raw: Any
        if request.method == "GET":
            raw = request.query.get("peer", "")
        else:
            body = await self.json(request)
            raw = body.get("peer")
        try:
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        except (TypeError, ValueError):
            raise BadRequest("field 'peer' must be the peer id") from None

    def _live(self, pids: list[int]) -> int:
        peers = self.c.membership.peers
        return sum(1 for p in pids if p in peers and peers[p].state is PeerState.ACTIVE)

    def _may_register(self, who: Identity, now: float) -> web.Response | None:
        if not self.registrations.take(who.name, now):
            return _error(429, f"{who.name} registers too often; slow down")
        if not who.admin:
            held = self._live(self.identities.peers_of(who.name))
            if held >= self.limits.max_peers_per_identity:
                return _error(
                    429,
                    f"{who.name} already holds {held} live peers "
                    f"(limits.max_peers_per_identity={self.limits.max_peers_per_identity})",
                )
        with self.c._lock:
            live = sum(1 for p in self.c.membership.peers.values() if p.state is PeerState.ACTIVE)
        if live >= self.limits.max_peers:
            return _error(429, f"the run is full ({live} live peers, limits.max_peers)")
        return None

    def bind(self, request: web.Request, pid: int) -> None:
        """Peer ``pid`` was just registered by the request's identity."""
        who = self.who(request)  # checked again (cheap): the gate let it in
        if isinstance(who, Identity):
            self.identities.bind(pid, who)
        if len(self.identities.owner) > 2 * self.limits.max_peers:
            self.identities.forget(set(self.c.membership.peers))

    def ws_bucket(self) -> TokenBucket:
        """The message bucket of one heartbeat websocket."""
        return TokenBucket(self.limits.ws_messages_per_s, self.limits.ws_burst, time.monotonic())

    @staticmethod
    async def json(request: web.Request) -> dict[str, Any]:
        """The request's JSON object body (read once, cached by aiohttp). Raises BadRequest."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON ({e})") from e
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    # -- handlers ---------------------------------------------------------------------------------
    async def _store(self, request: web.Request) -> web.Response:
        body = await self.json(request)
        stale = self.c._stale_run(body.get("run"))
        if stale is not None:
            return _error(409, stale)
        return web.json_response(await self.store.handle(body))

    async def _revoke(self, request: web.Request) -> web.Response:
        """Refuse a join token from now on and evict its live peers (their next request is
        refused, their heartbeat connection is closed)."""
        body = await self.json(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise BadRequest("field 'name' must be the join token's name")
        try:
            pids = self.identities.revoke(name)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        reason = f"the join token of {name!r} was revoked by the operator"
        evicted = []
        with self.c._lock:
            now = self.c._now()
            for pid in pids:
                p = self.c.membership.peers.get(pid)
                if p is not None and p.state is PeerState.ACTIVE:
                    self.c.membership.remove(pid, now, reason, state=PeerState.REFUSED)
                    evicted.append(pid)
            self.c.membership.note(now, "revoked", name=name, peers=evicted)
        self.c._mutated()
        for pid in evicted:
            ws = self.c._sockets.get(pid)
            if ws is not None and not ws.closed:
                await self.c._send(ws, {"type": "evicted", "reason": reason})
                with contextlib.suppress(Exception):  # bounded: it may never answer the close
                    await asyncio.wait_for(ws.close(), 1.0)
        log.warning("revoked %s; evicted peers %s", name, evicted)
        return web.json_response({"revoked": name, "evicted": evicted})
