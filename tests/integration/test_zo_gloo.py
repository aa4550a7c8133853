"""Zeroth-order training (``zo``) with several members over in-process Gloo groups (threads, no
coordinator), ending bitwise equal to the pure update."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import CommStats, Group
from isthmus.comm.state import SharedState
from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.strategies.zo import ZO, ZOConfig
from isthmus.strategies.zo.math import (
    ScalarCodec,
    apply_update,
    float32,
    perturbation_seed,
)
from isthmus.testing import local_groups, run_parallel

TINY = GPTConfig.tiny()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: threads only add contention on a loaded 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_stdlib(max_bytes=100_000)


def batch(corpus: Corpus, step: int, rank: int = 0, world: int = 1) -> tuple[Any, Any]:
    return corpus.batch(step=step, rank=rank, world=world, batch_size=4, block_size=TINY.block_size)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)  # never used by zo


# -- the documented rules, written out again ------------------------------------------------------
def doc_seed(*parts: int) -> int:
    data = b"isthmus-zo" + b"".join(struct.pack("<q", p) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & (2**63 - 1)


def doc_z(run_seed: int, rnd: int, rank: int, k: int, j: int, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(doc_seed(doc_seed(run_seed, rnd, rank, k), j))
    return torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype)


def hand_estimate(
    params: list[torch.Tensor],
    loss: Callable[[], torch.Tensor],
    *,
    seed: int,
    rnd: int,
    rank: int,
    eps: float,
) -> float:
    """MeZO's two forward passes (theta + eps z, then - 2 eps z), restored from a copy."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        zs = [doc_z(seed, rnd, rank, 0, j, p) for j, p in enumerate(params)]
        for p, z in zip(params, zs, strict=True):
            p.add_(z, alpha=eps)
        plus = float(loss())
        for p, z in zip(params, zs, strict=True):
            p.add_(z, alpha=-2 * eps)
        minus = float(loss())
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return (plus - minus) / (2 * eps)


def quantized(g: float, bits: int) -> float:
    if bits == 32:
        return float32(g)
    q = ScalarCodec(bits).quantize(g)
    assert q is not None
    return q


def bits_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- several members ----------------------------------------------------------------------------
class _Round:
    def __init__(self, group: Group, number: int, resynced: bool) -> None:
        self.group, self.number, self.resynced = group, number, resynced
        self.rank, self.world, self.epoch = group.rank, group.world, 0

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        pass


class FakeSession:
    """What the strategy uses of a Session, over an in-process group whose rounds always
    commit; ``resynced`` names the rounds in which this peer was repaired."""

    def __init__(self, group: Group, resynced: frozenset[int] = frozenset()) -> None:
        self.group, self.resynced_in = group, resynced
        self.state, self.faults, self.stats = SharedState(), FaultInjector(), group.stats
        self.revision = 0

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None:
        pass  # ZO's rounds reduce nothing through the reducer

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def run_round(self, fn: Callable[[Any], Any]) -> Any:
        out = fn(_Round(self.group, self.revision, self.revision in self.resynced_in))
        self.revision += 1
        return out


def _members(
    corpus: Corpus, world: int, steps: int, cfg: ZOConfig, resynced: dict[int, set[int]]
) -> list[tuple[GPT, CommStats, int]]:
    groups = local_groups(world)
    models = [GPT(TINY, seed=5) for _ in range(world)]  # built here: one global RNG

    def peer(g: Group) -> tuple[GPT, CommStats, int]:
        model = models[g.rank]
        session = FakeSession(g, frozenset(resynced.get(g.rank, set())))
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
