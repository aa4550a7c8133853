"""A link cut between two islands' followers in a real run (root: network namespaces and
nftables): two islands of two ranks train DDP (FSDP2 inside each island) against a coordinator
of their own; once they commit together, every packet between island0's follower and
island1's follower is dropped, while both leaders, and both followers' ties to the coordinator
and to their own leaders, stay clean. The round aborts within seconds naming the pair of
islands (``stalled``: a follower's connection went silent past ``stall_s``, whether its data
was still in flight or already handed to its kernel), the pair is marked down, and the run
goes on: the next rounds commit with one island while the other sits out, told why. Probes of
the pair go rank to rank (every ``probe_every_s``, 3 s here): while the cut holds the
followers' probe fails, so the pair stays down and no round of both is formed (no attempt
hangs in the followers' connect bound); once the drop rules are removed the next probe
connects on every path and the island is taken back and commits with the other.

Each island lives in a namespace of its own (one node of :class:`~isthmus.lab.wan.WanNetwork`);
its follower binds its cross-island group to a second address of that node
(``ISTHMUS_HOSTNAME``), so the drop rules can tell the followers' traffic from the leaders'.
Assertions are on the coordinator's record, never on wall-clock times (the times are printed).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.partition import PartitionConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.lab.netns import inside_namespace
from isthmus.lab.wan import WanNetwork

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)"
    ),
]

TOKEN = "island-cut-test-token"
SCRIPT = Path(__file__).resolve().parent / "scripts" / "island_peer.py"
SRC = Path(__file__).resolve().parents[2] / "src"
NAMES = ("island0", "island1")


def _coordinator_in(netns: str, config: CoordinatorConfig) -> Coordinator:
    """A coordinator in this process whose sockets live in ``netns``: started from this thread
    inside it (the server's threads inherit the namespace; this thread goes back)."""
    with inside_namespace(netns):
        return Coordinator(config).start()


def _follower_ip(leader_ip: str) -> str:
    """The second address of a node, which its island's follower binds (10.77.0.2 -> .12)."""
    head, _, last = leader_ip.rpartition(".")
    return f"{head}.{int(last) + 10}"


def _spawn(
    net: WanNetwork, coord: Coordinator, island: int, out: Path
) -> list[subprocess.Popen[Any]]:
    """The two ranks of island ``island``, torchrun's way, in its node's namespace."""
    node = net.node(island)
    procs = []
    for rank in (0, 1):
        env = {
            "PYTHONPATH": str(SRC),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29531",
            "ISTHMUS_NPROC_PER_PEER": "2",
            "ISTHMUS_LOCAL_RANK": str(rank),
            "ISTHMUS_COORDINATOR": f"{net.coordinator.ip}:{coord.port}",
            "ISTHMUS_TOKEN": TOKEN,
            "ISTHMUS_NAME": NAMES[island],
            "ISTHMUS_PEER": str(island),
            "ISTHMUS_HOSTNAME": node.ip if rank == 0 else _follower_ip(node.ip),
            "ISTHMUS_STALL_S": "2",
        }
        argv = [sys.executable, str(SCRIPT), "--strategy", "ddp", "--steps", "100000"]
        log = open(out / f"{NAMES[island]}.{rank}.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(
            net.popen(
                island,
                [*argv, "--delay", "0.05", "--out", str(out)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def _cut_followers(net: WanNetwork) -> None:
    """Drop every packet between island0's follower and island1's (both ways, in island0's
    namespace). A follower's connections may leave from its node's first address (the kernel
    picks the source of a socket that was not bound), so what reaches island0's follower from
    island1's node is dropped too: no leader ever talks to the other island's follower."""
    mine, theirs = _follower_ip(net.node(0).ip), _follower_ip(net.node(1).ip)
    other = net.node(1).ip
    rules = f"""table inet cut {{
  chain in {{ type filter hook input priority 0;
    ip saddr {theirs} drop; ip saddr {other} ip daddr {mine} drop; }}
  chain out {{ type filter hook output priority 0;
    ip daddr {theirs} drop; ip saddr {mine} ip daddr {other} drop; }}
}}
"""
    subprocess.run(
        ["ip", "netns", "exec", net.node(0).netns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
        timeout=20,
    )


def _heal(net: WanNetwork) -> None:
    subprocess.run(
        ["ip", "netns", "exec", net.node(0).netns, "nft", "delete", "table", "inet", "cut"],
        check=True,
        capture_output=True,
        timeout=20,
    )


def _wait_for(
    coord: Coordinator,
    procs: list[subprocess.Popen[Any]],
    out: Path,
    pred: Callable[[list[dict[str, Any]]], Any],
    what: str,
    timeout: float,
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred(coord.events())
        if got:
            return got
        if any(p.poll() is not None for p in procs):
            break  # a rank ended: the run cannot get there
        time.sleep(0.1)
    logs = "\n".join(
        f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}" for f in sorted(out.glob("*.log"))
    )
    raise AssertionError(f"no {what} within {timeout}s; status {coord.status()}\n{logs}")


def _commits(evs: list[dict[str, Any]], after: float, world: int) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == "commit" and e["t"] > after and e["world"] == world]


def test_a_cut_between_two_islands_followers_aborts_naming_them_and_the_run_goes_on(
    tmp_path: Path, prefix: str
) -> None:
    membership = MembershipConfig(
        start_peers=2,
        heartbeat_timeout=3.0,
        # probes go rank to rank: the followers' path is probed every 3 s
        partition=PartitionConfig(probe_every_s=3.0),
    )
    procs: list[subprocess.Popen[Any]] = []
    with WanNetwork(2, prefix=prefix) as net:
        for i in (0, 1):  # the follower's own address on the island's node
            follower = f"{_follower_ip(net.node(i).ip)}/24"
            subprocess.run(
                ["ip", "-n", net.node(i).netns, "addr", "add", follower, "dev", net.node(i).ifname],
                check=True,
                capture_output=True,
                timeout=20,
            )
        coord = _coordinator_in(
            net.coordinator.netns,
            CoordinatorConfig(
                token=TOKEN,
                host=net.coordinator.ip,
                port=0,
                heartbeat_interval=0.25,
                membership=membership,
            ),
        )
        try:
            for i in (0, 1):
                procs += _spawn(net, coord, i, tmp_path)
            _wait_for(
                coord,
                procs,
                tmp_path,
                lambda ev: _commits(ev, 0, 2)[2:],
                "3 commits of both islands",
                240,
            )
            t_cut = coord.now()
            _cut_followers(net)

            def down(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [e for e in ev if e["kind"] == "unreachable" and e["t"] > t_cut]

            named = _wait_for(coord, procs, tmp_path, down, "the pair named", 60)
            pairs = {(e["name"], e["remote_name"]) for e in named}
            assert pairs <= {NAMES, NAMES[::-1]}, named
            assert all(e["how"] == "stalled" for e in named), named
            # the address named is the other island's probe listener: its follower's (a rank's
            # failure names the rank it could not reach), or its leader's (the coordinator's
            # rule for data handed over names the member)
            ips = {NAMES[i]: net.node(i).ip for i in (0, 1)}
            hosts = {n: (ip, _follower_ip(ip)) for n, ip in ips.items()}
            assert all(e["address"].rpartition(":")[0] in hosts[e["remote_name"]] for e in named), (
                named
            )
            aborts = [e for e in coord.events() if e["kind"] == "abort" and e["t"] > t_cut]
            assert aborts, coord.events()[-20:]
            # the run goes on with one island; the other sits out, told why
            alone = _wait_for(
                coord,
                procs,
                tmp_path,
                lambda ev: _commits(ev, t_cut, 1)[1:],
                "2 commits of one island",
                120,
            )
            iso = [e for e in coord.events() if e["kind"] == "isolated" and e["t"] > t_cut]
            assert len(iso) == 1 and iso[0]["name"] in NAMES, iso
            other = NAMES[1 - NAMES.index(iso[0]["name"])]
            assert other in iso[0]["reason"] and "(stalled)" in iso[0]["reason"], iso
            st = coord.status()
            assert st["down_pairs"] == [list(NAMES)], st["down_pairs"]
            assert not _commits(coord.events(), t_cut, 2), "a round of both over the cut"
            print(
                f"ISLAND_CUT named after {named[0]['t'] - t_cut:.1f}s, aborted after "
                f"{aborts[0]['t'] - t_cut:.1f}s ({aborts[0]['reason'][:300]}), first commit "
                f"alone after {alone[0]['t'] - t_cut:.1f}s"
            )

            # while the cut holds, the probes (rank to rank) fail: the pair stays down through
            # several of them, and the kept island commits on without a failed attempt
            reach = coord.membership.reach
            t_hold, probes_seen = coord.now(), set()

            def probed_down(_ev: list[dict[str, Any]]) -> bool:
                st = reach.pair_state(*NAMES)
                assert st.down, "the pair was taken back while the cut holds"
                if st.last_probe_at is not None and st.last_probe_at > t_hold:
                    probes_seen.add(st.last_probe_at)
                return len(probes_seen) >= 4

            _wait_for(coord, procs, tmp_path, probed_down, "4 failed probes of the pair", 120)
            evs = coord.events()
            held = _commits(evs, t_hold, 1)
            assert len(held) >= 2, "the kept island stopped committing while the cut held"
            assert not _commits(evs, t_cut, 2), "a round of both over the cut"
            assert not [e for e in evs if e["kind"] == "readmitted" and e["t"] > t_cut], evs[-20:]
            later = [e for e in evs if e["kind"] == "abort" and e["t"] > alone[0]["t"]]
            assert not later, f"an attempt failed while the pair was down: {later}"
            print(
                f"ISLAND_CUT held {coord.now() - t_hold:.1f}s: {len(probes_seen)} failed probes, "
                f"{len(held)} commits of one island, no abort"
            )

            # the link heals: the next probe connects on every path, the island is taken back
            t_heal = coord.now()
            _heal(net)
            back = _wait_for(
                coord,
                procs,
                tmp_path,
                lambda ev: [e for e in ev if e["kind"] == "readmitted" and e["t"] > t_heal],
                "the island taken back",
                120,
            )
            assert back[0]["name"] == iso[0]["name"], back
            both = _wait_for(
                coord,
                procs,
                tmp_path,
                lambda ev: _commits(ev, t_heal, 2),
                "a commit of both islands after the heal",
                180,
            )
            assert coord.status()["down_pairs"] == [], coord.status()["down_pairs"]
            print(
                f"ISLAND_CUT healed: taken back after {back[0]['t'] - t_heal:.1f}s, "
                f"both commit after {both[0]['t'] - t_heal:.1f}s"
            )
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    if p.poll() is None:
                        p.kill()
                    p.wait(10)
            coord.stop()
