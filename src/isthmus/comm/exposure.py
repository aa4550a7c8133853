"""A warning, once per process, when this peer's Gloo traffic would cross a public network.

torch's Gloo transport has no authentication and no encryption: whoever can reach a peer's Gloo
port can connect to it, and whoever is on the path reads the tensors. isthmus keeps that data
plane on a network the operator trusts (a VPN or a cloud VPC; see docs/SECURITY.md) and says so
when a peer advertises an address that is reachable from the internet.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

__all__ = ["is_public", "warn_if_public"]

log = logging.getLogger("isthmus.security")

_warned: set[str] = set()
_lock = threading.Lock()


def is_public(host: str) -> bool:
    """True for a global unicast IP address (not private, loopback, link-local, CGNAT, ...).
    A host name or anything that does not parse is not judged (False)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return addr.is_global


def warn_if_public(host: str) -> bool:
    """Log a warning the first time this process advertises the public address ``host`` for
    Gloo; returns True when it warned now."""
    if not is_public(host):
        return False
    with _lock:
        if host in _warned:
            return False
        _warned.add(host)
    log.warning(
        "this peer advertises the public address %s for its Gloo traffic, which is neither "
        "authenticated nor encrypted: anyone who can reach it can connect, and anyone on the path "
        "reads the tensors. Run the data plane on a private network (a VPN or a cloud VPC): see "
        "docs/SECURITY.md",
        host,
    )
    return True
