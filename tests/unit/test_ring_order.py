"""Ordering the ring by bandwidth (coordinator/ring.py): pure, no network."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from isthmus.coordinator.ring import (
    EXACT_MAX,
    crossings,
    materially_better,
    order_ring,
    ring_key,
    ring_members,
)


def _regions(sizes: list[int], inside: float, between: float):
    region, pid = {}, 0
    for r, n in enumerate(sizes):
        for _ in range(n):
            region[pid] = r
            pid += 1
    bw = {
        (a, b): inside if region[a] == region[b] else between
        for a in region
        for b in region
        if a != b
    }
    return region, bw


def test_two_regions_cross_exactly_twice():
    # the scenario's shape: 2 + 2 peers, 1 Gbit/s inside, 50 Mbit/s between; ids interleaved so
    # that name/id order would cross four times
    region = {0: "eu", 1: "us", 2: "eu", 3: "us"}
    bw = {(a, b): 1000.0 if region[a] == region[b] else 50.0 for a in region for b in region}
    assert crossings([0, 1, 2, 3], region) == 4
    order = order_ring([0, 1, 2, 3], bw)
    assert sorted(order) == [0, 1, 2, 3]
    assert crossings(order, region) == 2


@pytest.mark.parametrize("sizes", [[3, 3], [4, 4], [2, 3, 3], [5, 6], [6, 6, 4]])
def test_regions_are_contiguous_exact_and_heuristic(sizes):
    region, bw = _regions(sizes, 1000.0, 50.0)
    ids = list(region)
    random.Random(1).shuffle(ids)
    order = order_ring(ids, bw)
    assert sorted(order) == sorted(ids)
    assert crossings(order, region) == len(sizes)  # each region entered once


def test_exact_search_matches_brute_force_on_random_graphs():
    rng = random.Random(5)
    for n in range(4, EXACT_MAX + 1):
        ids = list(range(n))
        bw = {}
        for a, b in itertools.combinations(ids, 2):
            bw[(a, b)] = float(rng.choice([10, 50, 100, 400, 1000]))
        best = max(ring_key([0, *p], bw) for p in itertools.permutations(ids[1:]))
        assert ring_key(order_ring(ids, bw), bw) == best


def test_heuristic_finds_the_one_fast_ring_hidden_in_slow_links():
    # 14 peers (beyond the exact search): a fast ring in a random order, every other link slow
    rng = random.Random(3)
    ids = list(range(14))
    hidden = ids[:]
    rng.shuffle(hidden)
    bw = {(a, b): 10.0 for a in ids for b in ids if a != b}
    for i in range(14):
        a, b = hidden[i], hidden[(i + 1) % 14]
        bw[(a, b)] = bw[(b, a)] = 1000.0
    assert min(ring_key(order_ring(ids, bw), bw)) == 1000.0


def test_asymmetric_links_count_their_slower_direction_and_missing_pairs_fail():
    bw = {(a, b): 100.0 for a in range(4) for b in range(4) if a != b}
    bw[(0, 1)] = 5.0
    assert ring_key([0, 1, 2, 3], bw)[0] == 5.0
    assert 1 not in (order_ring(range(4), bw)[1], order_ring(range(4), bw)[-1])
    del bw[(2, 3)], bw[(3, 2)]
    with pytest.raises(KeyError, match=r"between (2 and 3|3 and 2)"):
        order_ring(range(4), bw)
    with pytest.raises(ValueError, match="repeat"):
        order_ring([1, 1, 2, 3], bw)


def _peers(names: dict[int, str], links: dict[int, dict[str, float]] | None):
    return {
        p: SimpleNamespace(name=n, info={"links": links[p]} if links else {})
        for p, n in names.items()
    }


def test_coordinator_hook_orders_by_reports_and_falls_back_to_names():
    names = {10: "a-eu", 11: "b-us", 12: "c-eu", 13: "d-us"}
    region = {p: n[2:] for p, n in names.items()}
    links = {
        p: {names[q]: (1000.0 if region[p] == region[q] else 50.0) for q in names if q != p}
        for p in names
    }
    members = ring_members([13, 12, 11, 10], _peers(names, links))
    assert members[0] == 10  # the first by name keeps rank 0
    assert crossings(members, region) == 2
    # a peer reports its own links and the others' reports name it: either end is enough
    silent = {**links, 11: {}}
    assert crossings(ring_members([13, 12, 11, 10], _peers(names, silent)), region) == 2
    # a pair nobody reported (or a malformed report): name order, as before
    unknown = {**silent, 13: {k: v for k, v in links[13].items() if k != "b-us"}}
    assert ring_members([13, 12, 11, 10], _peers(names, unknown)) == (10, 11, 12, 13)
    garbage = _peers(names, unknown)
    garbage[11].info = {"links": "garbage"}
    assert ring_members([13, 12, 11, 10], garbage) == (10, 11, 12, 13)
    assert ring_members([12, 10, 11], _peers({10: "a", 11: "b", 12: "c"}, None)) == (10, 11, 12)


def test_the_two_region_scenarios_links_give_a_ring_crossing_twice_by_address():
    # what the lab hands each peer (ISTHMUS_LINKS, by address) from scenarios/two_region.toml
    from pathlib import Path

    from isthmus.lab.netspec import path_rate_mbit
    from isthmus.lab.scenario import load_scenario

    net = load_scenario(Path(__file__).parents[2] / "scenarios" / "two_region.toml").network
    assert net.sites is not None
    rate = {
        (a, b): path_rate_mbit([net.rates_bps[a], net.rates_bps[b]], net.sites, a, b)
        for a in range(4)
        for b in range(4)
        if a != b
    }
    assert rate[(0, 1)] == 1000.0 and rate[(0, 2)] == 50.0 and rate[(3, 1)] == 50.0
    region = {p: net.sites.site_of(p) for p in range(4)}
    # names interleave the regions (eu, us, eu, us), so name order would cross four times
    names = {10: "a", 11: "c", 12: "b", 13: "d"}
    slot = {10: 0, 11: 1, 12: 2, 13: 3}
    addr = {p: f"10.77.0.{slot[p] + 2}" for p in names}
    peers = {
        p: SimpleNamespace(
            name=names[p],
            info={
                "addr": addr[p],
                "links": {addr[q]: rate[(slot[p], slot[q])] for q in names if q != p},
            },
        )
        for p in names
    }
    members = ring_members(list(names), peers)
    assert crossings([slot[p] for p in members], region) == 2
    assert crossings([slot[p] for p in (10, 12, 11, 13)], region) == 4  # name order


def _probed_peers(names: dict[int, str], rate: dict[tuple[int, int], float]):
    """Peers whose probes (comm/probe.py) reported ``rate[(q, p)]``, the rate at which ``p``
    receives from ``q``, by peer id."""
    return {
        p: SimpleNamespace(
            name=n,
            info={
                "probed": {str(q): {"mbit": rate[(q, p)], "rtt_ms": 1.0} for q in names if q != p}
            },
        )
        for p, n in names.items()
    }


def _two_regions_probed():
    """Four peers in two regions that name order interleaves (it crosses four times), and the
    rates their probes would report: 940 Mbit/s inside a region, 21 between."""
    names = {10: "a", 11: "b", 12: "c", 13: "d"}
    region = {10: "eu", 11: "us", 12: "eu", 13: "us"}
    probed = {
        (p, q): (940.0 if region[p] == region[q] else 21.0) for p in names for q in names if p != q
    }
    return names, region, probed


def test_probed_rates_order_the_ring_and_handed_in_links_win_over_them():
    names, region, probed = _two_regions_probed()
    peers = _probed_peers(names, probed)
    assert crossings(ring_members(list(names), peers), region) == 2
    # a table handed in for every pair (the lab's, by name) says the regions are the other way
    # round: it wins, pair by pair, over what the probes measured
    other = {10: "eu", 11: "eu", 12: "us", 13: "us"}
    for p in names:
        peers[p].info["links"] = {
            names[q]: (1000.0 if other[p] == other[q] else 50.0) for q in names if q != p
        }
    assert ring_members(list(names), peers) == (10, 11, 12, 13)  # name order is that ring
    # each end reports the way in: one slow way of one pair is enough to avoid that edge
    fast = dict.fromkeys(probed, 1700.0)
    fast[(11, 12)] = 140.0  # what 12 receives from 11
    ring = ring_members(list(names), _probed_peers(names, fast))
    assert {ring[1], ring[2]} != {11, 12} and {ring[0], ring[3]} != {11, 12}
    alike = _probed_peers(names, dict.fromkeys(probed, 1700.0))
    assert ring_members(list(names), alike) == (10, 11, 12, 13)
    # malformed probes are ignored like malformed links: the other ends' reports suffice
    bad = _probed_peers(names, probed)
    bad[11].info["probed"] = {"10": {"mbit": "fast"}, "12": "x", "13": -1, "99": 5.0}
    assert crossings(ring_members(list(names), bad), region) == 2
    bad[13].info["probed"] = "garbage"  # now the pair 11-13 is unknown: name order
    assert ring_members(list(names), bad) == (10, 11, 12, 13)


def test_links_alike_keep_name_order_whatever_the_noise():
    names = {10: "a", 11: "b", 12: "c", 13: "d", 14: "e"}
    rng = random.Random(7)
    for _ in range(20):
        # one machine or one LAN: every pair within a factor of 1.9 of every other
        noisy = {(p, q): 1000.0 * rng.uniform(0.55, 1.0) for p in names for q in names if p != q}
        assert ring_members(list(names), _probed_peers(names, noisy)) == tuple(names)
    assert materially_better([50.0, 1000.0], [50.0, 400.0])
    assert not materially_better([50.0, 1000.0], [50.0, 600.0])
    assert not materially_better([50.0, 1000.0], [101.0, 120.0])  # the slowest edge decides first


def test_probes_count_only_once_every_member_has_reported_every_other():
    names, region, probed = _two_regions_probed()
    peers = _probed_peers(names, probed)
    report_13 = peers[13].info.pop("probed")
    # three reports already name every pair from one end, but the fourth is still on its way
    assert ring_members(list(names), peers) == (10, 11, 12, 13)
    # a table from an earlier member set (without 11) does not complete it either
    peers[13].info["probed"] = {k: v for k, v in report_13.items() if k != "11"}
    assert ring_members(list(names), peers) == (10, 11, 12, 13)
    peers[13].info["probed"] = report_13
    assert crossings(ring_members(list(names), peers), region) == 2
