"""The typed messages of the run's WireGuard mesh (:mod:`isthmus.coordinator.mesh_room` serves
them, :mod:`isthmus.comm.mesh_agent` sends them), decoded and checked by
:mod:`isthmus.coordinator.wire` on both sides like those of :mod:`.protocol`. The endpoints are
new routes, so peers and coordinators of the same ``PROTOCOL_VERSION`` without them still work
together (a coordinator without the mesh answers 404, which the agent reports)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MeshJoin", "MeshJoined", "MeshMember", "MeshPoll", "MeshView"]


@dataclass(frozen=True)
class MeshJoin:
    """``POST /v1/mesh/join``: a peer brings WireGuard public key ``public_key`` into the run's
    mesh, listening at ``endpoints`` (candidates, ``host:port``); ``public``: the first one is
    reachable from anywhere (the operator forwarded it), whatever the coordinator sees;
    ``relay``: it offers to forward between members behind NAT."""

    name: str
    public_key: str
    endpoints: tuple[str, ...] = ()
    public: bool = False
    relay: bool = False


@dataclass(frozen=True)
class MeshMember:
    """One member of the mesh: its public key, overlay address, and endpoint (None: behind NAT,
    it sends first)."""

    public_key: str
    address: str
    endpoint: str | None = None
    relay: bool = False
    name: str = ""


@dataclass(frozen=True)
class MeshView:
    """Every member of the mesh now; ``version`` changes whenever they do."""

    version: str
    members: tuple[MeshMember, ...] = ()


@dataclass(frozen=True)
class MeshJoined:
    """The answer to :class:`MeshJoin`: the peer's overlay ``address`` in a network of
    ``prefix`` bits, the endpoint others are told (None: it is behind NAT), the keepalive a NATed
    member sends, and the mesh as it is."""

    address: str
    prefix: int
    view: MeshView
    endpoint: str | None = None
    keepalive: int = 10


@dataclass(frozen=True)
class MeshPoll:
    """``POST /v1/mesh/view``: the member with ``public_key`` holds the view of ``version``;
    answered (a :class:`MeshView`) when the mesh differs from it, or after the long-poll time."""

    public_key: str
    version: str = ""
