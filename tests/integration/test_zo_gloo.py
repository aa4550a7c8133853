"""Zeroth-order training (``zo``) with several members over in-process Gloo groups (threads, no
coordinator), ending bitwise equal to the pure update."""

from __future__ import annotations

import pytest
import torch

from isthmus.comm.group import CommStats, Group
from isthmus.data import Corpus
from isthmus.models import GPT
from isthmus.strategies.zo import ZO, ZOConfig
from isthmus.strategies.zo.math import apply_update, perturbation_seed
from isthmus.testing import local_groups, run_parallel
from support.sessions import Rounds
from support.zo import TINY, batch, bits_equal, hand_estimate, quantized, sgd

pytestmark = pytest.mark.usefixtures("one_thread")


# -- several members ----------------------------------------------------------------------------
def _members(
    corpus: Corpus, world: int, steps: int, cfg: ZOConfig, resynced: dict[int, set[int]]
) -> list[tuple[GPT, CommStats, int]]:
    groups = local_groups(world)
    models = [GPT(TINY, seed=5) for _ in range(world)]  # built here: one global RNG

    def peer(g: Group) -> tuple[GPT, CommStats, int]:
        model = models[g.rank]
        session = Rounds(g, frozenset(resynced.get(g.rank, set())))
        st = ZO(session, model, sgd(model), cfg)  # type: ignore[arg-type]
        for step in range(steps):
            x, y = batch(corpus, step, g.rank, world)
            st.step(lambda x=x, y=y: model(x, y)[1])
        return model, g.stats, st.absent_seen

    return run_parallel(groups, peer)


@pytest.mark.parametrize("resynced", [{}, {1: {1}}], ids=["all-count", "rank1-resynced-in-round1"])
def test_three_members_end_bitwise_equal_to_the_pure_update(corpus, resynced):
    cfg = ZOConfig(lr=1e-3, seed=11)
    steps, world = 3, 3
    out = _members(corpus, world, steps, cfg, resynced)
    for model, _, _ in out[1:]:
        assert bits_equal(model, out[0][0])
    assert all(absent == sum(map(len, resynced.values())) for _, _, absent in out)
    # the same rounds by hand: each member's estimate on its own batch, quantized, applied by
    # every peer in rank order, members resynced in a round left out
    ref = GPT(TINY, seed=5)
    for rnd in range(steps):
        gs: list[float | None] = []
        for rank in range(world):
            if rnd in resynced.get(rank, set()):
                gs.append(None)
                continue
            x, y = batch(corpus, rnd, rank, world)
            g = hand_estimate(
                list(ref.parameters()),
                lambda x=x, y=y: ref(x, y)[1],
                seed=11,
                rnd=rnd,
                rank=rank,
                eps=1e-3,
            )
            gs.append(quantized(g, 8))
        seeds = [perturbation_seed(11, rnd, rank, 0) for rank in range(world)]
        params = list(ref.parameters())
        with torch.no_grad():
            applied = apply_update(params, range(len(params)), seeds, gs, lr=cfg.lr)
        assert applied == sum(g is not None for g in gs)
    assert bits_equal(out[0][0], ref)
    # bytes: one byte per step per member, (world - 1) copies of it sent by each
    for _, stats, _ in out:
        assert stats.bytes_sent == steps * (world - 1) * 1
        assert stats.by_op == {"all_gather": steps * (world - 1)}
