"""Consensus distance over real in-process Gloo groups: equal to the pure form, non-contributing
ranks left out."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.gossip.exchange import consensus_distance_group
from isthmus.strategies.gossip.math.consensus import consensus_distance
from isthmus.testing import local_groups, run_parallel


def test_consensus_distance_distributed_equals_pure():
    world = 4
    g = torch.Generator().manual_seed(3)
    base = torch.randn(500, generator=g) * 50
    xs = [base + torch.randn(500, generator=g) * 1e-2 for _ in range(world)]
    groups = local_groups(world)
    out = run_parallel(
        groups,
        lambda grp: (
            consensus_distance_group(grp, xs[grp.rank], kind="mean"),
            consensus_distance_group(grp, xs[grp.rank], kind="rms", reference=base),
            consensus_distance_group(grp, xs[grp.rank], kind="rms"),
        ),
    )
    mean_ref = consensus_distance(xs, kind="mean")
    rms_ref = consensus_distance(xs, kind="rms")
    for mean_d, rms_d, rms_noref in out:
        assert mean_d == pytest.approx(mean_ref, rel=1e-9)
        assert rms_d == pytest.approx(rms_ref, rel=1e-9)
        assert rms_noref == pytest.approx(rms_ref, rel=1e-3)  # float64 cancellation, still close
    assert len({o[0] for o in out}) == 1


def test_consensus_distance_leaves_out_non_contributing_ranks():
    world = 4
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(100, generator=g) * (i + 1) for i in range(world)]
    stale = 2
    bad = torch.full((100,), float("nan"))  # a joiner's vector may hold anything
    out = run_parallel(
        local_groups(world),
        lambda grp: [
            consensus_distance_group(
                grp,
                bad if grp.rank == stale else xs[grp.rank],
                kind=kind,
                contribute=grp.rank != stale,
            )
            for kind in ("mean", "rms")
        ],
    )
    kept = [x for i, x in enumerate(xs) if i != stale]
    for mean_d, rms_d in out:
        assert mean_d == pytest.approx(consensus_distance(kept, kind="mean"), rel=1e-9)
        assert rms_d == pytest.approx(consensus_distance(kept, kind="rms"), rel=1e-6)
