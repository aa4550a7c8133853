"""Connecting an epoch's process groups so that an abort can always get a peer out, and retiring
what is left behind.

Three things here, each against one way a silent member could hold the survivors:

* :func:`connect_gloo` builds a Gloo group like :func:`~isthmus.comm.group.build_process_group`
  and records every connection it makes in the epoch's :class:`~isthmus.comm.wires.Wires`, so
  that :meth:`Group.abort <isthmus.comm.group.Group.abort>` can shut them down and wake a
  collective that Gloo would otherwise leave waiting until its timeout.
* :class:`StoreClients` gives each epoch a client of the rendezvous store of its own, connected
  ahead of time. A ``TCPStore`` client runs one request at a time, so a rendezvous left waiting
  for a member that went silent would otherwise hold every later epoch's rendezvous until its
  timeout. Its connection is recorded too, so the abort also ends such a wait.
* :class:`Connecting` runs one connection attempt on a thread of its own (an abandoned attempt
  never occupies a worker that the next epoch needs), and :class:`Graveyard` keeps abandoned
  groups and attempts referenced until torch is done with them, then lets them go: destroying a
  Gloo group with work in flight blocks the destroying thread until that work ends.

An attempt cannot always be interrupted: a member that went silent after publishing its address
but before connecting leaves Gloo waiting for a connection that has no socket yet. Such an attempt
stays parked (one thread, one listening socket) until Gloo's own timeout ends it; nobody waits
for it.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist

from isthmus.comm.exposure import warn_if_public
from isthmus.comm.group import CollectiveError
from isthmus.comm.wires import Endpoint, SocketInfo, Wires, created_by, pair_sockets, same
from isthmus.coordinator.client import CoordinatorClient
from isthmus.coordinator.protocol import Registered
from isthmus.coordinator.store_client import CoordinatorStore
from isthmus.coordinator.wire import PROTOCOL_VERSION, UNVERSIONED, check_version

__all__ = [
    "Connecting",
    "CoordinatorStores",
    "Graveyard",
    "Rendezvous",
    "StoreClients",
    "check_protocols",
    "connect_gloo",
    "publish_protocol",
    "rendezvous",
]

log = logging.getLogger("isthmus.connect")
T = TypeVar("T")

_LISTENER_KEY = "isthmus-listener/"
_PROTOCOL_KEY = "isthmus-protocol/"
_CONNS_KEY = "isthmus-conns/"


def _device(interface: str | None, hostname: str | None) -> Any:
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    if hostname:
        return dist.ProcessGroupGloo.create_device(hostname=hostname)
    return dist.ProcessGroupGloo.create_default_device()


def _listener(mine: Endpoint | None) -> str:
    """A member's listener record: ``"<protocol> <host> <port>"`` (``"<protocol>"`` alone when
    its listener is unknown)."""
    return f"{PROTOCOL_VERSION}" + ("" if mine is None else f" {mine[0]} {mine[1]}")


def _parse(value: bytes, rank: int) -> Endpoint | None:
    """The listener in member ``rank``'s record. Raises
    :class:`~isthmus.coordinator.wire.ProtocolMismatch` naming both versions when the record is
    another protocol version's (a record without a version is taken as ``UNVERSIONED``)."""
    parts = value.decode().split(" ")
    version = int(parts[0]) if len(parts) in (1, 3) and parts[0].isdigit() else UNVERSIONED
    check_version(version, them=f"the member of rank {rank}", us="this peer")
    host, port = (parts[1], parts[2]) if len(parts) == 3 else ("", "")
    return (host, int(port)) if host and port.isdigit() else None


def publish_protocol(store: dist.Store, rank: int) -> None:
    """Record the protocol version this member speaks in ``store`` (before connecting), for
    :func:`check_protocols`; for groups without listener records (NCCL)."""
    store.set(f"{_PROTOCOL_KEY}{rank}", str(PROTOCOL_VERSION))


def check_protocols(store: dist.Store, rank: int, world: int) -> None:
    """Once the group is connected (every member published before connecting): raise
    :class:`~isthmus.coordinator.wire.ProtocolMismatch` naming both versions if a member speaks
    another protocol version (one that published none is taken as ``UNVERSIONED``)."""
    for r in range(world):
        key = f"{_PROTOCOL_KEY}{r}"
        if r != rank:
            raw = store.get(key).decode() if store.check([key]) else ""
            theirs = int(raw) if raw.isdigit() else UNVERSIONED
            check_version(theirs, them=f"the member of rank {r}", us="this peer")


def connect_gloo(
    store: dist.Store,
    rank: int,
    world: int,
    *,
    timeout_s: float,
    wires: Wires,
    interface: str | None = None,
    hostname: str | None = None,
) -> Any:
    """Build a Gloo process group over ``store`` (as ``build_process_group`` does) and add its
    connections to ``wires``.

    Every member publishes its protocol version and its listener's address under
    ``isthmus-listener/<rank>`` before connecting. Each connection is labelled with the member
    it leads to (the labels :meth:`Wires.snapshot` gives the group's progress watch): from its
    addresses, and where members share a host (an accepted connection shows only the remote's
    host and an ephemeral port) from the local ends each member then publishes under
    ``isthmus-conns/<rank>``, read only when a stalled connection must be named
    (:meth:`Wires.name_of`): connecting never waits for another member's labels.
    ``timeout_s`` is Gloo's group timeout: the bound on connecting, and on each operation that
    does not set its own. Blocks until all ``world`` ranks connected;
    raises what torch raises when that fails or takes longer than ``timeout_s``, or when
    ``wires`` was cut meanwhile (the store connection is shut down), and
    :class:`~isthmus.coordinator.wire.ProtocolMismatch` naming both versions when a member
    speaks another protocol version. If this member's listener cannot be told apart (another
    listening socket appeared in this process at the same instant) the group still works, but an
    abort cuts only the connections it could identify (logged).
    """
    dev, new = created_by(lambda: _device(interface, hostname), lambda s: s.listening)
    mine = new[0].local if len(new) == 1 else None
    if mine is None:
        log.warning(
            "could not identify the listener of a new Gloo device (%d candidates)", len(new)
        )
    else:
        warn_if_public(mine[0])
    store.set(f"{_LISTENER_KEY}{rank}", _listener(mine))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dev]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupGloo(store, rank, world, opts)
    # Every member published before it began to connect, and the group is connected, so the
    # keys are there (unless a member connected without this function: then fewer are cut).
    keys = {r: f"{_LISTENER_KEY}{r}" for r in range(world) if r != rank}
    others = {
        r: p
        for r, k in keys.items()
        if store.check([k]) and (p := _parse(store.get(k), r)) is not None
    }
    sockets = pair_sockets(mine, others.values())
    names, made = _labels(sockets, others)
    hosts = {p[0] for p in others.values()}
    if (mine[0] if mine is not None else None) in hosts or {s.local[0] for s in sockets} & hosts:
        # Another member shares this host, so where this member's connections arrive the
        # remote host does not say whom they come from: publish their local ends (one write,
        # nobody waits for it); the others read them only when they must name one.
        store.set(f"{_CONNS_KEY}{rank}", " ".join(made))
    unnamed = any(s.inode not in names for s in sockets if s.remote is not None)
    resolve = functools.partial(_resolve, store, others) if unnamed else None
    wires.add(sockets, names, resolve=resolve)
    return pg


def _label(rank: int, listener: Endpoint) -> str:
    return f"rank {rank} at {listener[0]}:{listener[1]}"


def _labels(
    sockets: list[SocketInfo], others: dict[int, Endpoint]
) -> tuple[dict[int, str], list[str]]:
    """Whom each of a new group's ``sockets`` leads to, from the addresses alone: ``(names by
    inode, the local ends of the sockets this member made)``.

    A socket this member made leads to the listener it connected to (``rank R at HOST:PORT``).
    One it accepted shows only the remote's host and an ephemeral port: it is named after the
    one member listening on that host, and left out (labelled by address) when several do."""
    names: dict[int, str] = {}
    made: list[str] = []
    for s in sockets:
        if s.remote is None:
            continue
        to = [r for r, p in others.items() if same(s.remote, p)]
        if to:
            names[s.inode] = _label(to[0], others[to[0]])
            made.append(f"{s.local[0]}:{s.local[1]}")
            continue
        on_host = [r for r, p in others.items() if same((s.remote[0], p[1]), p)]
        if len(on_host) == 1:
            names[s.inode] = _label(on_host[0], others[on_host[0]])
    return names, made


def _resolve(store: dist.Store, others: dict[int, Endpoint]) -> dict[str, str]:
    """The connections the ``others`` made, as their published local ends (``host:port``, the
    remote end of the accepted socket here) -> ``rank R at HOST:PORT``. Members that published
    nothing (yet) are left out; never waits for a key."""
    out: dict[str, str] = {}
    for r, p in others.items():
        key = f"{_CONNS_KEY}{r}"
        if store.check([key]):
            out.update((e, _label(r, p)) for e in store.get(key).decode().split())
    return out


# Store clients are made one at a time (see StoreClients), under a lock of their own: connecting
# one can take seconds, and Gloo devices must not wait for that.
_store_lock = threading.Lock()


def _store_client(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, list[SocketInfo]]:
    td = datetime.timedelta(seconds=timeout_s)
    store, new = created_by(
        lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=td),
        lambda s: s.remote is not None and s.remote[1] == port and not s.listening,
        lock=_store_lock,
        timeout_s=timeout_s,
    )
    return store, new if len(new) == 1 else []  # several: someone else connected meanwhile


class StoreClients:
    """Clients of the run's rendezvous store at ``host:port``: a fresh one for every epoch,
    each connected in the background while the previous epoch runs.

    Fresh, because a ``TCPStore`` client runs one request at a time: a rendezvous left waiting
    for a member that went silent would hold every later rendezvous on a shared client until its
    timeout. Ahead of time, because connecting one can take seconds, inside c10d's client set-up,
    while a plain TCP connection to the same port is immediate.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._next: Connecting[tuple[dist.TCPStore, list[SocketInfo]]] | None = None
        self._lock = threading.Lock()
        self._prepare()

    def _prepare(self) -> None:
        host, port, timeout_s = self.host, self.port, self.timeout_s
        self._next = Connecting(
            lambda: _store_client(host, port, timeout_s), Wires("store client"), name="store-client"
        )

    def take(self, wires: Wires, abandon: Callable[[], str | None]) -> dist.TCPStore:
        """The client for a new epoch, its connection added to ``wires``; the next one starts
        connecting at once. Raises :class:`CollectiveError` when it cannot connect or when
        ``abandon()`` names a reason meanwhile."""
        with self._lock:
            attempt = self._next
            self._prepare()
        assert attempt is not None
        store, sockets = attempt.wait(abandon)
        wires.add(sockets)
        return store

    def busy(self) -> bool:
        """True while a client is still connecting."""
        nxt = self._next
        return nxt is not None and nxt.busy()


class CoordinatorStores:
    """The authenticated rendezvous: each epoch gets a
    :class:`~isthmus.coordinator.store_client.CoordinatorStore` on the session's coordinator
    connection (nothing to connect ahead: requests share the client's connection pool). Cutting
    the epoch's wires ends its store calls in flight."""

    def __init__(self, client: CoordinatorClient, peer_id: int, run_id: str, *, timeout_s: float):
        self.client, self.peer_id, self.run_id, self.timeout_s = client, peer_id, run_id, timeout_s

    def take(self, wires: Wires, abandon: Callable[[], str | None]) -> dist.Store:
        """A store for a new epoch, cut with ``wires``."""
        store = CoordinatorStore(self.client, self.peer_id, self.run_id, timeout_s=self.timeout_s)
        wires.on_cut(store.cut)
        return store

    def busy(self) -> bool:
        return False


Rendezvous = StoreClients | CoordinatorStores


def rendezvous(
    client: CoordinatorClient, reply: Registered, peer_id: int, run_id: str, timeout_s: float
) -> Rendezvous:
    """The rendezvous the coordinator's registration ``reply`` names: its own authenticated
    store, or (``rendezvous="tcpstore"``) torch's TCPStore on ``store_port``."""
    if reply.rendezvous == "coordinator":
        return CoordinatorStores(client, peer_id, run_id, timeout_s=timeout_s)
    return StoreClients(client.host, reply.store_port, timeout_s=timeout_s)


class Connecting(Generic[T]):
    """One connection attempt running ``build()`` on a daemon thread of its own.

    :meth:`wait` returns its result, or raises :class:`CollectiveError` when the attempt failed or
    was abandoned; ``wires`` is cut first, which ends the attempt unless it waits for a connection
    that was never made. An abandoned attempt must be parked in a :class:`Graveyard` until
    :meth:`busy` is False.
    """

    def __init__(self, build: Callable[[], T], wires: Wires, *, name: str) -> None:
        self.wires = wires
        self.name = name
        self._box: list[tuple[bool, Any]] = []
        self._finished = threading.Event()
        box, finished = self._box, self._finished

        # The thread holds only the box and the event: the attempt object is free to go.
        def run() -> None:
            try:
                box.append((True, build()))
            except BaseException as e:  # handed to wait()
                box.append((False, e))
            finally:
                finished.set()

        self._thread = threading.Thread(target=run, daemon=True, name=f"isthmus-{name}")
        self._thread.start()

    def busy(self) -> bool:
        """True while the attempt's thread may still be inside torch."""
        return self._thread.is_alive()

    def abort(self, reason: str) -> None:
        """Cut the attempt's connections; its thread then ends on its own."""
        self.wires.cut(reason)

    def wait(self, abandon: Callable[[], str | None]) -> T:
        """The attempt's result. ``abandon()`` is asked every 10 ms; a reason it returns (an
        aborted epoch, a passed deadline) cuts the attempt and raises :class:`CollectiveError`
        with that reason, as does a failed attempt."""
        while not self._finished.wait(0.01):
            why = abandon()
            if why is not None:
                self.abort(why)
                raise CollectiveError(why)
        ok, value = self._box[0]
        if not ok:
            self.abort(f"connecting failed: {value}")
            raise CollectiveError(f"{self.name} failed: {value}") from value
        return value  # type: ignore[no-any-return]


class _Busy(Protocol):
    def busy(self) -> bool: ...


class Graveyard:
    """Abandoned groups and connection attempts, held until torch is done with them.

    Dropping the last reference to a Gloo group whose work is still running blocks the dropping
    thread until that work ends (the group's destructor joins its threads), so an abandoned group
    is parked here and let go by :meth:`reap` once it is idle. With its connections cut it is
    idle within milliseconds; only work that could not be cut stays until its own timeout.
    """

    def __init__(self) -> None:
        self._items: list[_Busy] = []
        self._lock = threading.Lock()
        self.parked_total = 0

    def park(self, item: _Busy) -> None:
        """Keep ``item`` until it is idle (an idle one is let go at once)."""
        with self._lock:
            if item.busy():
                self._items.append(item)
                self.parked_total += 1

    def reap(self) -> int:
        """Let go of every idle item, on the calling thread; returns how many are still busy."""
        with self._lock:
            old = self._items
            self._items = [x for x in old if x.busy()]
            busy = len(self._items)
        # The idle ones are destroyed here, outside the lock, when `old` goes.
        if len(old) > busy:
            log.debug("let go of %d retired groups", len(old) - busy)
        return busy

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def drain(self, timeout_s: float) -> int:
        """Reap until nothing is busy or ``timeout_s`` passed; returns how many are still busy."""
        deadline = time.monotonic() + timeout_s
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self)
