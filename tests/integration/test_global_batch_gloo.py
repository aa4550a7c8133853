"""A fixed global batch over real in-process Gloo groups: the weighted reduction of uneven shares
is the gradient of the whole batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from isthmus.data.global_batch import (
    share_positions,
    step_positions,
)
from isthmus.reduce.reducer import Reducer
from isthmus.strategies.ddp import accumulate_share
from isthmus.testing import local_groups, run_parallel
from support.global_batch import make_model, positions_loss
from support.sessions import FakeRound


def test_uneven_shares_weighted_equal_the_one_process_gradient() -> None:
    """A global batch of 10 on 3 peers (shares 4, 3, 3; micro-batches of 2): the reduced,
    sample-weighted gradient equals the gradient of the mean loss over the 10 samples."""
    ref = make_model()
    fresh = copy.deepcopy(ref)
    positions_loss(ref)(list(step_positions(2, 10))).backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    groups = local_groups(3)

    models = [copy.deepcopy(fresh) for _ in groups]  # not in the threads: the global RNG is shared

    def peer(g: Any) -> tuple[list[torch.Tensor], float, int]:
        model = models[g.rank]
        params = list(model.parameters())
        share = share_positions(2, 10, g.rank, g.world)
        loss = accumulate_share(params, positions_loss(model), share, micro_batch=2)
        items = [(str(i), p.grad) for i, p in enumerate(params)]
        out = Reducer().mean(
            FakeRound(g), items, contribute=True, exact=loss.reshape(1), weight=len(share)
        )
        assert out is not None and out.exact is not None
        return out.tensors, float(out.exact[0]), out.contributors

    results = run_parallel(groups, peer)
    with torch.no_grad():
        whole = float(positions_loss(ref)(list(step_positions(2, 10))))
    for tensors, loss, count in results:
        assert count == 10
        assert loss == pytest.approx(whole, rel=1e-6)
        for got, want in zip(tensors, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # every peer holds the same bits
    for tensors, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(tensors, results[0][0], strict=True))
