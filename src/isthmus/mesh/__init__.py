"""The WireGuard mesh a run sets up between its peers (``SessionConfig(mesh=True)``).

The pieces below the coordinator and the session: key pairs (:mod:`.keys`), the pure rules of
who is configured how (:mod:`.plan`: overlay addresses, each peer's WireGuard peers, the diff
between two configurations, the relay for two peers behind NAT) and the interface itself
(:mod:`.wg`: ``wireguard-go`` or the kernel module, its control socket, addresses). The
coordinator's side is :mod:`isthmus.coordinator.mesh_room`; the peer's agent that ties them
together is :mod:`isthmus.comm.mesh_agent`.

mesh is part of the floor: it imports the standard library (and ``cryptography`` when present),
nothing of isthmus outside mesh. Never imports coordinator, comm, reduce, testing, checkpoint,
runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers";
tools/structure.py checks it).
"""

from __future__ import annotations

__all__ = ["MeshError"]


class MeshError(RuntimeError):
    """The mesh cannot be set up or used here; the message says why and what to do."""
