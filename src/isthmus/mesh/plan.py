"""The mesh's pure rules: overlay addresses, each peer's WireGuard peers, and the changes that
turn one configuration into the next. Values in, values out; nothing here touches a socket.

Every member is a :class:`Node`. A node is *reachable* when it has an endpoint others can send
to, or *behind NAT* (``endpoint`` None) when it has not: it can only send first. So

* a reachable node lists every other node as a WireGuard peer, with the endpoint when it has
  one; a NATed node's endpoint is learned from its first authenticated packet (WireGuard
  roams to the address a packet came from);
* a NATed node lists the reachable nodes with their endpoints and a persistent keepalive, which
  both opens the path (its first handshake) and keeps the NAT's mapping alive;
* two NATed nodes cannot reach each other at all: a NATed node routes the other NATed nodes'
  overlay addresses through the *relay* (the first reachable node that offered to relay), which
  forwards between its WireGuard peers. Without a relay they are left out of each other's
  configuration (and cannot exchange tensors).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_NETWORK",
    "Node",
    "WgPeer",
    "classify_endpoint",
    "diff",
    "overlay_address",
    "wg_peers",
]

DEFAULT_NETWORK = "10.99.0.0/16"
"""The overlay network the coordinator hands addresses out of (apart from the lab's
10.77.0.0/24, so a lab run can carry the mesh over its emulated links)."""


@dataclass(frozen=True)
class Node:
    """One member of the mesh as every other member sees it."""

    key: str
    """Its WireGuard public key (base64)."""
    address: str
    """Its overlay address (no prefix length)."""
    endpoint: str | None = None
    """``host:port`` where its WireGuard listens, or None behind NAT."""
    relay: bool = False
    """It forwards between NATed members (only honoured for a reachable node)."""


@dataclass(frozen=True)
class WgPeer:
    """One WireGuard peer of an interface: what its control socket is told."""

    key: str
    endpoint: str | None
    allowed_ips: tuple[str, ...]
    keepalive: int = 0
    """Seconds between keepalives (0: none)."""


def overlay_address(index: int, network: str = DEFAULT_NETWORK) -> str:
    """The ``index``-th host address of ``network`` (0 is the first host after the network's own
    address). Raises ValueError when the network has no such host."""
    net = ipaddress.ip_network(network)
    if index < 0 or index + 2 >= net.num_addresses:
        raise ValueError(f"the overlay network {network} has no host number {index + 1}")
    return str(net[index + 1])


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as (host, port). Raises ValueError if malformed."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {endpoint!r:.80}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ipaddress.ip_address(host)  # an address, not a name: raises ValueError
    return host, int(port)


def classify_endpoint(
    reported: Sequence[str], observed_host: str | None, *, public: bool = False
) -> str | None:
    """The endpoint to hand out for a node that reported ``reported`` (its candidates) and was
    seen by the coordinator from ``observed_host``: the first candidate whose host is the one
    seen (nothing translated its address, so others can send to it), every first candidate when
    the node says it is ``public`` (an address the operator forwarded), else None (behind NAT:
    it must send first)."""
    if not reported:
        return None
    if public:
        return reported[0]
    for e in reported:
        host, _ = split_endpoint(e)
        if observed_host is not None and host == observed_host:
            return e
    return None


def _host_route(address: str) -> str:
    ip = ipaddress.ip_address(address)
    return f"{ip}/{ip.max_prefixlen}"


def wg_peers(me: str, nodes: Iterable[Node], *, keepalive: int = 10) -> dict[str, WgPeer]:
    """The WireGuard peers of node ``me`` (its key) in a mesh of ``nodes`` (``me`` included),
    by key. Empty when ``me`` is not among them (it was removed: it must talk to no one)."""
    by_key = {n.key: n for n in nodes}
    mine = by_key.get(me)
    if mine is None:
        return {}
    nat = mine.endpoint is None
    relay = next(
        (n for n in sorted(by_key.values(), key=lambda n: n.address) if n.relay and n.endpoint),
        None,
    )
    routes: dict[str, list[str]] = {}
    for n in by_key.values():
        if n.key == me:
            continue
        if nat and n.endpoint is None:
            if relay is not None:  # reachable only through the relay
                routes.setdefault(relay.key, []).append(_host_route(n.address))
            continue
        routes.setdefault(n.key, []).append(_host_route(n.address))
    return {
        key: WgPeer(
            key=key,
            endpoint=by_key[key].endpoint,
            allowed_ips=tuple(sorted(ips)),
            keepalive=keepalive if nat else 0,
        )
        for key, ips in routes.items()
    }


def diff(
    old: Mapping[str, WgPeer], new: Mapping[str, WgPeer]
) -> tuple[tuple[str, ...], tuple[WgPeer, ...]]:
    """What turns configuration ``old`` into ``new``: the keys to remove and the peers to add or
    change (sorted by key, so the same change is always said the same way)."""
    removed = tuple(sorted(k for k in old if k not in new))
    changed = tuple(new[k] for k in sorted(new) if old.get(k) != new[k])
    return removed, changed
