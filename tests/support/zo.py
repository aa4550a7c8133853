"""Zeroth-order (``zo``) test helpers: the batches and optimizer the tests hand the strategy, and
the hand-written MeZO reference, which re-derives the seeds and ``z`` from the documented rules
(:mod:`isthmus.strategies.zo.math`'s docstring) with hashlib and ``torch.randn`` rather than
calling the module's generator."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isthmus.data import Corpus
from isthmus.models import GPTConfig
from isthmus.strategies.zo.math import ScalarCodec, float32

TINY = GPTConfig.tiny()


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
    """The estimate as the wire carries it: float32 at 32 bits, else the codec's value (the test
    fails if the codec calls it absent)."""
    if bits == 32:
        return float32(g)
    q = ScalarCodec(bits).quantize(g)
    assert q is not None
    return q


def bits_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
