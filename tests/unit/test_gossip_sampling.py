"""MoDeST round sampling in one process: identical on every peer, fresh every round, stable under
churn, exact success fractions."""

from __future__ import annotations

import random

import pytest

from isthmus.strategies.gossip.math.sampling import (
    aggregation_ready,
    sample_round,
)

MEMBERS = [f"peer-{i:03d}" for i in range(40)]


def test_every_peer_draws_the_same_sample_whatever_its_member_order():
    draws = []
    for peer in range(5):
        view = list(MEMBERS)
        random.Random(peer).shuffle(view)  # each peer may hold the list in another order
        draws.append(sample_round(view, 17, seed=9, trainers=6, aggregators=2))
    assert all(d == draws[0] for d in draws)
    s = draws[0]
    assert len(s.trainers) == 6 and len(set(s.trainers)) == 6
    assert len(s.aggregators) == 2 and set(s.aggregators) <= set(MEMBERS)


def test_samples_differ_across_rounds_and_seeds_and_cover_everyone():
    rounds = [sample_round(MEMBERS, r, seed=1, trainers=5, aggregators=2) for r in range(60)]
    assert len({s.trainers for s in rounds}) == 60
    assert rounds[0] != sample_round(MEMBERS, 0, seed=2, trainers=5, aggregators=2)
    seen = {m for s in rounds for m in s.trainers}
    assert seen == set(MEMBERS)  # 300 draws of 40 members: every member trains at some point


def test_churn_does_not_reshuffle_the_survivors():
    full = sample_round(MEMBERS, 3, seed=4, trainers=8, aggregators=3)
    gone = set(MEMBERS[::4]) - set(full.trainers)
    left = [m for m in MEMBERS if m not in gone]
    after = sample_round(left, 3, seed=4, trainers=8, aggregators=3)
    assert after.trainers == full.trainers  # none of the sampled trainers left, so same sample


def test_disjoint_roles_and_small_member_lists():
    s = sample_round(MEMBERS, 5, seed=0, trainers=10, aggregators=4, disjoint=True)
    assert not set(s.trainers) & set(s.aggregators)
    tiny = sample_round([3, 1, 2], 0, seed=0, trainers=10, aggregators=10)
    assert sorted(tiny.trainers) == [1, 2, 3] and sorted(tiny.aggregators) == [1, 2, 3]
    pair = sample_round(["a", "b"], 0, seed=0, trainers=5, aggregators=5, disjoint=True)
    assert len(pair.aggregators) == 1 and pair.trainers == tuple(set("ab") - set(pair.aggregators))
    solo = sample_round(["a"], 0, seed=0, trainers=1, aggregators=1, disjoint=True)
    assert solo.trainers == solo.aggregators == ("a",)


def test_sampling_errors():
    with pytest.raises(ValueError, match="empty"):
        sample_round([], 0, seed=0, trainers=1, aggregators=1)
    with pytest.raises(ValueError, match="duplicates"):
        sample_round(["a", "a"], 0, seed=0, trainers=1, aggregators=1)
    with pytest.raises(ValueError, match="at least one trainer"):
        sample_round(["a"], 0, seed=0, trainers=0, aggregators=1)


def test_aggregation_ready_uses_exact_fractions():
    assert aggregation_ready(1, 10, 0.1)  # float 0.1 * 10 is 1.0000000000000002: must need 1
    assert not aggregation_ready(2, 5, 0.6)
    assert aggregation_ready(3, 5, 0.6)
    assert not aggregation_ready(0, 0, 0.5)  # always at least one model
    assert aggregation_ready(20, 20, 1.0) and not aggregation_ready(19, 20, 1.0)
    with pytest.raises(ValueError, match="success_fraction"):
        aggregation_ready(1, 1, 0.0)
