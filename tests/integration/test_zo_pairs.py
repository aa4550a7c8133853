"""Perturbation parallelism under ``zo`` (``pairing="perturbation"``, DistZO2): over real
in-process Gloo groups, pairs split the two passes of each perturbation and every member ends
bitwise equal to the update written out by hand; the bytes each member sends; a partner lost in
the round leaves nothing applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from isthmus.comm.group import CollectiveError, Group
from isthmus.data import Corpus
from isthmus.models import GPT
from isthmus.strategies.zo import ZO, ZOConfig
from isthmus.strategies.zo.math import (
    ScalarCodec,
    apply_update,
    float32,
    perturb_,
    perturbation_seed,
)
from isthmus.testing import local_groups, run_parallel
from support.sessions import Rounds
from support.zo import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(corpus: Corpus, step: int, shard: int, shards: int) -> tuple[Any, Any]:
    return corpus.batch(
        step=step, rank=shard, world=shards, batch_size=4, block_size=TINY.block_size
    )


def _loss(model: GPT, corpus: Corpus, step: int) -> Callable[..., torch.Tensor]:
    def fn(shard: int, shards: int) -> torch.Tensor:
        x, y = _batch(corpus, step, shard, shards)
        return model(x, y)[1]

    return fn


@pytest.mark.parametrize("world", [4, 3])
def test_pairs_split_the_passes_and_every_member_ends_equal_to_the_hand_update(corpus, world):
    cfg = ZOConfig(lr=1e-3, seed=9, pairing="perturbation", perturbations=2)
    steps = 2
    groups = local_groups(world)
    models = [GPT(TINY, seed=1) for _ in range(world)]

    def peer(g: Group) -> tuple[GPT, dict[str, int]]:
        model = models[g.rank]
        st = ZO(Rounds(g), model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)  # type: ignore[arg-type]
        for step in range(steps):
            st.step(_loss(model, corpus, step))
        return model, dict(g.stats.by_op)

    out = run_parallel(groups, peer)
    # by hand: pair p = ranks (2p, 2p+1) on shard p of ceil(world/2), z seeded by rank 2p; the
    # + pass on one member and the - pass on the other, losses in float32; an odd member alone
    # runs both passes (MeZO's +eps then -2eps from the + point) in full precision
    ref = GPT(TINY, seed=1)
    params = list(ref.parameters())
    keep = list(range(len(params)))
    codec = ScalarCodec(8)
    shards = (world + 1) // 2
    for rnd in range(steps):
        seeds, gs = [], []
        with torch.no_grad():
            for rank in range(world):
                for k in range(cfg.perturbations):
                    seeds.append(perturbation_seed(9, rnd, rank, k))
                    if rank % 2 == 1:
                        gs.append(None)  # the odd member of a pair sends absent codes
                        continue
                    seed = perturbation_seed(9, rnd, rank, k)
                    x, y = _batch(corpus, rnd, rank // 2, shards)
                    saved = [p.clone() for p in params]
                    perturb_(params, keep, seed, 1e-3)
                    plus = float(ref(x, y)[1])
                    if rank + 1 < world:
                        for p, s in zip(params, saved, strict=True):
                            p.copy_(s)
                        perturb_(params, keep, seed, -1e-3)
                        plus = float32(plus)
                    else:
                        perturb_(params, keep, seed, -2e-3)
                    minus = float(ref(x, y)[1])
                    minus = float32(minus) if rank + 1 < world else minus
                    for p, s in zip(params, saved, strict=True):
                        p.copy_(s)
                    gs.append(codec.quantize((plus - minus) / 2e-3))
            apply_update(params, keep, seeds, gs, lr=1e-3)
    for model, _ in out:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params, strict=True))
    # bytes: the one-byte codes of the all-gather for everyone (absent ones too), and 4 bytes
    # per perturbation from each odd member to its lead
    for rank, (_, by_op) in enumerate(out):
        assert by_op["all_gather"] == steps * (world - 1) * 2  # one byte per perturbation
        assert by_op.get("send", 0) == (steps * 4 * 2 if rank % 2 == 1 else 0)


def test_a_partner_lost_in_the_round_leaves_nothing_applied(corpus):
    cfg = ZOConfig(lr=1e-3, pairing="perturbation")
    groups = local_groups(2)
    models = [GPT(TINY, seed=1) for _ in range(2)]
    before = [p.detach().clone() for p in models[0].parameters()]

    def peer(g: Group) -> None:
        model = models[g.rank]
        st = ZO(Rounds(g), model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)  # type: ignore[arg-type]
        loss = _loss(model, corpus, 0)
        if g.rank == 1:
            # the partner dies during its pass: the lead's receive fails with the group
            def dying(shard: int, shards: int) -> torch.Tensor:
                raise RuntimeError("partner lost")

            loss = dying
        st.step(loss)

    with pytest.raises((RuntimeError, CollectiveError)):
        run_parallel(groups, peer)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), before, strict=True))


@pytest.mark.parametrize("pairing", ["none", "perturbation"])
def test_memory_stays_at_inference_level_no_graph_no_grads_no_optimizer_state(corpus, pairing):
    # what keeps zo at inference memory: every forward pass runs without autograd (so no
    # activation is kept for a backward), no gradient is ever allocated, and the optimizer
    # passed in never builds state (torch allocates AdamW's moments on its first step)
    cfg = ZOConfig(lr=1e-3, pairing=pairing)
    groups = local_groups(2)
    models = [GPT(TINY, seed=1) for _ in range(2)]
    seen: list[tuple[bool, bool]] = []

    def peer(g: Group) -> torch.optim.Optimizer:
        model = models[g.rank]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        st = ZO(Rounds(g), model, opt, cfg)  # type: ignore[arg-type]
        for step in range(2):
            inner = _loss(model, corpus, step)

            def loss(shard: int = g.rank, shards: int = 2, inner=inner) -> torch.Tensor:
                out = inner(shard, shards)
                seen.append((torch.is_grad_enabled(), out.grad_fn is not None))
                return out

            st.step(loss)
        return opt

    opts = run_parallel(groups, peer)
    assert seen and all(s == (False, False) for s in seen)
    for model, opt in zip(models, opts, strict=True):
        assert all(p.grad is None for p in model.parameters())
        assert len(opt.state) == 0
