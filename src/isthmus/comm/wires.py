"""The TCP connections under one epoch's process groups, so that an abort can cut them.

Why this exists: a Gloo collective that waits on a silent peer (SIGSTOPped, swapped out, cut off
by a partition: its TCP connections stay open) cannot be interrupted from Python. Torch's
``ProcessGroupGloo.abort()`` and ``shutdown()`` return at once and leave the collective waiting,
and destroying the group joins its worker threads, that is, waits out the collective's own
timeout (a survivor sits in ``~ProcessGroupGloo`` for the whole ``collective_timeout``).
What does interrupt it is the kernel: ``shutdown(2)`` on the group's sockets makes every pending
read and write fail at once, Gloo reports "Connection closed by peer", the collective raises, the
group's threads go idle and the group can be destroyed at once. The peer at the other end of each
connection sees it close too, so live members are released even before the coordinator's abort
reaches them. Sockets are shut down, never closed: the descriptors stay Gloo's (it closes them
when the group is destroyed), so no descriptor number can be reused under it.

Which sockets are a group's: every Gloo device listens on a socket of its own, created when the
device is (:func:`created_by` sees it appear). Each member publishes its listener's address in
the epoch's store before connecting; once the group is built, its connections are exactly the
sockets whose local end is this member's listener (connections it accepted) or whose remote end
is another member's listener (connections it made). That holds with several groups in one process
(tests build every rank in one process). The epoch's store client is recorded the same way. A
listener is never shut down (Gloo's accept loop does not expect it).

Sockets are known by inode, not by descriptor number: :meth:`Wires.cut` looks up where each is
open at that moment and checks the inode again on a private duplicate before shutting it down, so
a descriptor Gloo closed meanwhile (and the kernel reused for another socket) is left alone.

Each held socket also carries a label saying whom it leads to (:meth:`Wires.add`'s ``names``;
by default the remote address): :meth:`Wires.snapshot` hands them to the progress watch of the
group (:class:`~isthmus.comm.tcpstats.TcpWatch`), so that a connection that goes silent is
reported with the member at its other end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Endpoint", "SocketInfo", "Wires", "created_by", "inet_sockets", "pair_sockets"]

log = logging.getLogger("isthmus.wires")
T = TypeVar("T")

Endpoint = tuple[str, int]
"""A socket address as (host, port); IPv4-mapped IPv6 hosts are written as plain IPv4."""

_WILDCARD = ("0.0.0.0", "::", "")

# Serializes the before/after comparisons of :func:`created_by` within this process: two of them
# running at once would each see the other's socket appear.
_scan_lock = threading.Lock()


@dataclass(frozen=True)
class SocketInfo:
    """One TCP socket of this process."""

    fd: int
    inode: int
    local: Endpoint
    remote: Endpoint | None
    listening: bool


def _endpoint(addr: tuple[object, ...]) -> Endpoint:
    host = str(addr[0])
    if host.startswith("::ffff:"):
        host = host[7:]
    return host, int(str(addr[1]))


def inspect(fd: int) -> SocketInfo | None:
    """``fd`` as a :class:`SocketInfo` if it is a TCP socket of this process, else None.

    Works on a private duplicate, which is closed again: the descriptor itself is never touched,
    and one closed meanwhile by another thread just gives None."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
            return None
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        inode = os.fstat(dup).st_ino
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with s:  # owns the duplicate from here on
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        try:
            local = _endpoint(s.getsockname())
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except OSError:
            return None
        try:
            remote: Endpoint | None = _endpoint(s.getpeername())
        except OSError:  # not connected (a listener, or a connection that already failed)
            remote = None
        return SocketInfo(fd, inode, local, remote, listening)


def inet_sockets() -> list[SocketInfo]:
    """Every TCP socket this process holds, once each (a socket open under several descriptors,
    e.g. while another thread inspects it, is listed under one of them)."""
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: nothing can be attributed, so nothing will be cut
        return []
    seen: dict[int, SocketInfo] = {}
    for fd in fds:
        info = inspect(fd)
        if info is not None:
            seen.setdefault(info.inode, info)
    return list(seen.values())


def _descriptors(inodes: set[int]) -> dict[int, list[int]]:
    """Where sockets ``inodes`` are open in this process now: inode -> descriptors."""
    out: dict[int, list[int]] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and (ino := int(link[8:-1])) in inodes:
            out.setdefault(ino, []).append(int(fd))
    return out


def created_by(
    make: Callable[[], T],
    keep: Callable[[SocketInfo], bool],
    *,
    lock: threading.Lock = _scan_lock,
    timeout_s: float = 30.0,
) -> tuple[T, list[SocketInfo]]:
    """Call ``make()`` and return its result with the TCP sockets that appeared meanwhile and
    satisfy ``keep``. Meant for calls that create their sockets before returning (a Gloo device's
    listener, a store client's connection). Calls sharing ``lock`` (by default one lock for the
    process) are serialized, so that none sees another's socket appear; ``keep`` must exclude
    what calls under other locks create. If the lock stays busy for ``timeout_s``, ``make()``
    runs unobserved (empty list, logged)."""
    if not lock.acquire(timeout=timeout_s):
        log.warning(
            "socket scan lock busy for %.0fs; connections made now cannot be cut", timeout_s
        )
        return make(), []
    try:
        # Sockets are told apart by inode, never by descriptor: other threads inspecting sockets
        # hold short-lived duplicates, which would look like new sockets.
        before = {s.inode for s in inet_sockets()}
        result = make()
        new = [s for s in inet_sockets() if s.inode not in before and keep(s)]
    finally:
        lock.release()
    return result, new


def same(a: Endpoint, listener: Endpoint) -> bool:
    """Whether endpoint ``a`` is on ``listener``'s address (its port, and its host unless the
    listener is bound to every address)."""
    return a[1] == listener[1] and (listener[0] in _WILDCARD or a[0] == listener[0])


def pair_sockets(mine: Endpoint | None, others: Iterable[Endpoint]) -> list[SocketInfo]:
    """The connected sockets of a Gloo group whose member here listens on ``mine`` and whose
    other members listen on ``others``: accepted on ``mine``, or made to one of ``others``."""
    peers = list(others)
    out = []
    for s in inet_sockets():
        if s.listening:
            continue
        if (mine is not None and same(s.local, mine)) or (
            s.remote is not None and any(same(s.remote, p) for p in peers)
        ):
            out.append(s)
    return out


def _shutdown(fd: int, inode: int) -> bool:
    """Shut down the socket open as ``fd`` if it is the one with ``inode``; True if it was."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False  # closed meanwhile: nothing to cut
    try:
        if os.fstat(dup).st_ino != inode:
            return False  # the number now names another file
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    # Shuts down the socket itself (shared by the duplicate), not just this descriptor;
    # OSError: ENOTCONN, it had already failed.
    with s, contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    return True


class Wires:
    """The sockets of one epoch (its store client, its groups' connections) and a switch that
    shuts them all down. Thread-safe: builders :meth:`add` while an abort may :meth:`cut`; a
    socket added after the cut is shut down at once."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._held: set[int] = set()  # socket inodes
        self._named: dict[int, str] = {}  # the held group connections -> whom each leads to
        # asked lazily for the names of connections labelled by address (see add)
        self._resolvers: list[Callable[[], Mapping[str, str]]] = []
        self._resolved: dict[str, str] = {}
        self.cut_reason: str | None = None
        self.cut_count = 0
        self._hooks: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def is_cut(self) -> bool:
        return self.cut_reason is not None

    def add(
        self,
        sockets: Iterable[SocketInfo],
        names: Mapping[int, str] | None = None,
        *,
        resolve: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        """Hold ``sockets`` (connected ones; listeners are ignored) for a later :meth:`cut`.
        ``names``, given for a group's connections (not for a store client's): whom each socket
        leads to, by inode (e.g. ``rank 1 at 10.0.0.2:41234``); a socket missing from it is
        labelled with its remote address. Only sockets added with ``names`` are watched
        (:meth:`snapshot`). ``resolve``: asked by :meth:`name_of` for whom the address labels lead
        to (``host:port`` -> name), only when one must be named."""
        if resolve is not None:
            with self._lock:
                self._resolvers.append(resolve)
        conns = [s for s in sockets if not s.listening]
        new = {s.inode for s in conns}
        named = (
            {}
            if names is None
            else {s.inode: names.get(s.inode) or _label(s.remote) for s in conns}
        )
        with self._lock:
            if self.cut_reason is None:
                self._held |= new
                self._named.update(named)
                return
        self.cut_count += _cut(new)

    def name_of(self, label: str) -> str:
        """``label`` (one of :meth:`snapshot`'s), named after the member it leads to when a
        ``resolve`` given to :meth:`add` knows it; else ``label`` itself. Never raises: a
        resolver that fails (the store is gone) leaves the label as it is (logged)."""
        with self._lock:
            known = self._resolved.get(label)
            resolvers = list(self._resolvers)
        if known is not None or not resolvers:
            return known or label
        found: dict[str, str] = {}
        for resolve in resolvers:
            try:
                found.update(resolve())
            except Exception as e:  # the epoch's store may be gone: keep the address
                log.debug("could not name the connection to %s: %s", label, e)
        with self._lock:
            self._resolved.update(found)
        return found.get(label, label)

    def snapshot(self) -> dict[int, str]:
        """The group connections held now (added with ``names``): inode -> whom it leads to.
        Empty once cut."""
        with self._lock:
            return dict(self._named)

    def on_cut(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` at the cut (at once if it was cut already): for connections
        that are not sockets of this process's own (the coordinator's rendezvous store)."""
        with self._lock:
            if self.cut_reason is None:
                self._hooks.append(hook)
                return
            reason = self.cut_reason
        hook(reason)

    def cut(self, reason: str) -> int:
        """Shut down every socket held (once; later calls do nothing). Returns how many were
        shut down. Never raises: a socket that is already gone is skipped."""
        with self._lock:
            if self.cut_reason is not None:
                return 0
            self.cut_reason = reason
            held, self._held = self._held, set()
            self._named = {}
            self._resolvers = []
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            with contextlib.suppress(Exception):  # cut never raises
                hook(reason)
        n = _cut(held)
        self.cut_count += n
        if held:
            log.debug("cut %d of %d connections of %s: %s", n, len(held), self.name, reason)
        return n


def _label(remote: Endpoint | None) -> str:
    return "an unknown remote" if remote is None else f"{remote[0]}:{remote[1]}"


def _cut(inodes: set[int]) -> int:
    """Shut down the sockets ``inodes`` wherever they are open now; returns how many."""
    n = 0
    for inode, fds in _descriptors(inodes).items():
        n += any(_shutdown(fd, inode) for fd in fds)
    return n
