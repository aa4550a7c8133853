"""Whom each connection of a group leads to, without waiting for any other member: a made
connection by the listener it reached, an accepted one by the one member on its remote host, and
where members share a host, by the local ends the others published, read only when a stalled
connection must be named (``Wires.name_of``)."""

from __future__ import annotations

import torch.distributed as dist

from isthmus.comm.connect import _CONNS_KEY, _labels, _resolve
from isthmus.comm.wires import SocketInfo, Wires

OTHERS = {1: ("10.0.0.2", 41000), 2: ("10.0.0.3", 42000)}


def _sock(inode: int, local: tuple[str, int], remote: tuple[str, int]) -> SocketInfo:
    return SocketInfo(fd=inode, inode=inode, local=local, remote=remote, listening=False)


def test_made_and_accepted_connections_are_named_from_their_addresses() -> None:
    made = _sock(1, ("10.0.0.1", 50001), ("10.0.0.2", 41000))  # to rank 1's listener
    accepted = _sock(2, ("10.0.0.1", 40000), ("10.0.0.3", 51234))  # from rank 2's host
    names, ends = _labels([made, accepted], OTHERS)
    assert names == {1: "rank 1 at 10.0.0.2:41000", 2: "rank 2 at 10.0.0.3:42000"}
    assert ends == ["10.0.0.1:50001"]


def test_on_a_shared_host_an_accepted_connection_is_named_from_the_published_ends() -> None:
    others = {1: ("127.0.0.1", 41000), 2: ("127.0.0.1", 42000)}
    accepted = _sock(7, ("127.0.0.1", 40000), ("127.0.0.1", 51234))
    names, _ = _labels([accepted], others)
    assert names == {}  # two members listen on that host: the address alone does not tell
    store = dist.HashStore()
    wires = Wires("rank 0")
    wires.add([accepted], names, resolve=lambda: _resolve(store, others))
    label = wires.snapshot()[7]
    assert label == "127.0.0.1:51234"
    # nothing published yet: the label stays an address (and asking never waits)
    assert wires.name_of(label) == label
    store.set(f"{_CONNS_KEY}2", "127.0.0.1:51234 127.0.0.1:51300")
    assert wires.name_of(label) == "rank 2 at 127.0.0.1:42000"
    assert wires.name_of("10.9.9.9:1") == "10.9.9.9:1"


def test_a_resolver_that_fails_leaves_the_address() -> None:
    def broken() -> dict[str, str]:
        raise RuntimeError("store connection closed")

    wires = Wires("rank 0")
    wires.add([_sock(3, ("127.0.0.1", 1), ("127.0.0.1", 2))], {}, resolve=broken)
    assert wires.name_of("127.0.0.1:2") == "127.0.0.1:2"
    wires.cut("epoch over")
    assert wires.snapshot() == {}
