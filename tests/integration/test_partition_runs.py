"""A link between two live peers breaks while both still reach the coordinator (root: network
namespaces and nftables): the run goes on with the largest set of members that all reach each
other, the member left out is told why and keeps heartbeating, and once the link heals it is
resynced and taken back; every peer ends bit-identical.

One run of 4 DDP peers (the tiny model) on a bridge, two cuts in turn: every packet between
peer1 and peer2 dropped (silent), then every TCP connection between peer0 and peer3 refused
(a reset), each healed before the next. The drop lands wherever it lands in a round: with data
in flight at both ends, with one end's data held unsent by its own kernel (the rules sit in
peer1's namespace, on output too), or after one end's collective completed with its last data
still in its kernel (the coordinator learns that from the end's heartbeats). Assertions are on
the coordinator's record (commits, their world, isolation events), never on wall-clock times.
"""

from __future__ import annotations

import contextlib
import json
import os
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
from isthmus.run import forkserver
from isthmus.run.forkserver import PeerProcess
from isthmus.run.job import PeerJob

pytestmark = pytest.mark.root

TOKEN = "partition-test-token"
NETNS_EXEC = Path(__file__).resolve().parent / "scripts" / "netns_exec.py"


def _start_coordinator_in(netns: str, config: CoordinatorConfig) -> Coordinator:
    """A coordinator in this process whose sockets live in ``netns``: started from this thread
    inside it (the server's threads inherit the namespace; this thread goes back)."""
    with inside_namespace(netns):
        return Coordinator(config).start()


def _nft(net: WanNetwork, peer: int, script: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", net.node(peer).netns, "nft", "-f", "-"],
        input=script,
        text=True,
        check=True,
        capture_output=True,
        timeout=20,
    )


def _cut(net: WanNetwork, a: int, b: int, *, refuse: bool) -> None:
    """Break the link between ``a`` and ``b``: every packet between them dropped (both
    directions, in ``a``'s namespace), or every TCP segment but a reset arriving from the other
    end answered with a reset (in both namespaces, on input only)."""
    if refuse:
        for x, y in ((a, b), (b, a)):
            ip = net.node(y).ip
            hook = "type filter hook input priority 0"
            # not the other end's resets, or each side would swallow the other's
            rule = f"ip saddr {ip} tcp flags & rst == 0 reject with tcp reset"
            _nft(net, x, f"table inet cut {{\n  chain in {{ {hook}; {rule};\n  }}\n}}\n")
        return
    ip = net.node(b).ip
    _nft(
        net,
        a,
        f"""table inet cut {{
  chain in {{ type filter hook input priority 0; ip saddr {ip} drop; }}
  chain out {{ type filter hook output priority 0; ip daddr {ip} drop; }}
}}
""",
    )


def _heal(net: WanNetwork, *peers: int) -> None:
    for x in peers:
        _nft(net, x, "delete table inet cut\n")


class Run:
    def __init__(self, net: WanNetwork, coord: Coordinator, out: Path) -> None:
        self.net, self.coord, self.out = net, coord, out
        self.procs: dict[str, PeerProcess] = {}

    def spawn(self, i: int, **job: Any) -> None:
        name = f"peer{i}"
        j = PeerJob.from_flat(
            coordinator=f"{self.net.coordinator.ip}:{self.coord.port}",
            token=TOKEN,
            name=name,
            out_dir=str(self.out),
            interface=self.net.node(i).ifname,
            **job,
        )
        path = self.out / f"{name}.job.json"
        path.write_text(j.to_json())
        # forked from the warm server (torch and the job imported) into the node's namespace,
        # rather than a fresh interpreter under `ip netns exec`: four fresh peers cost seconds
        # of CPU each before the first round, on a machine running other tests beside this one
        self.procs[name] = forkserver.popen(
            [
                sys.executable,
                str(NETNS_EXEC),
                self.net.node(i).netns,
                "-m",
                "isthmus.run.job",
                str(path),
            ],
            env={**os.environ, **self.net.env(i), "PYTHONUNBUFFERED": "1"},
            log_path=self.out / f"{name}.log",
        )

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")[-3000:]

    def events(self) -> list[dict[str, Any]]:
        return self.coord.events()

    def wait_for(self, pred: Callable[[list[dict[str, Any]]], Any], what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred(self.events())
            if got:
                return got
            for n, p in self.procs.items():
                if p.poll() is not None and p.returncode != 0:
                    raise AssertionError(f"{n} exited {p.returncode}:\n{self.log(n)}")
            time.sleep(0.1)
        logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)
        raise AssertionError(f"timed out waiting for {what}; status {self.coord.status()}\n{logs}")


def _commits(evs: list[dict[str, Any]], after: float, world: int) -> list[dict[str, Any]]:
    return [e for e in evs if e["kind"] == "commit" and e["t"] > after and e["world"] == world]


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
def _coordinator(net: WanNetwork, membership: MembershipConfig) -> Coordinator:
    """The run's coordinator, started inside the lab's coordinator namespace."""
    return _start_coordinator_in(
        net.coordinator.netns,
        CoordinatorConfig(
            token=TOKEN,
            host=net.coordinator.ip,
            port=0,
            heartbeat_interval=0.25,
            membership=membership,
        ),
    )


def test_a_broken_link_sits_one_end_out_and_a_healed_one_takes_it_back(
    tmp_path: Path, prefix: str
) -> None:
    # ISTHMUS_PARTITION_DEFAULTS=1 (a benchmark, not the suite's setting): the built-in job's
    # default collective timeout and the default probe interval, and a run long enough for them
    defaults = os.environ.get("ISTHMUS_PARTITION_DEFAULTS") == "1"
    membership = MembershipConfig(
        start_peers=4,
        heartbeat_timeout=3.0,
        partition=PartitionConfig() if defaults else PartitionConfig(probe_every_s=1.0),
    )
    with WanNetwork(4, prefix=prefix) as net:
        coord = _coordinator(net, membership)
        run = Run(net, coord, tmp_path)
        try:
            job = {
                "model": "tiny",
                "corpus_bytes": 200_000,
                # the two cuts and heals take a few dozen rounds; the rest is margin for a
                # loaded machine, where the test's own thread reacts late
                "steps": 1500 if defaults else 200,
                "step_delay": 0.02,
                "batch_size": 8,
                "strategy": "ddp",
                # a collective stuck on a silent link fails after this; the group of a new
                # epoch must connect within it, too
                "collective_timeout": 30.0 if defaults else 5.0,
                "connect_timeout": 10.0,
                "round_timeout": 300.0,
            }
            for i in range(4):
                run.spawn(i, **job)
            run.wait_for(lambda ev: _commits(ev, 0, 4)[4:], "4 peers to commit 5 rounds", 180)
            figures: dict[str, float] = {}
            for label, (a, b), refuse in (("drop", (1, 2), False), ("refuse", (0, 3), True)):
                pair = {f"peer{a}", f"peer{b}"}
                t_cut = coord.now()
                _cut(net, a, b, refuse=refuse)
                three = run.wait_for(
                    lambda ev, t=t_cut: _commits(ev, t, 3), f"3 members to commit ({label})", 180
                )[0]
                iso = [e for e in run.events() if e["kind"] == "isolated" and e["t"] > t_cut]
                assert iso and iso[0]["name"] in pair, iso
                out = iso[0]["name"]
                other = (pair - {out}).pop()
                assert iso[0]["reason"].startswith("isolated: "), iso
                assert other in iso[0]["reason"], iso
                st = coord.status()
                assert [p["isolated"] for p in st["peers"] if p["name"] == out][-1]
                assert any(p["name"] == out and p["state"] == "active" for p in st["peers"])
                # the three go on; the isolated one is still registered and heartbeating
                run.wait_for(lambda ev, t=three["t"]: _commits(ev, t, 3)[2:], "3 more commits", 60)
                t_heal = coord.now()
                _heal(net, *((a, b) if refuse else (a,)))
                back = run.wait_for(
                    lambda ev, t=t_heal: _commits(ev, t, 4), f"4 members again ({label})", 120
                )[0]
                readmitted = [
                    e for e in run.events() if e["kind"] == "readmitted" and e["t"] > t_heal
                ]
                assert [e["name"] for e in readmitted] == [out], readmitted
                resync = [e for e in run.events() if e["kind"] == "resync" and e["t"] > t_heal]
                assert resync, "the member taken back was not resynced"
                aborts = [e for e in run.events() if e["kind"] == "abort" and e["t"] > t_cut]
                print(f"PARTITION_ABORT {label}: {aborts[0]['reason'] if aborts else None}")
                figures[f"{label}_cut_to_commit_s"] = round(three["t"] - t_cut, 2)
                figures[f"{label}_heal_to_full_s"] = round(back["t"] - t_heal, 2)
            print("PARTITION_FIGURES", json.dumps(figures))
            for n, p in run.procs.items():
                assert p.wait(300) == 0, run.log(n)
            finals = {n: json.loads((tmp_path / f"{n}.final.json").read_text()) for n in run.procs}
            assert len({f["digest"] for f in finals.values()}) == 1, finals
            assert len({f["model_digest"] for f in finals.values()}) == 1
            st = coord.status()
            assert st["counters"]["parity_failures"] == 0
            assert st["counters"]["isolations"] == 2 and st["counters"]["readmissions"] == 2
        finally:
            for p in run.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    if p.poll() is None:
                        p.kill()
                        p.wait(10)
            coord.stop()


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
def test_a_pair_that_cannot_connect_at_the_start_is_named_and_the_run_starts_without_one_end(
    tmp_path: Path, prefix: str
) -> None:
    membership = MembershipConfig(
        start_peers=3, heartbeat_timeout=3.0, partition=PartitionConfig(probe_every_s=1.0)
    )
    with WanNetwork(3, prefix=prefix) as net:
        coord = _coordinator(net, membership)
        run = Run(net, coord, tmp_path)
        try:
            _cut(net, 1, 2, refuse=True)  # before anyone connects
            for i in range(3):
                run.spawn(
                    i,
                    model="tiny",
                    corpus_bytes=200_000,
                    steps=100,
                    step_delay=0.02,
                    batch_size=8,
                    strategy="ddp",
                    collective_timeout=5.0,  # the connect bound of every epoch
                    connect_timeout=10.0,
                    round_timeout=300.0,
                )
            first = run.wait_for(lambda ev: _commits(ev, 0, 2), "the first commit (2 members)", 120)
            evs = run.events()
            # the first epoch failed to connect; the ends of the broken pair named each other
            unreachable = [e for e in evs if e["kind"] == "unreachable" and e["t"] < first[0]["t"]]
            # (the first report aborts the epoch; the other end, told so, need not report)
            pairs = {(e["name"], e["remote_name"]) for e in unreachable}
            assert pairs and pairs <= {("peer1", "peer2"), ("peer2", "peer1")}, unreachable
            assert all(e["how"] == "refused" for e in unreachable), unreachable
            addresses = {e["remote_name"]: e["address"] for e in unreachable}
            ips = {"peer1": net.node(1).ip, "peer2": net.node(2).ip}
            assert all(a.startswith(ips[n] + ":") for n, a in addresses.items()), addresses
            iso = [e for e in evs if e["kind"] == "isolated"]
            assert len(iso) == 1 and iso[0]["name"] in ("peer1", "peer2"), iso
            out = iso[0]["name"]
            other = "peer2" if out == "peer1" else "peer1"
            # named from whichever end's report came last
            assert iso[0]["reason"] in (
                f"isolated: cannot reach {other} at {addresses.get(other)} (refused)",
                f"isolated: {other} cannot reach it at {addresses.get(out)} (refused)",
            ), iso
            t_heal = coord.now()
            _heal(net, 1, 2)
            run.wait_for(lambda ev: _commits(ev, t_heal, 3), "3 members after the heal", 120)
            for n, p in run.procs.items():
                assert p.wait(300) == 0, run.log(n)
            finals = [json.loads((tmp_path / f"{n}.final.json").read_text()) for n in run.procs]
            assert len({f["digest"] for f in finals}) == 1, finals
        finally:
            for p in run.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    if p.poll() is None:
                        p.kill()
                        p.wait(10)
            coord.stop()
