"""Cutting an epoch's connections: a collective waiting on a silent rank is released by an abort
(not by its timeout), abandoned connection attempts end, and hundreds of epochs built, aborted
and retired in one process leave thread and descriptor counts flat."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from isthmus.comm.connect import Graveyard, StoreClients, connect_gloo
from isthmus.comm.group import CollectiveError, Group
from isthmus.comm.wires import Wires, inet_sockets, pair_sockets
from support.rendezvous import NEVER, assert_abandoned_rendezvous_is_cut


@pytest.fixture
def master() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _build(store: dist.Store, rank: int, world: int) -> Group:
    wires = Wires(f"rank {rank}")
    pg = connect_gloo(store, rank, world, timeout_s=NEVER, wires=wires, hostname="127.0.0.1")
    return Group(pg, rank, world, timeout_s=NEVER, wires=wires)


def _groups(pool: ThreadPoolExecutor, prefix: str, world: int) -> list[Group]:
    # An in-process store (every rank is a thread here); the store's own connection is cut in
    # test_abandoned_connection_attempt_is_cut.
    store = dist.PrefixStore(prefix, _HASH)
    return list(pool.map(lambda r: _build(store, r, world), range(world)))


_HASH = dist.HashStore()


def _until_idle(yard: Graveyard, what: str) -> None:
    assert yard.drain(60.0) == 0, f"{what} still busy inside torch"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_pair_sockets_and_cut_on_plain_sockets():
    listener = socket.create_server(("127.0.0.1", 0))
    made = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        ep = listener.getsockname()
        mine = {(s.fd, s.inode) for s in pair_sockets(ep, [])}
        assert mine == {(accepted.fileno(), os.fstat(accepted.fileno()).st_ino)}
        theirs = {s.fd for s in pair_sockets(None, [ep])}
        assert theirs == {made.fileno()}
        wires = Wires("plain")
        wires.add(s for s in inet_sockets() if s.fd in (accepted.fileno(), listener.fileno()))
        assert len(wires) == 1  # listeners are never held
        assert wires.cut("test") == 1
        assert wires.cut("again") == 0  # once
        made.settimeout(5.0)
        assert made.recv(1) == b""  # the other end saw the connection close
        assert accepted.fileno() >= 0  # shut down, not closed: the descriptor is still its owner's
    finally:
        for s in (made, accepted, listener):
            s.close()


def test_cut_leaves_a_reused_descriptor_alone():
    a, b = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    made = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    wires = Wires("reuse")
    wires.add(s for s in inet_sockets() if s.fd == accepted.fileno())
    fd = accepted.fileno()
    accepted.close()
    other = socket.create_connection(listener.getsockname())
    reused = other.fileno() == fd  # the kernel hands out the lowest free number
    try:
        if not reused:  # make the number name a different socket anyway
            os.dup2(other.fileno(), fd)
        assert wires.cut("test") == 0
        peer, _ = listener.accept()
        with peer:
            os.write(fd, b"x")  # still connected: the cut did not touch it
            assert peer.recv(1) == b"x"
    finally:
        for s in (a, b, made, other, listener):
            s.close()
        if not reused:
            os.close(fd)


def test_abort_releases_a_collective_waiting_on_a_silent_rank():
    pool = ThreadPoolExecutor(3)
    groups = _groups(pool, "silent/", 3)
    assert all(len(g.wires or ()) >= 2 for g in groups)  # its two connections at least
    live = [g.all_reduce(torch.ones(1000), async_op=True) for g in groups[:2]]  # rank 2 silent
    time.sleep(0.05)
    assert not any(h.done() for h in live)
    for g in groups:
        g.abort("the coordinator aborted the round")
    for h in live:
        with pytest.raises(CollectiveError, match="aborted the round"):
            h.wait()
    yard = Graveyard()
    for g in groups:
        yard.park(g)
    del groups, live
    # With a 600 s timeout, only the cut connections can make the work end.
    _until_idle(yard, "an aborted group")


def test_abandoned_connection_attempt_is_cut(master):
    wires = Wires("abandoned")
    clients = StoreClients("127.0.0.1", master.port, timeout_s=NEVER)
    store = dist.PrefixStore("abandoned/", clients.take(wires, lambda: None))
    assert len(wires) == 1  # the store client's connection

    assert_abandoned_rendezvous_is_cut(store, wires)


def test_hundreds_of_epochs_leave_threads_and_descriptors_flat():
    """Group churn: every epoch builds a group, runs a collective or has it aborted on a silent
    rank, and is retired the way the session does it."""
    pool = ThreadPoolExecutor(2)
    yard = Graveyard()
    epochs, warm, cut = 600, 50, 0
    counts: dict[str, int] = {}
    for e in range(epochs):
        groups = _groups(pool, f"churn/{e}/", 2)
        if e % 4 == 3:  # rank 1 is silent; rank 0 waits until the abort
            h = groups[0].all_reduce(torch.ones(64), async_op=True)
            for g in groups:
                g.abort("silent member")
            with pytest.raises(CollectiveError):
                h.wait()
            cut += 1
        else:
            hs = [g.all_reduce(torch.ones(64), async_op=True) for g in groups]
            assert all(float(h.wait()[0]) == 2.0 for h in hs)
        for g in groups:
            g.abort("superseded by a new epoch")
            yard.park(g)
        del groups
        yard.reap()
        if e == warm:
            counts = {"threads": threading.active_count(), "fds": _fds()}
    _until_idle(yard, "a retired group")
    assert cut == epochs // 4
    assert yard.parked_total < epochs  # most groups were idle when retired: never parked
    # Bounded, not merely slow growth: a leak of one thread or socket per epoch would be ~550.
    assert threading.active_count() <= counts["threads"] + 2
    assert _fds() <= counts["fds"] + 8
