"""Latency, jitter and loss in the emulated WAN (user-space delay lines) and sites joined by thin
links: what the settings promise is what ping and TCP measure, and the lines vanish on every exit.

These tests build namespaces: they need root and iproute2 and are skipped with the reason
otherwise (the ``prefix`` fixture). Round trips use ``ping`` where it is installed and TCP connect
times otherwise; the jitter and loss test needs ``ping`` (a lost SYN costs a second per retry).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from isthmus.lab import linkprobe as probe
from isthmus.lab.fidelity import measure_rtt_ms, serve_probe, windowed
from isthmus.lab.netns import LabError, cleanup_stale, list_namespaces, run_cmd
from isthmus.lab.netspec import Impairment
from isthmus.lab.scenario import load_scenario
from isthmus.lab.wan import WanNetwork
from isthmus.run.lab_run import LabOptions, run_lab

ROOT = Path(__file__).resolve().parents[2]
TWO_REGION = ROOT / "scenarios" / "two_region.toml"

pytestmark = pytest.mark.root


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix + "-")]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_link_at_80ms_measures_80ms_and_a_windowed_transfer_slows_as_predicted(
    prefix: str,
) -> None:
    with WanNetwork(2, rates_mbit=100, impairments=Impairment(rtt_ms=80), prefix=prefix) as net:
        assert [line.cfg.name for line in net.lines] == ["peer0", "peer1"]
        assert all(line.alive() for line in net.lines) and net.rtt_ms(0, 1) == 80
        srv = serve_probe(net, 1)
        rtts = measure_rtt_ms(net, 0, 1, count=10)
        assert 72 <= statistics.median(rtts) <= 88, rtts
        assert min(rtts) >= 79.9, rtts  # a frame never leaves a line before its delay
        # 256 KiB in flight at most: far below the 1 MB the link holds in 80 ms, so the stream
        # gets window / RTT (each window also waits for its last 16 KiB chunk to arrive)
        window = 256 * 1024
        got = windowed(net, 0, 1, seconds=4, window=window)["mbit"]
        predicted = window * 8 / (0.080 + probe.CHUNK * 8 / 100e6) / 1e6
        assert 0.8 * predicted <= got <= 1.1 * predicted, (got, predicted)
        srv.kill()
    assert not _ours(prefix)
    assert {c["name"] for c in net.line_counters} == {"peer0", "peer1"}
    for c in net.line_counters:
        assert c["cpu_s"] > 0
        for path in c["paths"]:
            assert path["frames_out"] > 0 and path["dropped_loss"] == path["dropped_limit"] == 0


def test_the_two_region_scenario_is_fast_inside_and_thin_between(prefix: str) -> None:
    spec = load_scenario(TWO_REGION).network
    with WanNetwork.from_spec(spec, prefix=prefix) as net:
        assert [line.cfg.name for line in net.lines] == ["sites"]  # only between the sites
        # without ping, round trips are TCP connects: every measured destination needs a server
        servers = [serve_probe(net, b) for b in (1, 2)]
        for a, b in ((0, 1), (3, 2)):
            assert statistics.median(measure_rtt_ms(net, a, b, count=5)) < 5
        for a, b in ((0, 2), (1, 2)):
            rtts = measure_rtt_ms(net, a, b, count=8)
            assert 72 <= statistics.median(rtts) <= 88, rtts
        # everything from eu to us shares one 50 Mbit/s class on eu's side of the link
        classes = run_cmd(["tc", "-n", net.bridge_netns, "class", "show", "dev", "s0"])
        assert re.search(r"rate 50Mbit ceil 50Mbit", classes), classes
        bulk = windowed(net, 0, 2, seconds=5, window=0)["mbit"]
        # at most the link's rate (plus what htb's 10 ms burst lets through in a 3 s window)
        assert 25 < bulk <= 52, bulk
        for srv in servers:
            srv.kill()
    assert not _ours(prefix)


@pytest.mark.skipif(shutil.which("ping") is None, reason="needs ping (apt install iputils-ping)")
def test_jitter_stays_within_its_bounds_and_loss_takes_its_share(prefix: str) -> None:
    imp = Impairment(rtt_ms=40, jitter_ms=20, loss=0.2)
    with WanNetwork(2, rates_mbit=100, impairments=imp, prefix=prefix, seed=3) as net:
        ip = net.peers[1].ip
        # first resolve the neighbours: echoes queued behind a lost ARP request would wait
        # for its retry, a delay that is ARP's and not the line's
        net.run(0, ["ping", "-n", "-c", "3", "-i", "0.2", "-w", "5", ip])
        out = net.run(0, ["ping", "-n", "-c", "200", "-i", "0.005", "-w", "6", ip])
    sent, received = map(
        int, re.search(r"(\d+) packets transmitted, (\d+) received", out.stdout).groups()
    )  # type: ignore[union-attr]
    times = [float(t) for t in re.findall(r"time=([0-9.]+) ms", out.stdout)]
    # each crossing adds +-5 ms, so the round trip is at least 40 - 20 ms: a frame never leaves
    # early. Its upper bound is the schedule's (tests/unit/test_scenario_network.py): a busy
    # machine sends frames late, so what a ping measures above it says nothing of the line
    assert min(times) >= 20, min(times)
    assert statistics.stdev(times) > 2
    # 20% one way, so 64% of echoes come back; 4 standard deviations either side
    share = received / sent
    sd = (0.64 * 0.36 / sent) ** 0.5
    assert abs(share - 0.64) < 4 * sd, (sent, received)
    lost = sum(p["dropped_loss"] for c in net.line_counters for p in c["paths"])
    assert lost > 0


_OWNER = textwrap.dedent(
    """
    import json, sys, time
    from isthmus.lab.netspec import Impairment
    from isthmus.lab.wan import WanNetwork
    net = WanNetwork(2, impairments=Impairment(rtt_ms=20), prefix=sys.argv[1])
    net.start()
    print(json.dumps({"lines": [line.pid for line in net.lines], "names": net.namespaces}))
    sys.stdout.flush()
    time.sleep(120)
    """
)


def test_an_owner_killed_takes_its_lines_along_and_cleanup_removes_the_rest(prefix: str) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
    finally:
        owner.kill()  # SIGKILL: no teardown runs in the owner
        _, err = owner.communicate(timeout=10)
    assert line, f"the owner failed: {err[-2000:]}"
    info = json.loads(line)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in info["lines"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in info["lines"]), "a line outlived its owner"
    # their TAP devices went with them; the namespaces stay until cleanup
    assert set(info["names"]) <= set(list_namespaces())
    out = run_cmd(["ip", "-n", info["names"][1], "link", "show"])
    assert "wan0" not in out, out
    assert sorted(cleanup_stale(prefix)) == sorted(info["names"])


def test_a_line_that_cannot_start_says_why_and_leaves_nothing(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from isthmus.lab import build

    real = build.access_line

    def broken(**kwargs: object) -> object:
        return real(**{**kwargs, "node_netns": "no-such-namespace"})  # type: ignore[arg-type]

    monkeypatch.setattr(build, "access_line", broken)
    net = WanNetwork(1, impairments=Impairment(rtt_ms=10), prefix=prefix)
    with pytest.raises(LabError, match=r"delay line peer0 could not start.*no-such-namespace"):
        net.start()
    assert not _ours(prefix)
    assert all(_gone(line.pid) for line in net.lines if line.pid is not None)


@pytest.mark.slow  # a whole lab run; the two-region links are measured by the test below
def test_the_two_region_lab_run_ends_in_parity(tmp_path: Path, prefix: str) -> None:
    s = run_lab(
        load_scenario(TWO_REGION),
        LabOptions(prefix=prefix, network="netns"),
        overrides={"run_dir": str(tmp_path), "steps": 20, "corpus_bytes": 200_000},
    )
    assert not _ours(prefix)
    # one outer round (H = 20) across the 80 ms link, then every peer bit-identical
    assert s.ok and s.parity_failures == 0 and s.parity_checks >= 1
    assert s.peers_final == 4 and s.rounds_committed >= 1
    assert s.lab is not None
    net = s.lab.network
    assert [x["name"] for x in net["sites"]["sites"]] == ["eu", "us"]
    (core,) = net["delay_lines"]
    assert core["name"] == "sites" and all(p["frames_out"] > 0 for p in core["paths"])
    assert "eu-us 50mbit, RTT 80 ms" in (tmp_path / "report.md").read_text()


def test_bench_allreduce_takes_a_round_trip(prefix: str) -> None:
    from isthmus.lab.bench import BenchConfig, format_bench, run_bench

    r = run_bench(
        BenchConfig(
            peers=2,
            rate_mbit=100,
            rtt_ms=40,
            sizes_mb=(0.5,),
            reps=1,
            warmup=0,
            network="netns",
            prefix=prefix,
        )
    )
    assert r["network"] == "netns" and r["rtt_ms"] == 40
    # a ring of two over a 40 ms round trip: no all-reduce is faster than one round trip
    assert r["gloo_time_s"] > 0.04 and r["isthmus_time_s"] > 0.04
    assert "RTT 40 ms" in format_bench(r)
    assert not _ours(prefix)
