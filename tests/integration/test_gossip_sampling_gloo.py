"""The distributed MoDeST round over real in-process Gloo groups: equal to its reference bit for
bit on every rank, keeping the previous aggregate when too few trainers arrived, failing alike on
overflow."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.gossip.math.sampling import modest_aggregate_reference
from isthmus.strategies.gossip.modest import modest_aggregate
from isthmus.testing import local_groups, run_parallel


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
