"""The mesh's pure rules (isthmus.mesh.plan, keys and the control-socket request), in one process."""

from __future__ import annotations

import base64

import pytest

from isthmus.mesh.keys import KeyPair, check_public_key, key_hex
from isthmus.mesh.plan import Node, WgPeer, classify_endpoint, diff, overlay_address, wg_peers
from isthmus.mesh.wg import uapi_set


def _key(i: int) -> str:
    return base64.b64encode(bytes([i]) * 32).decode()


A, B, C, D, R = (_key(i) for i in range(1, 6))


def test_addresses_count_up_and_end() -> None:
    assert overlay_address(0) == "10.99.0.1"
    assert overlay_address(255) == "10.99.1.0"
    assert overlay_address(0, "fd00::/64") == "fd00::1"
    with pytest.raises(ValueError, match="no host number"):
        overlay_address(254, "10.0.0.0/24")


def test_an_endpoint_is_usable_only_where_the_coordinator_saw_it() -> None:
    assert classify_endpoint(["10.0.0.2:51820"], "10.0.0.2") == "10.0.0.2:51820"
    # a NAT rewrote the source: nobody can send to the private address
    assert classify_endpoint(["192.168.1.5:51820"], "203.0.113.7") is None
    assert (
        classify_endpoint(["198.51.100.1:4000"], "203.0.113.7", public=True) == "198.51.100.1:4000"
    )
    assert classify_endpoint(["[fd00::2]:51820"], "fd00::2") == "[fd00::2]:51820"
    assert classify_endpoint([], "10.0.0.2") is None
    with pytest.raises(ValueError):
        classify_endpoint(["host.example:1"], "10.0.0.2")


def test_reachable_members_list_everyone_and_nat_members_keep_alive() -> None:
    nodes = [
        Node(A, "10.77.0.1", "10.0.0.1:1"),
        Node(B, "10.77.0.2", "10.0.0.2:1"),
        Node(C, "10.77.0.3", None),  # behind NAT
    ]
    a = wg_peers(A, nodes, keepalive=7)
    assert a == {
        B: WgPeer(B, "10.0.0.2:1", ("10.77.0.2/32",), 0),
        C: WgPeer(C, None, ("10.77.0.3/32",), 0),  # its endpoint is learned from its packets
    }
    c = wg_peers(C, nodes, keepalive=7)
    assert c == {
        A: WgPeer(A, "10.0.0.1:1", ("10.77.0.1/32",), 7),
        B: WgPeer(B, "10.0.0.2:1", ("10.77.0.2/32",), 7),
    }
    assert wg_peers(D, nodes) == {}  # removed: talks to no one


def test_two_nat_members_meet_through_the_relay_or_not_at_all() -> None:
    nodes = [
        Node(R, "10.77.0.1", "10.0.0.1:1", relay=True),
        Node(B, "10.77.0.2", "10.0.0.2:1"),
        Node(C, "10.77.0.3", None),
        Node(D, "10.77.0.4", None),
    ]
    c = wg_peers(C, nodes, keepalive=5)
    assert c[R].allowed_ips == ("10.77.0.1/32", "10.77.0.4/32")
    assert D not in c and c[B].allowed_ips == ("10.77.0.2/32",)
    # the relay itself lists both directly
    assert wg_peers(R, nodes)[D].allowed_ips == ("10.77.0.4/32",)
    no_relay = [Node(n.key, n.address, n.endpoint) for n in nodes]
    c = wg_peers(C, no_relay)
    assert D not in c and all(len(p.allowed_ips) == 1 for p in c.values())
    # a NATed member that offers to relay is not one
    nat_relay = [Node(C, "10.77.0.3", None, relay=True), Node(D, "10.77.0.4", None)]
    assert wg_peers(D, nat_relay) == {}


def test_diff_removes_adds_and_changes_only_what_differs() -> None:
    old = {A: WgPeer(A, "x:1", ("10.77.0.1/32",)), B: WgPeer(B, "y:1", ("10.77.0.2/32",))}
    new = {B: WgPeer(B, "y:2", ("10.77.0.2/32",)), C: WgPeer(C, None, ("10.77.0.3/32",))}
    removed, changed = diff(old, new)
    assert removed == (A,)
    assert changed == (new[B], new[C])
    assert diff(new, dict(new)) == ((), ())


def test_the_control_socket_request() -> None:
    text = uapi_set(
        private_key=A,
        listen_port=0,
        remove=[B],
        upsert=[WgPeer(C, "10.0.0.3:9", ("10.77.0.3/32",), 5), WgPeer(D, None, ("10.77.0.4/32",))],
    )
    assert text.endswith("\n\n")
    lines = text.splitlines()
    assert lines[:3] == ["set=1", f"private_key={'01' * 32}", "listen_port=0"]
    assert lines[3:5] == [f"public_key={'02' * 32}", "remove=true"]
    c = lines.index(f"public_key={'03' * 32}")
    assert lines[c + 1 : c + 5] == [
        "replace_allowed_ips=true",
        "endpoint=10.0.0.3:9",
        "persistent_keepalive_interval=5",
        "allowed_ip=10.77.0.3/32",
    ]
    d = lines.index(f"public_key={'04' * 32}")
    assert not any(x.startswith("endpoint=") for x in lines[d:])  # a learned one is kept


def test_keys() -> None:
    pair = KeyPair.generate()
    assert check_public_key(pair.public) is None and pair.private not in repr(pair)
    assert len(key_hex(pair.public)) == 64 and pair.public != pair.private
    assert check_public_key("short") is not None
    assert check_public_key("!" * 44) == "not base64"
    assert check_public_key(base64.b64encode(b"x" * 31).decode() + "=" * 0) is not None


def test_the_lab_keys_of_the_mesh() -> None:
    from isthmus.lab.scenario import parse_scenario
    from isthmus.spec import SpecError

    base = '[run]\nname = "m"\nsteps = 5\n[strategy]\nname = "ddp"\nmesh = true\n'
    sc = parse_scenario(base + '[network]\npeers = 3\nrate = "10mbit"\nnat = [2, 1]\n')
    assert sc.config.strategy.mesh is True and sc.network.nat == (1, 2)
    sc = parse_scenario(base + '[network]\npeers = 3\nrate = "10mbit"\nnat = 0\n')
    assert sc.network.nat == (0,)
    assert parse_scenario(base + '[network]\npeers = 2\nrate = "10mbit"\n').network.nat == ()
    with pytest.raises(SpecError, match="nat"):
        parse_scenario(base + '[network]\npeers = 2\nrate = "10mbit"\nnat = [2]\n')


def test_the_run_hands_the_mesh_to_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    from isthmus.comm.session_config import SessionConfig
    from isthmus.runconfig import RunConfig, apply_overrides

    monkeypatch.setenv("ISTHMUS_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("ISTHMUS_TOKEN", "t")
    monkeypatch.setenv("ISTHMUS_MESH", "1")
    assert SessionConfig.from_env().mesh is True
    monkeypatch.setenv("ISTHMUS_MESH", "0")
    assert SessionConfig.from_env().mesh is False
    assert apply_overrides(RunConfig(), {"mesh": True}).strategy.mesh is True
    with pytest.raises(ValueError, match="mesh_port"):
        SessionConfig(coordinator="c:1", token="t", mesh_port=70000)
