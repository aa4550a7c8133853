"""Who the coordinator lists in the mesh (isthmus.coordinator.mesh_room), in one process: keys
follow their peers' membership, tokens own their keys, revocations drop keys at once, NAT is
told from the address the coordinator saw."""

from __future__ import annotations

import base64

from isthmus.coordinator.auth import Identities
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.mesh_protocol import MeshJoin, MeshJoined
from isthmus.coordinator.mesh_room import MeshRoom


def _key(i: int) -> str:
    return base64.b64encode(bytes([i]) * 32).decode()


def _room(grace_s: float = 60.0) -> tuple[MeshRoom, Membership, Identities]:
    m = Membership(MembershipConfig())
    ids = Identities("admin-token")
    room = MeshRoom(None, ids, Hub(m, "run"), poll_s=1.0, grace_s=grace_s)  # type: ignore[arg-type]
    return room, m, ids


def _join(room: MeshRoom, i: int, who: str, host: str, seen: str) -> MeshJoined:
    msg = MeshJoin(name=who, public_key=_key(i), endpoints=(f"{host}:5180{i}",))
    out = room.admit(msg, who, seen)
    assert isinstance(out, MeshJoined), out
    return out


def _register(m: Membership, ids: Identities, i: int, who: str) -> int:
    from isthmus.coordinator.auth import Identity

    pid = m.register(who, 0.0, {"mesh_key": _key(i)})
    ids.bind(pid, Identity(who, admin=False))
    return pid


def test_keys_follow_their_peers_and_nat_is_seen() -> None:
    room, m, ids = _room()
    a = _join(room, 1, "a", "10.0.0.1", "10.0.0.1")
    b = _join(room, 2, "b", "192.168.1.2", "203.0.113.9")  # behind NAT
    assert (a.address, b.address) == ("10.99.0.1", "10.99.0.2") and a.prefix == 16
    assert a.endpoint == "10.0.0.1:51801" and b.endpoint is None
    assert [x.public_key for x in b.view.members] == [_key(1), _key(2)]  # pending: in the grace
    pa = _register(m, ids, 1, "a")
    _register(m, ids, 2, "b")
    v1 = room.view()
    assert len(v1.members) == 2
    m.remove(pa, 1.0, "killed")
    v2 = room.view()
    assert [x.public_key for x in v2.members] == [_key(2)] and v2.version != v1.version
    # the same key again (a restarted process keeps none, but a re-registered one does)
    again = _join(room, 1, "a", "10.0.0.1", "10.0.0.1")
    assert again.address == a.address
    assert room.admit(MeshJoin(name="x", public_key=_key(1)), "mallory", "10.0.0.5") == (
        403,
        "this WireGuard key was brought into the mesh by another token",
    )


def test_a_revoked_token_loses_its_keys_and_a_silent_join_expires() -> None:
    room, m, ids = _room(grace_s=0.0)
    _join(room, 1, "a", "10.0.0.1", "10.0.0.1")
    _join(room, 2, "b", "10.0.0.2", "10.0.0.2")
    _register(m, ids, 1, "a")
    _register(m, ids, 2, "b")
    _join(room, 3, "c", "10.0.0.3", "10.0.0.3")  # never registers: gone after the grace
    room.hub.t0 -= 1.0  # a second later
    assert {x.public_key for x in room.view().members} == {_key(1), _key(2)}
    ids.revoke("b")  # before its peers' eviction is even recorded
    assert [x.public_key for x in room.view().members] == [_key(1)]
