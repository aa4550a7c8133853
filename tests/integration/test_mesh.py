"""The run's WireGuard mesh between lab namespaces (root, iproute2, nftables, wireguard-go).

* ``test_mesh_hides_tensors_and_drops_a_revoked_peer``: three peers, one behind a NAT router
  that accepts no inbound connection, gather a tensor of a known byte pattern inside the mesh
  while tcpdump records every link at the bridge: the pattern is not on the wire (a datagram
  sent in clear beside it is, so the capture sees plaintext). Then the operator revokes the
  NATed peer's join token: every member drops its key within seconds, and its packets, sent
  with its key as an attacker holding it would, reach no member.
* ``test_lab_run_with_nat_and_mesh_trains_through_a_kill_and_a_join``: the lab runner with
  ``[strategy] mesh`` and ``[network] nat``: DDP through a kill and a join ends in parity.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.coordinator.auth import join_token
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.lab.netns import inside_namespace
from isthmus.lab.scenario import parse_scenario
from isthmus.lab.wan import WanNetwork
from isthmus.run import forkserver
from isthmus.run.forkserver import PeerProcess
from isthmus.run.lab_run import LabOptions, run_lab

MISSING = [t for t in ("wireguard-go", "tcpdump", "nft", "wg") if shutil.which(t) is None]
needs_tools = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)} (tools/test_deps.sh installs them)"
)
SCRIPT = Path(__file__).parent / "scripts" / "mesh_peer.py"
NETNS_EXEC = Path(__file__).parent / "scripts" / "netns_exec.py"
ADMIN = "mesh-test-admin-token"
TENSOR = "49534854484d55532d54454e534f522d"  # b"ISTHMUS-TENSOR-" + "-", as hex
CLEAR = b"ISTHMUS-CLEARTEXT-CONTROL"


def _wait(what: str, cond, timeout: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _peers_of(ifname: str) -> set[str]:
    out = subprocess.run(["wg", "show", ifname, "peers"], capture_output=True, text=True)
    return set(out.stdout.split())


def _send(net: WanNetwork, peer: int, host: str, port: int, data: bytes) -> None:
    code = (
        "import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); "
        f"[s.sendto({data!r},({host!r},{port})) for _ in range(3)]"
    )
    net.run(peer, [sys.executable, "-c", code], timeout_s=30)


@pytest.mark.root
@needs_tools
def test_mesh_hides_tensors_and_drops_a_revoked_peer(tmp_path: Path, prefix: str) -> None:
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    stop = tmp_path / "stop"
    procs: list[PeerProcess] = []
    with WanNetwork(3, rates_mbit=100, nat=[1, 2], prefix=prefix) as net:
        membership = MembershipConfig(start_peers=3, start_timeout=60.0)
        with inside_namespace(net.coordinator.netns):
            coord = Coordinator(
                CoordinatorConfig(
                    token=ADMIN, host=net.coordinator.ip, port=0, membership=membership
                )
            ).start()
        pcap = tmp_path / "links.pcap"
        dump = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                net.bridge_netns,
                "tcpdump",
                "--immediate-mode",  # every packet at once, not a buffer's worth at the end
                "-B",  # a 16 MiB buffer: the capture once came up a fifth short under make
                "16384",  # test's load; tcpdump may fall behind without the kernel dropping
                "-i",
                "any",
                "-s",
                "0",
                "-U",
                "-w",
                str(pcap),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "tcpdump.err", "wb"),  # noqa: SIM115
        )
        try:
            err = tmp_path / "tcpdump.err"
            _wait("tcpdump to listen", lambda: b"listening" in err.read_bytes(), timeout=30)
            for i in range(3):
                argv = [
                    sys.executable, str(SCRIPT),
                    "--coordinator", coord.address,
                    "--token", join_token(ADMIN, f"peer{i}"),
                    "--name", f"peer{i}",
                    "--hostname", net.peers[i].ip,
                    "--pattern", TENSOR,
                    "--out", str(tmp_path / f"got{i}"),
                    "--stop", str(stop),
                    *(["--relay"] if i == 0 else []),
                ]  # fmt: skip
                # forked from the warm server (torch imported) into the peer's namespace: a
                # fresh interpreter under `ip netns exec` costs seconds of CPU before it joins
                argv[1:1] = [str(NETNS_EXEC), net.peers[i].netns]
                procs.append(
                    forkserver.popen(
                        argv,
                        env={**os.environ, **net.env(i), **env},
                        log_path=tmp_path / f"peer{i}.log",
                    )
                )
            logs = [tmp_path / f"peer{i}.log" for i in range(3)]

            def text(f: Path) -> str:  # a forked peer creates its own log: maybe not yet
                return f.read_text() if f.exists() else ""

            def done() -> bool:
                for p, f in zip(procs, logs, strict=True):
                    assert p.poll() is None, text(f)[-3000:]
                return all("DONE" in text(f) for f in logs)

            _wait("three peers to gather inside the mesh", done, timeout=120)
            info = [
                json.loads(
                    next(ln for ln in f.read_text().splitlines() if ln.startswith("MESH "))[5:]
                )
                for f in logs
            ]
            assert [m["nat"] for m in info] == [False, True, True]
            assert all(m["gloo"] == m["address"] for m in info)  # Gloo bound the overlay
            # plaintext beside the mesh, over the same links: the capture sees it
            _send(net, 0, net.coordinator.ip, 9, CLEAR)
            # a NATed peer reaches a member, and the other NATed peer through the relay
            _send(net, 2, info[0]["address"], 7777, b"before-revoke")
            _send(net, 2, info[1]["address"], 7777, b"through-the-relay")
            for got, what in (("got0", "before-revoke"), ("got1", "through-the-relay")):
                f = tmp_path / got
                _wait(what, lambda f=f, w=what: f.exists() and w in f.read_text(), timeout=20)
            time.sleep(1.0)  # tcpdump writes what it has seen
        finally:
            dump.terminate()
            dump.wait(10)
        wire = pcap.read_bytes()
        assert CLEAR in wire, "the capture must see what is sent in clear"
        assert bytes.fromhex(TENSOR) not in wire, "a tensor's bytes crossed a link in clear"
        assert len(wire) > 3 * 3 * 64 * 1024, "the gathered tensors crossed the links (encrypted)"

        try:
            # revoke peer2's token: every member drops its key
            revoked = asyncio.run_coroutine_threadsafe(coord.admin.revoke("peer2"), coord._loop)
            assert revoked.result(10) != []
            key2 = info[2]["key"]
            took = _wait(
                "members to drop the revoked key",
                lambda: all(key2 not in _peers_of(info[i]["ifname"]) for i in (0, 1)),
                timeout=10,
            )
            print(f"revoked peer removed from every member in {took:.2f}s")
            # the revoked peer still holds its private key: it points its interface at peer0
            # again and sends; peer0 no longer knows the key, so WireGuard drops it
            endpoint = f"{net.peers[0].ip}:{info[0]['port']}"
            subprocess.run(
                ["wg", "set", info[2]["ifname"], "peer", info[0]["key"], "endpoint", endpoint,
                 "allowed-ips", f"{info[0]['address']}/32", "persistent-keepalive", "1"],
                check=True,
            )  # fmt: skip
            for _ in range(5):
                _send(net, 2, info[0]["address"], 7777, b"after-revoke")
                time.sleep(0.4)
            assert "after-revoke" not in (tmp_path / "got0").read_text()
        finally:
            stop.touch()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            coord.stop()
    for m in info:
        assert not Path(f"/var/run/wireguard/{m['ifname']}.sock").exists()


NAT_MESH = """
description = "three peers in the mesh, one behind NAT; a kill and a join"
[run]
name = "nat_mesh"
steps = 60
model = "tiny"
[strategy]
name = "ddp"
mesh = true
[network]
peers = 3
rate = "100mbit"
nat = [2]
[[churn]]
action = "kill"
peer = 1
at_step = 5
[[churn]]
action = "join"
peer = 1
at_step = 6
"""


@pytest.mark.root
@needs_tools
def test_lab_run_with_nat_and_mesh_trains_through_a_kill_and_a_join(
    tmp_path: Path, prefix: str
) -> None:
    sc = parse_scenario(NAT_MESH, source="nat_mesh.toml")
    s = run_lab(
        sc,
        LabOptions(prefix=prefix),
        overrides={
            "run_dir": str(tmp_path),
            "step_delay": 0.5,  # a fresh peer needs seconds to start: it joins a live run
            "corpus_bytes": 200_000,
            "batch_size": 8,
            "progress": False,
            "collective_timeout": 20.0,
            "timeout": 240.0,
        },
    )
    assert s.lab is not None and s.lab.network["mode"] == "netns"
    codes = s.exit_codes
    assert codes["peer0"] == 0 and codes["peer2"] == 0 and codes["peer1"] < 0, codes
    assert codes["peer1.1"] == 0, (tmp_path / "peer1.1.log").read_text()[-3000:]
    assert s.kills == 1 and s.joins == 1
    assert s.parity_failures == 0 and s.peers_final == 3
    logs = {p: (tmp_path / f"{p}.log").read_text() for p in ("peer0", "peer2", "peer1.1")}
    assert "behind NAT" in logs["peer2"] and "reachable" in logs["peer0"]
    assert "joined the mesh" in logs["peer1.1"]


@pytest.mark.root
@needs_tools
def test_what_the_mesh_refuses_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """No wireguard-go, no TUN device, a key the members do not hold, a revoked token: each is
    refused with a message that says what is wrong, and nothing is left behind."""
    from isthmus.comm.mesh_agent import MeshAgent
    from isthmus.comm.session_config import SessionConfig
    from isthmus.coordinator.client import AuthError, CoordinatorClient
    from isthmus.mesh import MeshError
    from isthmus.mesh import wg as wg_mod
    from isthmus.mesh.keys import KeyPair

    real_which = shutil.which
    with monkeypatch.context() as m:
        m.setattr(wg_mod.shutil, "which", lambda n: None if n == "wireguard-go" else real_which(n))
        with pytest.raises(MeshError, match="apt-get install wireguard-go"):
            wg_mod.Interface.create("ismtest0")
    real_exists = os.path.exists
    with monkeypatch.context() as m:
        m.setattr(wg_mod.os.path, "exists", lambda p: p != "/dev/net/tun" and real_exists(p))
        with pytest.raises(MeshError, match=r"/dev/net/tun is missing.*modprobe tun"):
            wg_mod.Interface.create("ismtest0")

    fake = KeyPair.generate().public

    class WrongKey(MeshAgent):
        def reported_key(self) -> str:
            return fake  # not the key this peer's WireGuard holds

    coord = Coordinator(CoordinatorConfig(token=ADMIN, port=0)).start()
    agents: list[MeshAgent] = []
    clients: list[CoordinatorClient] = []  # the caller owns a client; the agent does not close it
    try:

        def config(name: str) -> SessionConfig:
            return SessionConfig(
                coordinator=coord.address,
                token=join_token(ADMIN, name),
                mesh=True,
                mesh_handshake_timeout=2.0,
            )

        def client(name: str) -> CoordinatorClient:
            c = CoordinatorClient(coord.address, join_token(ADMIN, name), connect_timeout=5)
            clients.append(c)
            return c

        agents.append(MeshAgent.start(client("good"), config("good"), "good"))
        with pytest.raises(MeshError, match=r"no WireGuard handshake.*refuse this peer's key"):
            WrongKey.start(client("liar"), config("liar"), "liar")
        asyncio.run_coroutine_threadsafe(coord.admin.revoke("gone"), coord._loop).result(10)
        with pytest.raises(AuthError, match="revoked"):
            MeshAgent.start(client("gone"), config("gone"), "gone")
    finally:
        for a in agents:
            a.close()
        for c in clients:
            c.close()
        coord.stop()
    assert not [p for p in Path("/var/run/wireguard").glob(f"ism{os.getpid()}.*")]
