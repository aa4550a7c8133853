"""The shard-wise parts of the whole-tensor strategies' math, in one process: what a rank of an
island computes for its own elements has the bits of the whole tensor's result there.

* SparseLoCo: the sum of a round's messages restricted to a shard's window (and one message's
  dense residual) equals the whole sum's elements there, for shards of islands of 2 and 3
  ranks whose bounds cut the codec's chunks.
* ZO: a shard's perturbation is the whole perturbation's slice, and the update applied to
  shards (weight decay included) equals the whole update's slices.
"""

from __future__ import annotations

import pytest
import torch

from isthmus.comm.layout import shard_placement
from isthmus.strategies.sparseloco.math import SparseCodec, sum_messages
from isthmus.strategies.zo.math import apply_update, perturbation, perturbation_seed

SHAPES = [(10, 6), (7,), (3, 10)]


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@pytest.mark.parametrize("size", [2, 3])
def test_sparse_sums_by_window_have_the_whole_sums_bits(size: int) -> None:
    codec = SparseCodec([torch.Size(s) for s in SHAPES], chunk=16, k=4, bits=2, exact=1)
    g = torch.Generator().manual_seed(size)
    messages = [
        codec.encode([torch.randn(s, generator=g) for s in SHAPES], torch.tensor([float(r)]))
        for r in range(3)
    ]
    messages.insert(1, torch.zeros_like(messages[0]))  # an absent member
    whole, exact, n = sum_messages(codec, messages)
    assert n == 3
    sent = codec.dense(codec.decode(messages[0]))
    cut = 0
    for rank in range(size):
        places = [shard_placement(s, size, rank) for s in SHAPES]
        wins = [(p.start, p.stop) for p in places]
        cut += sum(a % 16 != 0 for a, _ in wins)
        part, part_exact, m = sum_messages(codec, messages, wins)
        assert m == n and _bits(part_exact, exact)
        for w, t, (a, b) in zip(part, whole, wins, strict=True):
            assert _bits(w, t[a:b])
        for d, t, (a, b) in zip(
            codec.dense(codec.decode(messages[0]), wins), sent, wins, strict=True
        ):
            assert _bits(d, t[a:b])
    assert cut > 0  # some shard starts inside a chunk


@pytest.mark.parametrize("size", [2, 3])
def test_zo_shards_perturb_and_update_with_the_whole_tensors_bits(size: int) -> None:
    g = torch.Generator().manual_seed(7)
    whole = [torch.randn(s, generator=g) for s in SHAPES]
    seed = perturbation_seed(3, 5, 1)
    for j, t in enumerate(whole):
        z = perturbation(seed, j, t).reshape(-1)
        for rank in range(size):
            p = shard_placement(t.shape, size, rank)
            like = t.reshape(-1)[p.start : p.stop]
            got = perturbation(seed, j, like, (tuple(t.shape), p.start, p.stop))
            assert _bits(got, z[p.start : p.stop])
    seeds = [perturbation_seed(3, 5, r) for r in range(3)]
    estimates = [0.5, None, -1.25]
    updated = [t.clone() for t in whole]
    keep = list(range(len(whole)))
    apply_update(updated, keep, seeds, estimates, lr=0.1, weight_decay=0.2)
    for rank in range(size):
        places = [shard_placement(t.shape, size, rank) for t in whole]
        shards = [
            t.reshape(-1)[p.start : p.stop].clone() for t, p in zip(whole, places, strict=True)
        ]
        # shards keep their dimensions (FSDP2's rows)
        rows = [s.reshape(-1, *t.shape[1:]) for s, t in zip(shards, whole, strict=True)]
        spans = [(tuple(t.shape), p.start, p.stop) for t, p in zip(whole, places, strict=True)]
        n = apply_update(
            rows, keep, seeds, estimates, lr=0.1, weight_decay=0.2,
            decay=[t.dim() >= 2 for t in whole], spans=spans,
        )  # fmt: skip
        assert n == 2
        for s, u, p in zip(rows, updated, places, strict=True):
            assert _bits(s.reshape(-1), u.reshape(-1)[p.start : p.stop])
