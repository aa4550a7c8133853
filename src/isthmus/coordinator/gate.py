"""The coordinator's front door: every request passes :meth:`Gate.middleware` before a handler.

In order: ``/healthz`` and the dashboard's own routes pass (the dashboard checks access itself);
the token is checked (:mod:`.auth`) - a refused one costs the caller's address a token of its
failure bucket, and an empty bucket is answered 429; the identity's request bucket (:mod:`.limits`);
admin routes (``/v1/admin/...``) need the admin token (403); requests in a peer's name
(``begin``, ``commit``, ``leave``, ``checkpoint``, ``store``, the websocket) must come from the
identity that registered that peer (403); registrations are bounded per identity and in all
(429). A handler's :class:`~.bodies.BadRequest` is answered 400 with its message; anything
unexpected is logged with its traceback and answered 500 with a one-line JSON error (never the
traceback).

The gate only decides who may pass: it serves no route of its own. What it needs to know of the
run (how many peers are live) it asks a :class:`Roster`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from aiohttp import web

from isthmus.coordinator.auth import Identities, Identity
from isthmus.coordinator.bodies import BadRequest, error, read_json
from isthmus.coordinator.limits import Buckets, Limits, TokenBucket

__all__ = ["BadRequest", "Gate", "Roster"]

log = logging.getLogger("isthmus.coordinator")

_PEER_PATHS = frozenset(
    {"/v1/begin", "/v1/commit", "/v1/leave", "/v1/checkpoint", "/v1/store", "/v1/ws"}
)


class Roster(Protocol):
    """What the gate asks about the run's peers (the coordinator's :class:`~.hub.Hub`)."""

    def live_peers(self, among: Iterable[int] | None = None) -> int:
        """How many peers (of ``among``, or of all) are active."""
        ...

    def peer_ids(self) -> set[int]:
        """Every peer id still known (active or not)."""
        ...


class Gate:
    """Authentication, authorization and limits for one coordinator (see the module doc).

    ``open_path(path)`` is true for the paths that check access themselves (the dashboard's).
    """

    def __init__(
        self,
        *,
        identities: Identities,
        limits: Limits,
        roster: Roster,
        open_path: Callable[[str], bool],
    ) -> None:
        self.identities = identities
        self.limits = limits
        self.roster = roster
        self.open_path = open_path
        self.requests = Buckets(limits.requests_per_s, limits.request_burst)
        self.failures = Buckets(limits.auth_failures_per_s, limits.auth_failure_burst)
        self.registrations = Buckets(limits.registrations_per_s, limits.registration_burst)
        self.refused = 0  # requests answered 401/403/429 (for tests and the log)

    # -- the middleware ---------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if request.path == "/healthz" or self.open_path(request.path):
                return await handler(request)  # the dashboard's routes check access themselves
            refusal = await self._admit(request)
            if refusal is not None:
                self.refused += 1
                return refusal
            return await handler(request)
        except BadRequest as e:
            return error(400, f"bad request to {request.path}: {e}")
        except web.HTTPException:
            raise  # aiohttp's own answers (404, 405, 413 ...)
        except Exception:
            log.exception("error handling %s %s", request.method, request.path)
            return error(500, f"internal error handling {request.path} (see the coordinator log)")

    async def _admit(self, request: web.Request) -> web.Response | None:
        now = time.monotonic()
        who = self.who(request)
        if not isinstance(who, Identity):
            if not self.failures.take(request.remote or "?", now):
                return error(429, f"too many refused requests from {request.remote}; slow down")
            return error(401, who)
        if not self.requests.take(who.name, now):
            return error(429, f"{who.name} is over its request rate; slow down")
        if request.path.startswith("/v1/admin/") and not who.admin:
            return error(
                403, f"{request.path} needs the admin token ({who.name} holds a join token)"
            )
        if request.path in _PEER_PATHS and not who.admin:
            pid = await self._peer_of(request)
            if not self.identities.may_act_for(who, pid):
                return error(403, f"the token of {who.name!r} may not act for peer {pid}")
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
            body = await read_json(request)
            raw = body.get("peer")
        try:
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        except (TypeError, ValueError):
            raise BadRequest("field 'peer' must be the peer id") from None

    def _may_register(self, who: Identity, now: float) -> web.Response | None:
        if not self.registrations.take(who.name, now):
            return error(429, f"{who.name} registers too often; slow down")
        if not who.admin:
            held = self.roster.live_peers(self.identities.peers_of(who.name))
            if held >= self.limits.max_peers_per_identity:
                return error(
                    429,
                    f"{who.name} already holds {held} live peers "
                    f"(limits.max_peers_per_identity={self.limits.max_peers_per_identity})",
                )
        live = self.roster.live_peers()
        if live >= self.limits.max_peers:
            return error(429, f"the run is full ({live} live peers, limits.max_peers)")
        return None

    # -- what handlers ask of it ------------------------------------------------------------------
    def bind(self, request: web.Request, pid: int) -> None:
        """Peer ``pid`` was just registered by the request's identity."""
        who = self.who(request)  # checked again (cheap): the gate let it in
        if isinstance(who, Identity):
            self.identities.bind(pid, who)
        if len(self.identities.owner) > 2 * self.limits.max_peers:
            self.identities.forget(self.roster.peer_ids())

    def ws_bucket(self) -> TokenBucket:
        """The message bucket of one heartbeat websocket."""
        return TokenBucket(self.limits.ws_messages_per_s, self.limits.ws_burst, time.monotonic())
