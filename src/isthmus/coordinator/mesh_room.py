"""The coordinator's side of the run's WireGuard mesh: ``POST /v1/mesh/join`` and
``POST /v1/mesh/view`` (the messages :class:`~.protocol.MeshJoin`, :class:`~.protocol.MeshPoll`,
:class:`~.protocol.MeshView`).

A peer joins with its public key and endpoint candidates, under its own token; the room gives
it an overlay address (the same one again for the same key) and tells it whether others can
send to it (the endpoint it reported is the address the coordinator saw it come from) or it is
behind NAT (it must send first). It never sees a private key.

Who is in the mesh follows the membership: a key is listed while a live peer registered with it
(``info["mesh_key"]``) by the same identity, or for ``grace_s`` after its join while it has not
registered yet. A peer that leaves, dies or is evicted drops out of every member's view at that
change, and a revoked identity's keys at once, before its peers' eviction finishes. Members
long-poll the view and apply each change (:mod:`isthmus.comm.mesh_agent`); a key of another
identity is answered 403.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
from dataclasses import dataclass

from aiohttp import web

from isthmus.coordinator import mesh_protocol as msgs
from isthmus.coordinator import wire
from isthmus.coordinator.auth import Identities, Identity
from isthmus.coordinator.bodies import BadRequest, error, read_json
from isthmus.coordinator.gate import Gate
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.peers import PeerState
from isthmus.mesh.keys import check_public_key
from isthmus.mesh.plan import DEFAULT_NETWORK, classify_endpoint, overlay_address, split_endpoint

__all__ = ["MeshRoom"]

MAX_NODES = 10_000
"""Keys the room remembers at most (a join beyond is answered 429)."""


@dataclass
class _Node:
    key: str
    name: str
    identity: str
    address: str
    endpoint: str | None
    relay: bool
    joined_at: float
    linked: bool = False  # a live peer has registered with this key since its last join


class MeshRoom:
    """The mesh's routes of one coordinator and the keys it knows."""

    def __init__(
        self,
        gate: Gate,
        identities: Identities,
        hub: Hub,
        *,
        poll_s: float,
        network: str = DEFAULT_NETWORK,
        keepalive: int = 10,
        grace_s: float = 60.0,
    ) -> None:
        self.gate = gate
        self.identities = identities
        self.hub = hub
        self.poll_s = poll_s
        self.network = network
        self.prefix = ipaddress.ip_network(network).prefixlen
        self.keepalive = keepalive
        self.grace_s = grace_s
        self.nodes: dict[str, _Node] = {}
        self._joins = 0
        self._cached: tuple[tuple[int, ...], msgs.MeshView] | None = None

    def install(self, app: web.Application) -> None:
        app.add_routes(
            [web.post("/v1/mesh/join", self._join), web.post("/v1/mesh/view", self._poll)]
        )

    async def _read(self, request: web.Request, cls: type) -> object:
        try:
            return wire.decode(cls, await read_json(request))
        except wire.WireError as e:
            raise BadRequest(str(e)) from None

    def _who(self, request: web.Request) -> Identity:
        who = self.gate.who(request)
        assert isinstance(who, Identity), "the gate admits only known identities"
        return who

    async def _join(self, request: web.Request) -> web.Response:
        msg = await self._read(request, msgs.MeshJoin)
        assert isinstance(msg, msgs.MeshJoin)
        who = self._who(request)
        if (why := check_public_key(msg.public_key)) is not None:
            raise BadRequest(f"field 'public_key': {why}")
        if len(msg.endpoints) > 8:
            raise BadRequest("field 'endpoints': at most 8")
        for i, e in enumerate(msg.endpoints):
            try:
                split_endpoint(e)
            except ValueError as err:
                raise BadRequest(f"field 'endpoints[{i}]': {err}") from None
        answer = self.admit(msg, who.name, request.remote)
        if isinstance(answer, tuple):
            return error(*answer)
        self.hub.mutated()
        return web.json_response(wire.encode(answer))

    def admit(
        self, msg: msgs.MeshJoin, identity: str, remote: str | None
    ) -> msgs.MeshJoined | tuple[int, str]:
        """Take ``msg`` (already checked) from ``identity``, seen from address ``remote``, into
        the mesh; its answer, or (status, why) when refused. Takes the hub's lock."""
        endpoint = classify_endpoint(msg.endpoints, remote, public=msg.public)
        with self.hub.lock:
            node = self.nodes.get(msg.public_key)
            if node is not None and node.identity != identity:
                return 403, "this WireGuard key was brought into the mesh by another token"
            if node is None:
                if len(self.nodes) >= MAX_NODES:
                    return 429, f"the mesh holds {MAX_NODES} keys already"
                address = overlay_address(len(self.nodes), self.network)
            else:
                address = node.address
            self.nodes[msg.public_key] = _Node(
                key=msg.public_key,
                name=msg.name[:200],
                identity=identity,
                address=address,
                endpoint=endpoint,
                relay=msg.relay and endpoint is not None,
                joined_at=self.hub.now(),
            )
            self._joins += 1
            view = self.view()
        return msgs.MeshJoined(
            address=address,
            prefix=self.prefix,
            view=view,
            endpoint=endpoint,
            keepalive=self.keepalive,
        )

    async def _poll(self, request: web.Request) -> web.Response:
        msg = await self._read(request, msgs.MeshPoll)
        assert isinstance(msg, msgs.MeshPoll)
        who = self._who(request)
        with self.hub.lock:
            node = self.nodes.get(msg.public_key)
        if node is None:
            return error(404, "this WireGuard key never joined the mesh: join first")
        if node.identity != who.name and not who.admin:
            return error(403, "this WireGuard key was brought into the mesh by another token")
        deadline = asyncio.get_running_loop().time() + self.poll_s
        while True:
            with self.hub.lock:
                view = self.view()
            remaining = deadline - asyncio.get_running_loop().time()
            if view.version != msg.version or remaining <= 0:
                return web.json_response(wire.encode(view))
            await self.hub.changed(remaining)

    def view(self) -> msgs.MeshView:
        """The members now (call under the hub's lock). Computed once per change of what it
        depends on (membership events, revocations, joins, the second for the grace), not once
        per waiting member."""
        now = self.hub.now()
        key = (
            self.hub.membership.events_total,
            len(self.identities.revoked),
            self._joins,
            int(now),
        )
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        owner = self.identities.owner
        registered = {
            (p.info.get("mesh_key"), owner.get(p.id))
            for p in self.hub.membership.peers.values()
            if p.state is PeerState.ACTIVE and "mesh_key" in p.info
        }
        members = []
        for n in self.nodes.values():
            if n.identity in self.identities.revoked:
                continue
            if (n.key, n.identity) in registered:
                n.linked = True
            elif n.linked or now - n.joined_at > self.grace_s:
                continue
            members.append(
                msgs.MeshMember(
                    public_key=n.key,
                    address=n.address,
                    endpoint=n.endpoint,
                    relay=n.relay,
                    name=n.name,
                )
            )
        members.sort(key=lambda m: ipaddress.ip_address(m.address))
        body = json.dumps(wire.encode(tuple(members)), sort_keys=True).encode()
        view = msgs.MeshView(hashlib.sha256(body).hexdigest()[:16], tuple(members))
        self._cached = (key, view)
        return view
