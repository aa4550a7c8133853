"""Scenario files' round trips, jitter, loss and sites: parsed, checked with errors that name the
key, turned into delay-line settings; the delay line's forwarding loop on plain sockets (no root:
the lab's namespace tests are in tests/integration/test_wan_latency.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from isthmus.lab.delayline import VNET_HDR_LEN, Forwarder, LineConfig, PathConfig, PortConfig
from isthmus.lab.lines import access_crossing, access_line, path_limit, site_core, site_crossing
from isthmus.lab.netspec import Impairment
from isthmus.lab.scenario import load_scenario, parse_scenario
from isthmus.spec import SpecError

ROOT = Path(__file__).resolve().parents[2]

BASE = """
[run]
name = "t"
steps = 10
[strategy]
name = "diloco"
[network]
peers = 4
rate = "100mbit"
"""

SITES = """
[[network.sites]]
name = "eu"
peers = [0, 1]
[[network.sites]]
name = "us"
peers = [2, 3]
[[network.site_links]]
sites = ["eu", "us"]
rate = "50mbit"
rtt_ms = 80
"""


def _net(extra: str, sites: str = "") -> str:
    return BASE + extra + "\n" + sites


def _err(text: str) -> str:
    with pytest.raises(SpecError) as info:
        parse_scenario(text, source="case.toml")
    return str(info.value)


# ---------------------------------------------------------------- parsing


def test_one_round_trip_for_all_peers_and_one_per_peer() -> None:
    s = parse_scenario(_net("rtt_ms = 80\njitter_ms = 4\nloss = 0.001"))
    assert s.network.impairments == (Impairment(rtt_ms=80, jitter_ms=4, loss=0.001),) * 4
    assert s.network.rtt_ms(0, 3) == 80
    s = parse_scenario(_net("rtt_ms = [20, 20, 100, 100]"))
    assert [x.rtt_ms for x in s.network.impairments] == [20, 20, 100, 100]
    assert s.network.rtt_ms(0, 2) == 60  # the mean of the two links' settings
    assert s.network.rtt_ms(2, 3) == 100
    assert not parse_scenario(BASE).network.impairments[0].active


def test_the_shipped_two_region_scenario() -> None:
    s = load_scenario(ROOT / "scenarios" / "two_region.toml")
    net = s.network
    assert net.peers == 4 and set(net.rates_bps) == {1e9}
    assert net.sites is not None
    assert [x.name for x in net.sites.sites] == ["eu", "us"]
    link = net.sites.link(0, 1)
    assert link.rate_bps == 50e6 and link.impairment.rtt_ms == 80
    assert [[net.rtt_ms(a, b) for b in range(4)] for a in range(4)] == [
        [0, 0, 80, 80],
        [0, 0, 80, 80],
        [80, 80, 0, 0],
        [80, 80, 0, 0],
    ]
    assert net.sites.coordinator_index == 0


def test_site_round_trips_add_to_the_peers_own() -> None:
    s = parse_scenario(_net("rtt_ms = [10, 10, 30, 30]", SITES))
    assert s.network.rtt_ms(0, 1) == 10 and s.network.rtt_ms(1, 2) == 20 + 80
    # a key written after [[network.site_links]] would belong to that entry: put it in [network]
    s = parse_scenario(BASE.replace("[network]\n", '[network]\ncoordinator_site = "us"\n') + SITES)
    assert s.network.sites is not None and s.network.sites.coordinator_index == 1


@pytest.mark.parametrize(
    ("extra", "sites", "expected"),
    [
        ("rtt_ms = -5", "", "network.rtt_ms: must be at least 0.0"),
        ("rtt_ms = 'slow'", "", "network.rtt_ms: must be a number"),
        ("rtt_ms = 9000", "", "network.rtt_ms: 9000 ms is longer than any real round trip"),
        ("rtt_ms = [10, 20]", "", "network.rtt_ms: 2 values for 4 peers"),
        ("rtt_ms = [10, 10, -1, 10]", "", "network.rtt_ms[2]: must be at least"),
        ("rtt_ms = 10\njitter_ms = 20", "", "network.jitter_ms: jitter 20 ms is more than"),
        ("loss = 1.0", "", "network.loss: must be a probability below 1"),
        ("loss = [0, 0, 0, 2]", "", "network.loss[3]: must be a probability below 1"),
        ("latency = 50", "", "network.latency: unknown key (write the round trip as rtt_ms"),
        ("jitter = 5", "", "network.jitter: unknown key (did you mean 'jitter_ms'?)"),
        ('coordinator_site = "eu"', "", "network.coordinator_site: coordinator_site needs"),
    ],
)
def test_bad_network_values_name_the_key(extra: str, sites: str, expected: str) -> None:
    assert expected in _err(_net(extra, sites))


@pytest.mark.parametrize(
    ("sites", "expected"),
    [
        (
            SITES.replace("peers = [2, 3]", "peers = [1, 2, 3]"),
            "network.sites[1].peers: peer 1 is already in site 'eu'",
        ),
        (SITES.replace("peers = [2, 3]", "peers = [2]"), "network.sites: peers [3] are in no site"),
        (
            SITES.replace("peers = [2, 3]", "peers = [2, 3, 7]"),
            "network.sites[1].peers: peer 7 does not exist",
        ),
        (
            SITES.replace("peers = [2, 3]", "peers = [2, 2, 3]"),
            "network.sites[1].peers: lists a peer twice",
        ),
        (
            SITES.replace('name = "us"', 'name = "eu"'),
            "network.sites[1].name: site 'eu' is defined twice",
        ),
        (SITES.replace('name = "us"', 'name = "u s"'), "network.sites[1].name: site names are"),
        (
            SITES.replace('["eu", "us"]', '["eu", "asia"]'),
            "network.site_links[0].sites: no site 'asia'",
        ),
        (
            SITES.replace('["eu", "us"]', '["eu", "eu"]'),
            "network.site_links[0].sites: joins site 'eu' to itself",
        ),
        (
            SITES.split("[[network.site_links]]")[0],
            "network.site_links: no link between sites eu-us",
        ),
        (
            SITES + '[[network.site_links]]\nsites = ["us", "eu"]\nrate = "1gbit"\n',
            "network.site_links[1].sites: sites 'us' and 'eu' are already joined",
        ),
        (
            SITES.replace('rate = "50mbit"', 'rate = "50mbps"'),
            "network.site_links[0].rate: '50mbps': unit",
        ),
        (
            SITES.replace("rtt_ms = 80", "rtt_ms = 80\njitter_ms = 90"),
            "network.site_links[0].jitter_ms: jitter 90 ms",
        ),
        (
            SITES.replace("rtt_ms = 80", "rtt = 80"),
            "network.site_links[0].rtt: unknown key (did you mean 'rtt_ms'?)",
        ),
        (
            SITES.replace('rate = "50mbit"\n', ""),
            "network.site_links[0].rate: missing required key",
        ),
    ],
)
def test_bad_sites_name_the_key(sites: str, expected: str) -> None:
    assert expected in _err(_net("", sites))


# ---------------------------------------------------------------- settings of the lines


def test_a_round_trip_is_spread_over_the_crossings() -> None:
    # a round trip between two peers crosses each peer's link twice: a quarter per crossing
    delay, jitter, loss = access_crossing(Impairment(rtt_ms=80, jitter_ms=8, loss=0.19))
    assert delay == pytest.approx(0.020) and jitter == pytest.approx(0.002)
    assert 1 - (1 - loss) ** 2 == pytest.approx(0.19)  # two crossings one way lose 19%
    delay, jitter, loss = site_crossing(Impairment(rtt_ms=80, jitter_ms=8, loss=0.01))
    assert (delay, jitter, loss) == (pytest.approx(0.040), pytest.approx(0.004), 0.01)
    assert path_limit(None, 0.1) == 64 << 20
    assert path_limit(1e6, 0.01) == 1 << 20  # the floor
    assert path_limit(1e9, 0.04) == int(2 * 1e9 / 8 * 0.05)


def test_lossy_links_take_single_frames_and_cores_have_a_path_per_pair() -> None:
    line = access_line(
        name="peer0",
        node_netns="a",
        node_ifname="wan0",
        bridge_netns="br",
        bridge_port="p0",
        impairment=Impairment(rtt_ms=40, loss=0.01),
        rate_bps=1e8,
        seed=1,
    )
    assert [p.tso for p in line.cfg.ports] == [False, False]
    assert [(p.src, p.dst, p.delay_s) for p in line.cfg.paths] == [(0, 1, 0.01), (1, 0, 0.01)]
    s = parse_scenario(_net("", SITES))
    assert s.network.sites is not None
    core = site_core(
        name="sites", bridge_netns="br", ports=["s0", "s1"], sites=s.network.sites, seed=0
    )
    assert {(p.src, p.dst, p.delay_s) for p in core.cfg.paths} == {(0, 1, 0.04), (1, 0, 0.04)}
    assert all(p.tso for p in core.cfg.ports)
    with pytest.raises(ValueError, match="at least two ports"):
        LineConfig(name="x", ports=(PortConfig(netns="a", ifname="t"),), paths=(), home="a")
    with pytest.raises(ValueError, match="bad path"):
        LineConfig(
            name="x",
            ports=(PortConfig(netns="a", ifname="t"), PortConfig(netns="b", ifname="t")),
            paths=(PathConfig(src=0, dst=0),),
            home="a",
        )
    cfg = line.cfg
    assert LineConfig.from_json(cfg.to_json()) == cfg


# ---------------------------------------------------------------- the forwarding loop


class _Ports:
    """A forwarder on datagram socket pairs (a TAP hands over one frame per read, so does this),
    run on a thread until the lifeline closes."""

    def __init__(self, n: int, paths: list[PathConfig], seed: int = 0) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(n)]
        self.outer = [a for a, _ in pairs]
        self.inner = [b for _, b in pairs]
        for s in self.inner:
            s.setblocking(False)
        for s in self.outer:
            s.settimeout(5)
        ports = tuple(PortConfig(netns="x", ifname=f"t{i}") for i in range(n))
        cfg = LineConfig(name="t", ports=ports, paths=tuple(paths), home="x", seed=seed)
        self.forwarder = Forwarder(cfg, [s.fileno() for s in self.inner])
        r, self.lifeline = os.pipe()
        self.thread = threading.Thread(target=self.forwarder.run, args=(r,), daemon=True)
        self._r = r
        self.thread.start()

    def close(self) -> None:
        os.close(self.lifeline)
        self.thread.join(5)
        os.close(self._r)
        for s in self.outer + self.inner:
            s.close()


def _frame(dst: bytes, src: bytes, body: bytes) -> bytes:
    return b"\0" * VNET_HDR_LEN + dst + src + body


def test_frames_wait_their_delay_keep_their_order_and_are_lost_as_configured() -> None:
    ports = _Ports(
        2,
        [
            PathConfig(src=0, dst=1, delay_s=0.05, jitter_s=0.02),
            PathConfig(src=1, dst=0, loss=0.5),
        ],
        seed=7,
    )
    try:
        t = time.monotonic()
        for i in range(20):
            ports.outer[0].send(_frame(b"\xff" * 6, b"\x02" * 6, bytes([i])))
        got = [ports.outer[1].recv(2048) for _ in range(20)]
        # no frame before the delay minus the jitter, and in the order they were sent
        assert time.monotonic() - t >= 0.03
        assert [f[-1] for f in got] == list(range(20))
        for i in range(400):
            ports.outer[1].send(_frame(b"\xff" * 6, b"\x03" * 6, bytes([i % 256])))
        received = 0
        ports.outer[0].settimeout(0.5)
        with pytest.raises(TimeoutError):
            while True:
                ports.outer[0].recv(2048)
                received += 1
    finally:
        ports.close()
    back = next(p for p in ports.forwarder.counters()["paths"] if p["src"] == 1)
    assert back["dropped_loss"] + back["frames_out"] == 400
    assert 140 < back["dropped_loss"] < 260 and received == back["frames_out"]


def test_each_frame_is_scheduled_within_its_delay_and_jitter_and_in_order() -> None:
    # the schedule alone (no forwarding thread, no clock): what a ping through the line shows
    # only as far as a loaded machine sends each frame on time
    ports = tuple(PortConfig(netns="x", ifname=f"t{i}") for i in range(2))
    path = PathConfig(src=0, dst=1, delay_s=0.02, jitter_s=0.01)
    cfg = LineConfig(name="t", ports=ports, paths=(path,), home="x", seed=3)
    fw = Forwarder(cfg, [-1, -1])  # _take never writes
    arrivals = [0.001 * i for i in range(2000)]
    for i, now in enumerate(arrivals):
        fw._take(0, _frame(b"\x02" * 6, b"\x03" * 6, i.to_bytes(2, "big")), now)
    queue = list(fw.paths[(0, 1)].queue)
    assert [int.from_bytes(f[-2:], "big") for _, f in queue] == list(range(2000))
    waits = [due - now for (due, _), now in zip(queue, arrivals, strict=True)]
    assert min(waits) >= 0.01 - 1e-9 and max(waits) <= 0.03 + 1e-9
    dues = [due for due, _ in queue]
    assert dues == sorted(dues)  # a frame never overtakes the one ahead of it
    assert max(waits) - min(waits) > 0.015  # and the jitter is drawn, not a constant


def test_a_core_learns_where_each_address_lives_and_bounds_its_queues() -> None:
    ports = _Ports(
        3,
        [
            PathConfig(src=a, dst=b, delay_s=0.01, limit_bytes=10_000)
            for a in range(3)
            for b in range(3)
            if a != b
        ],
    )
    a, b, c = (bytes([2, 0, 0, 0, 0, k]) for k in (1, 2, 3))
    try:
        ports.outer[1].send(_frame(b"\xff" * 6, b, b"hello"))  # a broadcast from b reaches all
        assert ports.outer[0].recv(2048).endswith(b"hello")
        assert ports.outer[2].recv(2048).endswith(b"hello")
        ports.outer[0].send(_frame(b, a, b"to b"))  # b was learned: only port 1 gets it
        assert ports.outer[1].recv(2048).endswith(b"to b")
        ports.outer[2].settimeout(0.2)
        with pytest.raises(TimeoutError):
            ports.outer[2].recv(2048)
        for _ in range(10):  # 10 x 2 KB into a 10 KB queue at once: some are dropped
            ports.outer[2].send(_frame(b, c, b"x" * 2000))
        time.sleep(0.1)
    finally:
        ports.close()
    to_b = next(p for p in ports.forwarder.counters()["paths"] if (p["src"], p["dst"]) == (2, 1))
    assert to_b["dropped_limit"] > 0 and to_b["frames_out"] + to_b["dropped_limit"] == 10
