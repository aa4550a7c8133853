"""The pure part of the link probe (comm/probe_math.py): the schedule, the ladder of transfers,
timings into rates, smoothing. No network, no clock."""

from __future__ import annotations

import itertools

import pytest

from isthmus.comm.probe_math import (
    FIRST_BYTES,
    GROWTH,
    RESOLUTION_S,
    Ladder,
    Link,
    LinkTable,
    rate_mbit,
    smooth,
    tournament,
)


@pytest.mark.parametrize("n", range(0, 12))
def test_the_tournament_pairs_everyone_once_in_rounds_of_disjoint_pairs(n):
    rounds = tournament(n)
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, itertools.combinations(range(n), 2)))
    for r in rounds:
        members = [m for p in r for m in p]
        assert len(members) == len(set(members))  # disjoint: they measure at once
        assert all(a != b and 0 <= a < n and 0 <= b < n for a, b in r)
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)
    assert tournament(n) == rounds  # every member computes the same schedule


def test_the_tournament_refuses_a_negative_size():
    with pytest.raises(ValueError, match="n >= 0"):
        tournament(-1)


def test_a_rate_takes_one_round_trip_off_the_time_and_never_divides_by_nothing():
    # 1 MB in 0.18 s on a link of 80 ms round trip: 100 ms of sending, 80 Mbit/s
    assert rate_mbit(1_000_000, 0.18, 0.08) == pytest.approx(80.0)
    assert rate_mbit(1_000_000, 0.1, 0.0) == pytest.approx(80.0)
    # a transfer no longer than the round trip: at least a tenth of its time counts
    assert rate_mbit(1_000_000, 0.1, 0.5) == pytest.approx(800.0)
    with pytest.raises(ValueError):
        rate_mbit(0, 1.0, 0.0)
    with pytest.raises(ValueError):
        rate_mbit(10, 0.0, 0.0)


def _run(ladder: Ladder, mbit: float, rtt_s: float) -> list[int]:
    """Drive a ladder over an ideal link: a transfer takes one round trip plus its bytes."""
    sizes = []
    while (size := ladder.next()) > 0:
        sizes.append(size)
        ladder.record(size, rtt_s + size * 8 / (mbit * 1e6))
    return sizes


def test_the_ladder_stops_early_on_a_thin_link_and_climbs_to_the_cap_on_a_fat_one():
    cap = 1 << 20
    thin = Ladder(cap=cap, rtt_s=0.001)
    sizes = _run(thin, 10.0, 0.001)
    # 16 KiB takes 13 ms at 10 Mbit/s, 64 KiB 52 ms (past the 50 ms target): 64 KiB again
    assert sizes == [FIRST_BYTES, FIRST_BYTES * GROWTH, FIRST_BYTES * GROWTH]
    assert thin.rate() == pytest.approx(10.0)
    # 80 ms away, it goes on until a transfer lasts two round trips more: 256 KiB (210 ms)
    far = Ladder(cap=cap, rtt_s=0.08)
    assert _run(far, 10.0, 0.08) == [16 << 10, 64 << 10, 256 << 10, 256 << 10]
    assert far.rate() == pytest.approx(10.0)
    fat = Ladder(cap=cap, rtt_s=0.0005)
    sizes = _run(fat, 1000.0, 0.0005)
    assert sizes == [16 << 10, 64 << 10, 256 << 10, 1 << 20, 1 << 20]
    assert fat.rate() == pytest.approx(1000.0)
    assert fat.sent() == sum(sizes)


def test_the_ladder_keeps_the_best_of_its_last_size_and_reports_a_ceiling_past_resolution():
    ladder = Ladder(cap=64 << 10, rtt_s=0.0, repeats=2)
    assert ladder.next() == 16 << 10
    ladder.record(16 << 10, 0.001)
    assert ladder.next() == 64 << 10
    ladder.record(64 << 10, 0.06)  # a busy moment
    assert ladder.next() == 64 << 10
    ladder.record(64 << 10, 0.03)
    assert ladder.next() == 64 << 10
    ladder.record(64 << 10, 0.05)
    assert ladder.next() == 0
    assert ladder.rate() == pytest.approx((64 << 10) * 8 / 0.03 / 1e6)
    # loopback: a transfer far faster than RESOLUTION_S reports the ceiling, not its noise
    fast = Ladder(cap=1 << 20, rtt_s=0.0)
    _run(fast, 50_000.0, 0.0)
    assert fast.rate() == pytest.approx((1 << 20) * 8 / RESOLUTION_S / 1e6)
    with pytest.raises(ValueError):
        Ladder(cap=0, rtt_s=0.0)
    with pytest.raises(ValueError, match="no transfer"):
        Ladder(cap=1, rtt_s=0.0).rate()


def test_a_small_cap_bounds_the_first_transfer():
    ladder = Ladder(cap=1000, rtt_s=0.0)
    assert ladder.next() == 1000


def test_smoothing_halves_a_probe_s_noise_and_the_table_keeps_current_members_only():
    assert smooth(None, Link(mbit=10, rtt_ms=4)) == Link(mbit=10, rtt_ms=4)
    assert smooth(Link(mbit=10, rtt_ms=4), Link(mbit=30, rtt_ms=8)) == Link(mbit=20, rtt_ms=6)
    table = LinkTable()
    table.update({1: Link(mbit=100, rtt_ms=2), 2: Link(mbit=50, rtt_ms=80)})
    table.update({2: Link(mbit=70, rtt_ms=60), 3: Link(mbit=900, rtt_ms=1)})
    assert table.probes == 2
    assert table.links == {2: Link(mbit=60, rtt_ms=70), 3: Link(mbit=900, rtt_ms=1)}
    assert table.report() == {
        "2": {"mbit": 60.0, "rtt_ms": 70.0},
        "3": {"mbit": 900.0, "rtt_ms": 1.0},
    }
