"""Peers probing their links with real processes (comm/probe.py): a probe that fails aborts its
round like a collective and is not tried again for the same members; a joiner makes a new member
set, which is probed; the rates reach the coordinator; training bits are untouched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_a_failed_probe_costs_one_round_and_a_joiner_is_probed(cluster):
    c = cluster(start_peers=4)
    job = {"steps": 14, "probe_links": True, "step_delay": 0.05}
    c.spawn("a", **job)
    c.spawn("b", **job, faults=["fail@probe:step=0"])  # b fails after measuring its first pair
    c.spawn("c", **job)
    c.spawn("d", **job)
    deadline = time.monotonic() + 60
    while c.coord.status()["revision"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    c.spawn("e", **job)  # a new member set: probed
    codes = c.wait(timeout=120)
    assert codes == dict.fromkeys("abcde", 0), c.log("b")
    st = c.coord.status(events=1000)
    # the failed probe aborted round 0 once; the same four members did not probe again
    assert st["counters"]["rounds_aborted"] >= 1
    assert "injected failure at probe" in (c.dir / "b.log").read_text()
    for name in "acd":  # the four never probed again; the five probed once, and it held
        probing = [r for r in c.final(name)["rounds"] if "probe" in r["bytes_by_op"]]
        assert [(r["world"], r["outcome"]) for r in probing if r["world"] == 5] == [
            (5, "committed")
        ]
        assert all(r["outcome"] == "aborted" for r in probing if r["world"] == 4)
    # every member of the five reported its rate to the four others, by peer id
    ids = {p["name"]: p["id"] for p in st["peers"]}
    for name in "abcde":
        (peer,) = [p for p in st["peers"] if p["name"] == name]
        probed = peer["info"]["probed"]
        assert sorted(probed) == sorted(str(ids[n]) for n in "abcde" if n != name)
        assert all(x["mbit"] > 0 and x["rtt_ms"] >= 0 for x in probed.values())
    finals = {n: c.final(n) for n in "abcde"}
    assert len({f["digest"] for f in finals.values()}) == 1
    assert all(f["step"] == 14 for f in finals.values())
    assert_bitwise_equal(c.state("a"), c.state("e"))


@pytest.mark.root
def test_peers_probe_two_regions_and_the_ring_crosses_the_thin_link_twice(
    tmp_path: Path, prefix: str
) -> None:
    """scenarios/two_region.toml (1 Gbit/s inside eu and us, 50 Mbit/s and 80 ms between) with
    names that interleave the regions: name order crosses the thin link four times; once the
    peers' probes reach the coordinator, the ring crosses it twice."""
    from isthmus.coordinator.ring import crossings
    from isthmus.lab.scenario import load_scenario
    from isthmus.lab.wan import WanNetwork
    from isthmus.run.config import TimeoutConfig
    from isthmus.run.lab_run import NamespaceSpawner
    from isthmus.run.launch import Launcher, Script
    from isthmus.run.record import RunDir

    names = ["a", "c", "b", "d"]  # slots 0, 1 in eu and 2, 3 in us: by name eu, us, eu, us
    region = {0: "eu", 1: "eu", 2: "us", 3: "us"}
    spec = load_scenario(ROOT / "scenarios" / "two_region.toml").network
    with WanNetwork.from_spec(spec, prefix=prefix) as net:
        launcher = Launcher(
            Script(
                SCRIPTS / "probe_peer.py",
                ["--names", ",".join(names)],
                settings={"ISTHMUS_PROBE_LINKS": "1"},
            ),
            run_dir=RunDir.create(tmp_path / "run", "probe"),
            slots=4,
            spawner=NamespaceSpawner(net),
            timeouts=TimeoutConfig(run_timeout=240.0),
            progress=False,
        )
        outcome = launcher.run()
    codes = {i.name: i.returncode for i in outcome.incarnations}
    assert codes == {f"peer{s}": 0 for s in range(4)}, launcher.run_dir.tail("peer0")
    slot = {p["id"]: names.index(p["name"]) for p in outcome.status["peers"]}
    epochs = [[slot[m] for m in e["members"]] for e in outcome.events if e["kind"] == "epoch"]
    assert crossings(epochs[0], region) == 4  # name order
    assert crossings(epochs[-1], region) == 2  # ordered by the probed rates
    for p in outcome.status["peers"]:
        me = slot[p["id"]]
        probed = {slot[int(q)]: x for q, x in p["info"]["probed"].items()}
        assert sorted(probed) == sorted(s for s in range(4) if s != me)
        for other, x in probed.items():
            if region[other] == region[me]:  # 1 Gbit/s veths on one bridge
                assert x["mbit"] > 150 and x["rtt_ms"] < 20, (me, other, x)
            else:  # the 50 Mbit/s, 80 ms link between the sites
                assert x["mbit"] < 60 and x["rtt_ms"] > 70, (me, other, x)
