"""Cheap reachability probes between peers, and reading who failed out of Gloo's error texts.

A probe is one TCP connection attempt to another peer's :class:`ProbeListener`, a listening
socket that accepts and closes at once, opened on the address the peer's Gloo device binds (so
the probe crosses the same route and firewalls as the group's connections, except for rules on
Gloo's own ports). Gloo's listener itself is never probed: it takes every connection it accepts
for one of its pairs. A probe says whether the pair connects now and, if not, how it failed:
refused (a reset came back: a firewall that rejects, or nothing listening), timed out (packets
dropped, a one-way route), or reset. It is what tells the coordinator a partitioned pair has
healed, and, after a group failed to connect, which member could not be reached.

:func:`gloo_failure` reads Gloo's texts for an established pair that failed (``Read error
[10.0.0.4]:55500: Connection reset by peer``, ``Connection closed by peer [10.0.0.4]:41234``):
the only texts of Gloo that name the remote at all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import struct
import threading

from isthmus.coordinator.partition import How

__all__ = ["ProbeListener", "gloo_failure", "local_address", "probe", "probe_all"]


class ProbeListener:
    """A listening socket on ``host`` (port ``port``, 0: any) that accepts connections and closes
    them at once, on a daemon thread. :attr:`address` is ``host:port`` as others reach it.
    :meth:`close` stops it (also as a context manager). Raises OSError if it cannot bind."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._sock = socket.create_server((host, port), backlog=64)
        # accept() is woken by shutdown() at close; a timeout keeps the loop bounded regardless
        self._sock.settimeout(0.5)
        bound = self._sock.getsockname()
        self.address = f"{host}:{bound[1]}"
        self.accepted = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="isthmus-probe")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.close()
            self.accepted += 1

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(2.0)

    def __enter__(self) -> ProbeListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"probe address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def probe(address: str, *, timeout_s: float = 3.0, source: str | None = None) -> How | None:
    """Try one TCP connection to ``address`` (``host:port``); None if it connected (it is closed
    again at once), else how it failed. ``source``: the local address to connect from (the one
    this peer's Gloo device binds), so the probe takes the group's route. Never waits longer
    than ``timeout_s``; raises ValueError only for a malformed address."""
    host, port = _split(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        if source is not None:
            s.bind((source, 0))
        s.connect((host, port))
        return None
    except TimeoutError:
        return How.TIMED_OUT
    except ConnectionRefusedError:
        return How.REFUSED
    except ConnectionResetError:
        return How.RESET
    except OSError as e:
        # no route, network unreachable, host down: nothing answers on the way
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return How.TIMED_OUT
        return How.RESET
    finally:
        s.close()


_GLOO_REMOTE = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")
_GLOO_HOW = (
    ("reset by peer", How.RESET),
    ("closed by peer", How.RESET),
    ("refused", How.REFUSED),
    ("timed out", How.TIMED_OUT),
    ("timeout", How.TIMED_OUT),
)


def gloo_failure(text: str) -> tuple[str, How] | None:
    """The remote ``host:port`` and how, from a Gloo error text that names one, else None
    (Gloo's connect and wait timeouts name nobody). The port is the remote's listener or its
    ephemeral port, depending on which end connected, so only the host identifies the member,
    and only when each member has an address of its own."""
    m = _GLOO_REMOTE.search(text)
    if m is None:
        return None
    low = text.lower()
    how = next((h for word, h in _GLOO_HOW if word in low), How.RESET)
    return f"{m.group(1)}:{m.group(2)}", how


def local_address(toward: str, *, hostname: str | None = None, interface: str | None = None) -> str:
    """The local IP the Gloo device binds, as far as it can be told: ``hostname`` when given,
    else the IPv4 address of ``interface`` (or of ``GLOO_SOCKET_IFNAME``), else the source
    address of the route to ``toward`` (``host:port``, or a URL; no packet is sent). Falls back
    to 127.0.0.1 when there is no route."""
    if hostname:
        return hostname
    interface = interface or os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0] or None
    if interface:
        with contextlib.suppress(OSError):
            return _interface_ipv4(interface)
    target = toward.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = target.rpartition(":")
    host = (host or target).strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    try:
        s.connect((host, int(port) if port.isdigit() else 9))
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def probe_all(
    addresses: dict[int, str], *, timeout_s: float = 3.0, source: str | None = None
) -> list[tuple[int, str, How]]:
    """Probe every ``member -> host:port`` in parallel (one thread each, all bounded by
    ``timeout_s``); the members that did not connect, with their address and how, by member.
    A malformed address is skipped."""
    found: dict[int, How] = {}

    def one(member: int, address: str) -> None:
        try:
            how = probe(address, timeout_s=timeout_s, source=source)
        except ValueError:
            return
        if how is not None:
            found[member] = how

    threads = [
        threading.Thread(target=one, args=(m, a), daemon=True, name="isthmus-probe-out")
        for m, a in addresses.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1.0)
    return [(m, addresses[m], found[m]) for m in sorted(found)]


def _interface_ipv4(name: str) -> str:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR); OSError if it has none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    finally:
        s.close()
