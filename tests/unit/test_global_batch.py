"""A fixed global batch (isthmus.data.global_batch, DDP's global_batch) in one process: which
positions a step uses, how they are split, and weights under the robust rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isthmus.data.global_batch import (
    GlobalOrder,
    island_part,
    micro_batches,
    sample_seed,
    share_positions,
    step_positions,
)
from isthmus.reduce.reducer import Reducer
from isthmus.strategies.ddp import DDP, DDPConfig
from isthmus.testing import local_groups
from support.global_batch import make_model, positions_loss
from support.sessions import FakeRound


def test_a_step_uses_the_same_positions_whatever_the_split() -> None:
    for world in (1, 2, 3, 4, 7):
        shares = [share_positions(5, 10, r, world) for r in range(world)]
        assert [p for s in shares for p in s] == list(step_positions(5, 10)) == list(range(50, 60))
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [len(s) for s in (share_positions(0, 2, r, 3) for r in range(3))] == [1, 1, 0]
    assert micro_batches(range(3, 10), 3) == [range(3, 6), range(6, 9), range(9, 10)]
    assert micro_batches(range(3, 10), 0) == [range(3, 10)]
    with pytest.raises(ValueError, match="rank must be in"):
        share_positions(0, 10, 3, 3)
    with pytest.raises(ValueError, match="global_batch must be an int >= 1"):
        step_positions(0, 0)


def test_an_island_splits_its_share_and_every_rank_runs_as_many_passes() -> None:
    """An island's share split among its ranks uses every position once, in order, each rank's
    micro-batches no longer than asked; every rank runs the passes of the largest part (the
    others pad), and the sampler's split (share of share) is the same split."""
    for size, ranks, micro in ((5, 2, 2), (7, 3, 0), (1, 2, 2), (0, 2, 2), (9, 4, 1)):
        share = range(100, 100 + size)
        parts = [island_part(share, micro, r, ranks) for r in range(ranks)]
        assert [p for pieces, _ in parts for piece in pieces for p in piece] == list(share)
        assert len({passes for _, passes in parts}) == 1
        passes = parts[0][1]
        assert passes == max(len(pieces) for pieces, _ in parts)
        assert all(len(piece) <= (micro or size) for pieces, _ in parts for piece in pieces)
    assert island_part(range(10, 15), 2, 1, 2) == ([range(13, 15)], 2)  # one pass of padding
    assert island_part(range(10, 11), 0, 1, 2) == ([], 1)  # no sample: one padding pass
    assert island_part(range(0), 2, 0, 2) == ([], 0)
    with pytest.raises(ValueError, match="rank must be in"):
        island_part(range(4), 2, 2, 2)


def test_the_order_is_a_fresh_permutation_per_pass() -> None:
    order = GlobalOrder(7, seed=3)
    first, second = order(range(7)), order(range(7, 14))
    assert sorted(first) == sorted(second) == list(range(7))
    assert list(first) != list(second)
    assert list(order([9, 2, 9])) == [second[2], first[2], second[2]]
    assert list(GlobalOrder(7, seed=3)(range(14))) == [*first, *second]
    assert sample_seed(0, 5) == sample_seed(0, 5) != sample_seed(0, 6)


def test_weight_one_keeps_the_bits_and_robust_rules_refuse_weights() -> None:
    (g,) = local_groups(1)
    t = torch.tensor([0.1, 0.7, 1.3])
    plain = Reducer().mean(FakeRound(g), [("t", t)], contribute=True)
    weighted = Reducer().mean(FakeRound(g), [("t", t)], contribute=True, weight=3)
    assert plain is not None and weighted is not None
    assert torch.equal(plain.tensors[0], t) and weighted.contributors == 3
    torch.testing.assert_close(weighted.tensors[0], t)
    nothing = Reducer().mean(FakeRound(g), [("t", t)], contribute=True, weight=0)
    assert nothing is None  # a peer with no samples contributes nothing
    with pytest.raises(ValueError, match="one vote per peer"):
        Reducer(aggregator="krum").mean(FakeRound(g), [("t", t)], contribute=True, weight=2)
    with pytest.raises(ValueError, match="finite number >= 0"):
        Reducer().mean(FakeRound(g), [("t", t)], contribute=True, weight=-1)


def test_ddp_global_batch_alone_is_plain_training_on_the_batch() -> None:
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = DDP(None, model, opt, DDPConfig(global_batch=6, micro_batch=4))
    for step in range(3):
        ddp.step(positions_loss(model))
        ref_opt.zero_grad()
        positions_loss(ref)(list(range(6 * step, 6 * step + 6))).backward()
        ref_opt.step()
        assert ddp.last_share == range(6 * step, 6 * step + 6)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="step\\(loss_fn\\)"):
        ddp.step()
    with pytest.raises(ValueError, match="only applies with global_batch"):
        DDPConfig(micro_batch=4)
    assert np.array_equal(GlobalOrder(5)(range(0)), np.array([], dtype=np.int64))
