"""MoDeST round sampling: identical on every peer, fresh every round, stable under churn; the
distributed MoDeST round equals its reference bit for bit on every rank."""

from __future__ import annotations

import random

import pytest
import torch

from isthmus.strategies.gossip.sampling import (
    aggregation_ready,
    modest_aggregate,
    modest_aggregate_reference,
    sample_round,
)
from isthmus.testing import local_groups, run_parallel

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


def _models(n: int, size: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(size, generator=g) + i for i in range(n)]


@pytest.mark.parametrize(
    ("trainers", "aggregators"), [([0, 2, 3], [1]), ([1, 4], [4, 0]), ([0, 1, 2, 3, 4], [2, 3])]
)
def test_modest_aggregate_equals_the_reference_bitwise_on_every_rank(trainers, aggregators):
    n = 5
    xs = _models(n)
    fallback = torch.full((300,), 7.0)
    groups = local_groups(n)
    out = run_parallel(
        groups,
        lambda g: modest_aggregate(
            g,
            xs[g.rank],
            trainers=trainers,
            aggregators=aggregators,
            expected=len(trainers),
            success_fraction=1.0,
            fallback=fallback,
            exchange=3,
        ),
    )
    ref, used = modest_aggregate_reference(
        xs, trainers, expected=len(trainers), success_fraction=1.0, fallback=fallback
    )
    assert used == len(trainers)
    assert torch.allclose(ref, torch.stack([xs[t] for t in trainers]).mean(0), atol=1e-6)
    for vec, count in out:
        assert torch.equal(vec, ref) and count == used
    # bytes: each trainer sends one model per other aggregator; aggregators serve the rest
    sent = [g.stats.by_op.get("send", 0) for g in groups]
    model = 300 * 4
    others = n - len(aggregators)
    msgs = sum(len([a for a in aggregators if a != t]) for t in trainers) + others
    assert sum(sent) == msgs * model


def test_modest_keeps_the_previous_aggregate_when_too_few_trainers_arrived():
    xs = _models(3)
    fallback = torch.full((300,), -2.0)
    out = run_parallel(
        local_groups(3),
        lambda g: modest_aggregate(
            g,
            xs[g.rank],
            trainers=[1],  # one of the four sampled trainers survived
            aggregators=[0],
            expected=4,
            success_fraction=0.5,
            fallback=fallback,
            exchange=0,
        ),
    )
    for vec, count in out:
        assert torch.equal(vec, fallback) and count == 0
    with pytest.raises(ValueError, match="aggregator"):
        modest_aggregate(
            local_groups(1)[0],
            xs[0],
            trainers=[0],
            aggregators=[],
            expected=1,
            success_fraction=1.0,
            fallback=fallback,
            exchange=0,
        )


def test_an_overflowing_aggregate_fails_every_rank_alike_not_by_timeout():
    # two finite models whose sum overflows: the aggregator refuses the aggregate, and the
    # ranks it serves must learn that from it (a ValueError) instead of waiting for a send that
    # never comes and reading the timeout as a dead peer
    xs = _models(4)
    xs[1] = torch.full_like(xs[1], 3e38)
    xs[2] = torch.full_like(xs[2], 3e38)

    def one(g):
        try:
            modest_aggregate(
                g,
                xs[g.rank],
                trainers=[1, 2],
                aggregators=[0],
                expected=2,
                success_fraction=1.0,
                fallback=torch.zeros(300),
                exchange=1,
            )
        except Exception as e:  # collected per rank, not raised (that would abort the others)
            return e
        return None

    out = run_parallel(local_groups(4, timeout_s=20.0), one)
    assert all(isinstance(e, ValueError) for e in out), out
    assert "not finite" in str(out[0]) and "NaN" in str(out[3])
