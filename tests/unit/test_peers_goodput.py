"""benchmarks/peers_goodput.py: the failure schedule and the goodput figures."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers_goodput.py"
_spec = importlib.util.spec_from_file_location("peers_goodput", _PATH)
assert _spec is not None and _spec.loader is not None
pg = importlib.util.module_from_spec(_spec)
sys.modules["peers_goodput"] = pg
_spec.loader.exec_module(pg)


def test_fixed_interval_schedule_spares_peer_zero_and_is_reproducible() -> None:
    kw = {"every_s": 6.0, "restart_after_s": 2.0, "until_s": 60.0, "peers": 4, "seed": 3}
    plan = pg.failure_schedule(**kw)
    assert [f.at_s for f in plan] == [6.0 * k for k in range(1, 10)]
    assert all(f.peer in (1, 2, 3) for f in plan)
    assert all(f.back_s == f.at_s + 2.0 for f in plan)
    assert plan == pg.failure_schedule(**kw)
    assert plan != pg.failure_schedule(**{**kw, "seed": 4})


def test_a_peer_still_down_is_not_killed_again() -> None:
    # restarts take 25 s, kills come every 10 s: with two candidates the third kill finds
    # both down and is skipped
    plan = pg.failure_schedule(every_s=10.0, restart_after_s=25.0, until_s=50.0, peers=3, seed=0)
    for a in plan:
        for b in plan:
            if a is not b and a.peer == b.peer:
                assert not a.at_s < b.at_s < a.back_s
    assert [f.at_s for f in plan] == [10.0, 20.0, 40.0]


def test_poisson_gaps_have_the_mean_interval() -> None:
    plan = pg.failure_schedule(
        every_s=5.0, restart_after_s=0.1, until_s=50_000.0, peers=8, seed=1, poisson=True
    )
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(plan)]
    assert 4.8 < sum(gaps) / len(gaps) < 5.2
    assert len(set(gaps)) > 100  # not a fixed interval


def test_schedule_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="every_s"):
        pg.failure_schedule(every_s=0, restart_after_s=1, until_s=9, peers=4, seed=0)
    with pytest.raises(ValueError, match="restart_after_s"):
        pg.failure_schedule(every_s=1, restart_after_s=0, until_s=9, peers=4, seed=0)
    with pytest.raises(ValueError, match="no peer may fail"):
        pg.failure_schedule(every_s=1, restart_after_s=1, until_s=9, peers=1, seed=0)


def test_fractions() -> None:
    # torchft's public run: one failure per 6 step times, one step lost each -> 5/6
    assert pg.nominal_fraction(11.0, 66.0) == pytest.approx(5 / 6)
    assert pg.nominal_fraction(2.0, 1.0) == 0.0
    assert pg.theoretical_fraction(60, 10) == pytest.approx(5 / 6)
    assert pg.theoretical_fraction(0, 3) is None
    assert pg.theoretical_fraction(2, 5) == 0.0
    assert pg.committed_fraction(49, 60) == pytest.approx(49 / 60)
    assert pg.committed_fraction(0, 0) is None
    with pytest.raises(ValueError, match="impossible"):
        pg.committed_fraction(3, 2)
    with pytest.raises(ValueError):
        pg.nominal_fraction(0.0, 1.0)
    assert pg.step_time(30.0, 60) == 0.5
    assert pg.step_time(30.0, 0) is None


def test_attempts_of_each_system() -> None:
    events = [
        {"kind": "epoch"},
        {"kind": "commit"},
        {"kind": "abort"},
        {"kind": "commit"},
        {"kind": "register"},
        {"kind": "commit"},
    ]
    assert pg.isthmus_attempts(events) == (3, 4)
    records = [
        {"kind": "step", "ok": True},
        {"kind": "commit", "ok": True},
        {"kind": "commit", "ok": False},
        {"kind": "commit", "ok": True},
    ]
    assert pg.torchft_attempts(records) == (2, 3)
    assert pg.torchft_attempts([]) == (0, 0)


def test_time_fraction() -> None:
    assert pg.time_fraction(30.0, 60.0) == 0.5
    assert pg.time_fraction(None, 60.0) is None
    assert pg.time_fraction(30.0, 0.0) is None


def test_restarted_processes_are_left_out_of_the_curve() -> None:
    recs = {"peer0": [1], "peer2": [2], "peer2.1": [3], "peer2.r4": [4]}
    assert pg.starters(recs) == {"peer0": [1], "peer2": [2]}
