"""The operator's API: ``POST /v1/admin/revoke {"name"}``.

A revocation refuses the join token of ``name`` from then on (:meth:`~.auth.Identities.revoke`)
and evicts its live peers: they are marked refused in the membership (a round they are in
aborts), their heartbeat socket gets ``{"type": "evicted", "reason": ...}`` and is closed, and
their next request is refused. The answer is ``{"revoked": name, "evicted": [peer ids]}``; a
name no join token can carry (the admin's) is answered 400.

The gate lets only the admin token reach ``/v1/admin/``; this module trusts that.
"""

from __future__ import annotations

import logging

from aiohttp import web

from isthmus.coordinator.auth import Identities
from isthmus.coordinator.bodies import BadRequest, read_json
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.peers import PeerState

__all__ = ["AdminAPI"]

log = logging.getLogger("isthmus.coordinator")


class AdminAPI:
    """The admin routes of one coordinator: its credentials and its shared state."""

    def __init__(self, identities: Identities, hub: Hub) -> None:
        self.identities = identities
        self.hub = hub

    def install(self, app: web.Application) -> None:
        app.add_routes([web.post("/v1/admin/revoke", self._revoke)])

    async def _revoke(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name = body.get("name")
        if not isinstance(name, str):
            raise BadRequest("field 'name' must be the join token's name")
        evicted = await self.revoke(name)
        return web.json_response({"revoked": name, "evicted": evicted})

    async def revoke(self, name: str) -> list[int]:
        """Revoke ``name`` and evict its live peers (call on the coordinator's loop); returns
        the evicted peer ids. Raises :class:`~.bodies.BadRequest` for a name that cannot be
        revoked."""
        try:
            pids = self.identities.revoke(name)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        reason = f"the join token of {name!r} was revoked by the operator"
        hub, m = self.hub, self.hub.membership
        evicted = []
        with hub.lock:
            now = hub.now()
            for pid in pids:
                if m.is_active(pid):
                    m.remove(pid, now, reason, state=PeerState.REFUSED)
                    evicted.append(pid)
            m.note(now, "revoked", name=name, peers=evicted)
        hub.mutated()
        for pid in evicted:
            await hub.disconnect(pid, {"type": "evicted", "reason": reason})
        log.warning("revoked %s; evicted peers %s", name, evicted)
        return evicted
