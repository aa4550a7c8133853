"""Communication schedules: exact step patterns, late-heavy density, single merge, validation."""

from __future__ import annotations

import itertools

import pytest

from isthmus.strategies.gossip.math.schedule import (
    CommDecision,
    ConstantSchedule,
    LateHeavySchedule,
    PoissonSchedule,
    SingleMergeSchedule,
    comm_steps,
    make_schedule,
)


def test_constant_every_k_with_iters_and_final_merge():
    s = make_schedule("constant", every=3, iters=2)
    assert comm_steps(s, 10) == [2, 5, 8]
    assert s(2, 10) == CommDecision(gossip_iters=2)
    assert s(3, 10) == CommDecision()
    assert not s(3, 10).communicate
    merged = ConstantSchedule(every=3, final_merge=True)
    assert comm_steps(merged, 10) == [2, 5, 8, 9]
    assert merged(9, 10) == CommDecision(global_average=True)
    assert comm_steps(ConstantSchedule(), 4) == [0, 1, 2, 3]


def test_single_merge_only_averages_at_the_end():
    s = make_schedule("single_merge")
    assert comm_steps(s, 50) == [49]
    assert s(49, 50).global_average and s(49, 50).gossip_iters == 0
    assert isinstance(s, SingleMergeSchedule)


@pytest.mark.parametrize("shape", ["linear", "geometric"])
def test_late_heavy_gets_denser_toward_the_end(shape):
    s = LateHeavySchedule(start_every=32, end_every=1, shape=shape)
    total = 2000
    steps = comm_steps(s, total)
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert steps[0] == 31  # the first period is start_every
    assert all(g2 <= g1 for g1, g2 in itertools.pairwise(gaps))  # periods never grow
    first, last = (
        sum(1 for x in steps if x < total // 4),
        sum(1 for x in steps if x >= 3 * total // 4),
    )
    assert last > 4 * first
    assert steps == comm_steps(LateHeavySchedule(start_every=32, end_every=1, shape=shape), total)


def test_late_heavy_exact_patterns():
    lin = LateHeavySchedule(start_every=4, end_every=1, shape="linear")
    # period after d completed steps: 4 - 3*d//12 -> 4, 3 (d=4), 3 (d=7), 2 (d=10) ...
    assert comm_steps(lin, 12) == [3, 6, 9, 11]
    geo = LateHeavySchedule(start_every=4, end_every=1, shape="geometric")
    # 3 phases of 4 steps with periods 4, 2, 1
    assert comm_steps(geo, 12) == [3, 5, 7, 8, 9, 10, 11]
    fm = LateHeavySchedule(start_every=4, end_every=1, shape="geometric", final_merge=True, iters=3)
    assert fm(11, 12) == CommDecision(global_average=True)
    assert fm(10, 12) == CommDecision(gossip_iters=3)


def test_poisson_is_seeded_with_the_requested_mean():
    s = PoissonSchedule(rate=0.5, seed=3)
    counts = [s(i, 4000).gossip_iters for i in range(4000)]
    assert counts == [PoissonSchedule(rate=0.5, seed=3)(i, 4000).gossip_iters for i in range(4000)]
    assert counts != [PoissonSchedule(rate=0.5, seed=4)(i, 4000).gossip_iters for i in range(4000)]
    assert 0.45 < sum(counts) / len(counts) < 0.55
    assert max(counts) <= 64 and counts.count(0) > 0


def test_validation_says_what_is_wrong():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ConstantSchedule(every=0)
    with pytest.raises(ValueError, match="must be <= start_every"):
        LateHeavySchedule(start_every=2, end_every=4)
    with pytest.raises(ValueError, match="linear' or 'geometric"):
        LateHeavySchedule(shape="cubic")
    with pytest.raises(ValueError, match="rate"):
        PoissonSchedule(rate=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("sometimes")
    with pytest.raises(TypeError):
        make_schedule("constant", period=3)
    with pytest.raises(ValueError, match="0-based"):
        ConstantSchedule()(10, 10)
    with pytest.raises(ValueError, match="total_steps"):
        SingleMergeSchedule()(0, 0)
