"""The simulator against cases worked out by hand (the arithmetic is in each comment)."""

from __future__ import annotations

import itertools
import math

import pytest

from isthmus.lab.sim import (
    COLUMNS,
    FailureModel,
    NetworkModel,
    Simulator,
    StrategyProfile,
    collective_bytes,
    collective_time,
    format_table,
    rows,
    strategy_profile,
    validate,
)

GBIT = 1e9
MB100 = 1e8  # 100 MB


def net(**kw: object) -> NetworkModel:
    kw.setdefault("bandwidth_bps", GBIT)
    kw.setdefault("efficiency", 1.0)
    return NetworkModel(**kw)  # type: ignore[arg-type]


def test_ring_all_reduce_time_and_bytes() -> None:
    # n=4, 100 MB, 1 Gbit/s, 10 ms: 2*3*0.01 + (6/4) * 8e8 / 1e9 = 0.06 + 1.2
    assert collective_time(MB100, 4, net(latency_s=0.01)) == pytest.approx(1.26)
    assert collective_bytes(MB100, 4, net()) == pytest.approx(1.5e8)
    # efficiency scales the usable rate: 1.2 / 0.8 = 1.5
    assert collective_time(MB100, 4, net(efficiency=0.8)) == pytest.approx(1.5)
    assert collective_time(MB100, 1, net(latency_s=1.0)) == 0.0
    assert collective_bytes(MB100, 1, net()) == 0.0


def test_slowest_link_paces_the_ring() -> None:
    hetero = net(bandwidth_bps=(GBIT, GBIT, 1e8, 1e7))
    # 1.5 * 8e8 / 1e7 = 120 s
    assert collective_time(MB100, 4, hetero) == pytest.approx(120.0)
    with pytest.raises(ValueError, match="4 per-peer rates for 5 peers"):
        collective_time(MB100, 5, hetero)


def test_tree_hierarchical_and_gossip() -> None:
    # tree, n=8: 3 levels, 2 * 3 * (0.01 + 0.8) = 4.86
    assert collective_time(MB100, 8, net(algorithm="tree", latency_s=0.01)) == pytest.approx(4.86)
    # n=5 rounds up to 3 levels as well
    assert collective_time(MB100, 5, net(algorithm="tree")) == pytest.approx(6 * 0.8)
    # hierarchical, n=16 in 4 groups of 4, intra 10 Gbit/s 1 ms, inter 1 Gbit/s 50 ms:
    # inside 2*3*0.001 + 1.5*8e8/1e10 = 0.006 + 0.12; across 2*3*0.05 + 1.5*2e8/1e9 = 0.3 + 0.3
    h = net(
        algorithm="hierarchical", latency_s=0.05, intra_bandwidth_bps=1e10, intra_latency_s=0.001
    )
    assert collective_time(MB100, 16, h) == pytest.approx(0.726)
    # bytes: 1.5 * 1e8 inside + 1.5 * 2.5e7 across
    assert collective_bytes(MB100, 16, h) == pytest.approx(1.875e8)
    # default group size is round(sqrt(n)); one group of n is a plain ring at the intra rate
    assert collective_time(
        MB100, 16, net(algorithm="hierarchical", group_size=16)
    ) == pytest.approx(collective_time(MB100, 16, net()))
    assert collective_time(MB100, 16, net(algorithm="hierarchical", group_size=1)) == pytest.approx(
        collective_time(MB100, 16, net())
    )
    # gossip, 3 neighbours: 0.02 + 3 * 0.8
    g = net(algorithm="gossip", gossip_degree=3, latency_s=0.02)
    assert collective_time(MB100, 100, g) == pytest.approx(2.42)
    assert collective_bytes(MB100, 100, g) == pytest.approx(3e8)
    assert collective_bytes(MB100, 2, g) == pytest.approx(1e8)  # only one neighbour exists


def test_profiles() -> None:
    ddp = strategy_profile("ddp", model_bytes=4e8, compression_ratio=0.25)
    assert (ddp.bytes_per_round, ddp.steps_per_round, ddp.overlap) == (1e8, 1.0, 0.0)
    dl = strategy_profile("diloco", model_bytes=1e8, sync_every=50)
    assert (dl.bytes_per_round, dl.steps_per_round, dl.overlap) == (1e8, 50.0, 0.0)
    st = strategy_profile(
        "streaming", model_bytes=1e8, sync_every=100, fragments=4, overlap_steps=5
    )
    assert (st.bytes_per_round, st.steps_per_round, st.overlap) == (2.5e7, 25.0, 0.2)
    assert strategy_profile("co2", model_bytes=1e8, sync_every=20).overlap == 1.0
    with pytest.raises(ValueError, match="below H/P"):
        strategy_profile(
            "streaming", model_bytes=1e8, sync_every=100, fragments=4, overlap_steps=25
        )
    with pytest.raises(ValueError, match="multiple of fragments"):
        strategy_profile("streaming", model_bytes=1e8, sync_every=10, fragments=4)
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy_profile("fedavg", model_bytes=1e8)


def test_ddp_and_diloco_steps() -> None:
    network = net(latency_s=0.01)
    ddp = Simulator(
        compute_s_per_step=0.5, strategy=strategy_profile("ddp", model_bytes=MB100), network=network
    ).predict(4, steps=1000)
    # 0.5 compute + 1.26 communication, nothing hidden
    assert ddp.step_s == pytest.approx(1.76)
    assert ddp.utilization == pytest.approx(0.5 / 1.76)
    assert ddp.total_s == pytest.approx(1760.0)
    assert ddp.bytes_per_peer_per_step == pytest.approx(1.5e8)
    dl = Simulator(
        compute_s_per_step=0.5,
        strategy=strategy_profile("diloco", model_bytes=MB100, sync_every=50),
        network=network,
    ).predict(4)
    # 1.26 s every 50 steps: 0.5 + 0.0252
    assert dl.step_s == pytest.approx(0.5252)
    assert dl.comm_s_per_step == pytest.approx(0.0252)
    assert dl.bytes_per_peer_per_step == pytest.approx(3e6)


def test_overlap_hides_what_compute_can_cover() -> None:
    st = strategy_profile(
        "streaming", model_bytes=MB100, sync_every=100, fragments=4, overlap_steps=5
    )
    network = net(latency_s=0.01)
    # fragment 25 MB: 0.06 + 1.5 * 2e8 / 1e9 = 0.36 s every 25 steps; window 0.2 * 25 * 0.5 = 2.5 s
    slow = Simulator(compute_s_per_step=0.5, strategy=st, network=network).predict(4)
    assert slow.round_comm_s == pytest.approx(0.36)
    assert slow.exposed_comm_s_per_step == 0.0 and slow.step_s == pytest.approx(0.5)
    assert slow.hidden_comm_s_per_step == pytest.approx(0.36 / 25)
    # compute 0.05: window 0.25 s, 0.11 s exposed per round: 0.05 + 0.11 / 25
    fast = Simulator(compute_s_per_step=0.05, strategy=st, network=network).predict(4)
    assert fast.step_s == pytest.approx(0.0544)
    # DDP overlapping 2/3 of a 0.9 s step: window 0.6 s of a 1.26 s all-reduce
    ddp = Simulator(
        compute_s_per_step=0.9,
        strategy=strategy_profile("ddp", model_bytes=MB100, ddp_overlap=2 / 3),
        network=network,
    ).predict(4)
    assert ddp.step_s == pytest.approx(0.9 + 0.66)


def test_failures() -> None:
    sim = Simulator(
        compute_s_per_step=0.5,
        strategy=strategy_profile("diloco", model_bytes=MB100, sync_every=50),
        network=net(latency_s=0.01),
        failures=FailureModel(failures_per_peer_per_hour=0.25, recovery_s=58.74),
    )
    r = sim.predict(4)
    # one failure per hour, each costing 58.74 + 1.26 = 60 s: phi = 1/60
    assert r.failures_per_hour == pytest.approx(1.0)
    assert r.failure_overhead == pytest.approx(1 / 60)
    assert r.step_s == pytest.approx(0.5252 / (1 - 1 / 60))
    assert r.step_s_no_failures == pytest.approx(0.5252)
    # 240 failures/hour at 15 s each: phi = 1, the run never finishes
    doomed = Simulator(
        compute_s_per_step=0.5,
        strategy=StrategyProfile(name="x", bytes_per_round=0.0),
        network=net(),
        failures=FailureModel(failures_per_peer_per_hour=60.0, recovery_s=15.0),
    ).predict(4)
    assert doomed.failure_overhead == pytest.approx(1.0)
    assert math.isinf(doomed.step_s) and doomed.utilization == 0.0
    assert rows([doomed])[0]["total"] == "never"


def test_sweep_to_ten_thousand_peers() -> None:
    sim = Simulator(
        compute_s_per_step=0.5,
        strategy=strategy_profile("diloco", model_bytes=MB100, sync_every=500),
        network=net(latency_s=0.05),
    )
    ring = sim.sweep()
    assert next(r.peers for r in ring) == 8 and ring[-1].peers == 10_000
    # ring time grows with n through the 2(n-1) latency hops; bandwidth term tends to 2 * 8B / bw
    assert all(a.step_s < b.step_s for a, b in itertools.pairwise(ring))
    assert ring[-1].round_comm_s == pytest.approx(2 * 9999 * 0.05 + 2 * 9999 / 10_000 * 0.8)
    hier = Simulator(
        compute_s_per_step=0.5,
        strategy=sim.strategy,
        network=net(latency_s=0.05, algorithm="hierarchical"),
    ).predict(10_000)
    assert hier.round_comm_s < ring[-1].round_comm_s / 10  # O(sqrt n) hops instead of O(n)
    table = format_table(rows(ring))
    lines = table.splitlines()
    assert len(lines) == len(ring) + 1
    assert lines[0].split() == list(COLUMNS)
    assert lines[-1].split()[0] == "10000"


def test_validate_against_a_measurement() -> None:
    # docs/ARCHITECTURE.md, measured facts: Gloo ring all-reduce, 4 peers, 64 MB over 100 Mbit/s links: 95 Mbit/s bus
    # bandwidth, i.e. (6/4) * 64e6 * 8 / 95e6 s per all-reduce
    measured = 1.5 * 64e6 * 8 / 95e6
    sim = Simulator(
        compute_s_per_step=1.0,
        strategy=StrategyProfile(name="ddp", bytes_per_round=64e6),
        network=NetworkModel(bandwidth_bps=100e6, efficiency=1.0),
    )
    (row,) = validate(sim, [{"peers": 4, "round_comm_s": measured, "label": "design"}])
    assert row.metric == "round_comm_s" and row.peers == 4
    assert row.rel_error == pytest.approx(95 / 100 - 1)  # the ideal model is 5% optimistic
    calibrated = Simulator(
        compute_s_per_step=1.0, strategy=sim.strategy, network=NetworkModel(bandwidth_bps=100e6)
    )
    (row,) = validate(calibrated, [{"peers": 4, "round_comm_s": measured}])
    assert abs(row.rel_error) < 1e-9  # the default efficiency 0.95 is that measurement
    two = validate(sim, [{"peers": 2, "step_s": 10.0, "total_s": 100.0, "steps": 10}])
    assert [r.metric for r in two] == ["step_s", "total_s"]
    # step = 1 + 64e6 * 8 / 1e8 = 6.12 s
    assert two[0].predicted == pytest.approx(6.12) and two[0].rel_error == pytest.approx(-0.388)
    with pytest.raises(ValueError, match="row 0 has none of the metrics"):
        validate(sim, [{"peers": 4}])
    with pytest.raises(ValueError, match="finite"):
        validate(sim, [{"peers": 4, "step_s": float("nan")}])
    with pytest.raises(ValueError, match="total_s needs"):
        validate(sim, [{"peers": 4, "total_s": 3.0}])
    with pytest.raises(ValueError, match="no 'peers'"):
        validate(sim, [{"step_s": 1.0}])


def test_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="compute_s_per_step"):
        Simulator(
            compute_s_per_step=0.0,
            strategy=StrategyProfile(name="x", bytes_per_round=1),
            network=net(),
        )
    with pytest.raises(ValueError, match="finite"):
        NetworkModel(bandwidth_bps=float("inf"))
    with pytest.raises(ValueError, match="unknown algorithm"):
        NetworkModel(bandwidth_bps=1e9, algorithm="butterfly")
    with pytest.raises(ValueError, match="overlap"):
        StrategyProfile(name="x", bytes_per_round=1.0, overlap=1.5)
    with pytest.raises(ValueError, match="at least 0"):
        FailureModel(recovery_s=-1.0)


def test_zo_sends_its_bytes_whatever_the_model_and_pays_the_latency() -> None:
    network = net(latency_s=0.01)
    zo = strategy_profile("zo", model_bytes=MB100, zo_bytes=2)
    assert zo.bytes_per_round == 2 and zo.steps_per_round == 1.0
    r = Simulator(compute_s_per_step=0.5, strategy=zo, network=network).predict(4)
    # 2(n - 1) hops of 10 ms, and 2 bytes at the link's rate: nothing else
    assert r.step_s == pytest.approx(0.5 + 6 * 0.01, rel=1e-6)
    assert r.bytes_per_peer_per_step == pytest.approx(2 * 2 * 3 / 4)
