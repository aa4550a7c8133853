"""The reductions of islands against an unsharded peer's, in one process.

Islands are simulated with in-process Gloo groups (:func:`isthmus.testing.local_groups`), one
thread per rank: every tuple of owners (:func:`isthmus.comm.layout.piece_groups`) gets a group
whose member ``j`` is the owning rank of island ``j``, exactly as an island session connects
them, and the ranks of one island agree through a stand-in of :class:`~isthmus.comm.island.Island`
(a barrier and a shared board). Each island holds the same full update an unsharded peer would;
its ranks reduce their shards with :func:`~isthmus.strategies.sharded.start_reduction`, and the
reassembled result is compared with the unsharded peers' reduction bit for bit where the math is
elementwise.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from isthmus.comm.layout import Placement, piece_groups, shard_placement
from isthmus.reduce.compress.formats import make_format
from isthmus.reduce.reducer import Reduced, Reducer
from isthmus.strategies.sharded import quantized_span_exact, start_reduction
from isthmus.testing import local_groups
from support.sessions import FakeRound

SHAPES = [(5, 3), (4,), (7, 2), (3, 4)]


class Board:
    """What the ranks of one simulated island share: a barrier and a slot per rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)


class FakeIsland:
    """Rank ``rank`` of a simulated island: :meth:`gather` as the real island's."""

    def __init__(self, board: Board, rank: int) -> None:
        self.board, self.rank, self.size = board, rank, board.size

    def gather(self, obj: Any) -> list[Any]:
        self.board.slots[self.rank] = obj
        self.board.barrier.wait()
        out = list(self.board.slots)
        self.board.barrier.wait()  # nobody writes the next value before all have read this one
        return out


class IslandRound(FakeRound):
    """A round of one rank of an island: its piece groups and its session's island."""

    def __init__(self, pieces: dict[tuple[int, ...], Any], island: FakeIsland, sizes: list[int]):
        super().__init__(group=next(iter(pieces.values())))
        equal = len(set(sizes)) == 1
        self.pieces = None if equal else pieces
        self.session = type("S", (), {"island": island, "island_sizes": sizes})()


def _updates(n: int, seed: int, shapes: Any = SHAPES) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(n)]


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def _unsharded(
    updates: list[list[torch.Tensor]], exact: list[torch.Tensor], make: Any
) -> list[Reduced | None]:
    """Every peer's result when each island is one unsharded peer."""
    groups = local_groups(len(updates))
    out: list[Any] = [None] * len(updates)

    def peer(j: int) -> None:
        items = [(f"t{k}", t) for k, t in enumerate(updates[j])]
        out[j] = make().start(FakeRound(groups[j]), items, contribute=True, exact=exact[j]).wait()

    _run([threading.Thread(target=peer, args=(j,)) for j in range(len(updates))])
    return out


def _islands(
    sizes: list[int],
    updates: list[list[torch.Tensor]],
    exact: list[torch.Tensor],
    make: Any,
    *,
    spoil: tuple[int, int] | None = None,
    shapes: Any = SHAPES,
) -> dict[tuple[int, int], Reduced | None]:
    """Every rank's result (by (island, rank)) when island ``j`` has ``sizes[j]`` ranks, each
    holding its ``Shard(0)`` rows of ``updates[j]``; ``spoil`` = (island, rank) puts a NaN in
    that rank's first shard."""
    tuples = piece_groups(shapes, sizes)
    conn = {owners: local_groups(len(sizes)) for owners in tuples}
    boards = [Board(n) for n in sizes]
    out: dict[tuple[int, int], Any] = {}

    def rank(j: int, i: int) -> None:
        places = [shard_placement(s, sizes[j], i) for s in shapes]
        items = []
        for k, (t, p) in enumerate(zip(updates[j], places, strict=True)):
            shard = t.reshape(-1)[p.start : p.stop].clone()
            if spoil == (j, i) and k == 0:
                shard[0] = float("nan")
            items.append((f"t{k}", shard))
        pieces = {owners: conn[owners][j] for owners in tuples if owners[j] == i}
        rnd = IslandRound(pieces, FakeIsland(boards[j], i), sizes)
        pending = start_reduction(make(), rnd, items, list(places), contribute=True, exact=exact[j])
        out[(j, i)] = pending.wait()

    _run(
        [threading.Thread(target=rank, args=(j, i)) for j, n in enumerate(sizes) for i in range(n)]
    )
    return out


def _assembled(
    results: dict[tuple[int, int], Reduced | None],
    sizes: list[int],
    island: int,
    shapes: Any = SHAPES,
) -> list[torch.Tensor]:
    """Island ``island``'s full result, put together from its ranks' shards."""
    full = [torch.empty(s).reshape(-1) for s in shapes]
    for i in range(sizes[island]):
        r = results[(island, i)]
        assert r is not None
        for k, s in enumerate(shapes):
            p: Placement = shard_placement(s, sizes[island], i)
            full[k][p.start : p.stop] = r.tensors[k].reshape(-1)
    return [f.view(s) for f, s in zip(full, shapes, strict=True)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)))


def _exacts(n: int) -> list[torch.Tensor]:
    return [torch.tensor([float(j + 1), 0.25 * j]) for j in range(n)]


@pytest.mark.parametrize("sizes", [[2, 1], [2, 2], [3, 1]])
def test_plain_mean_by_shard_has_the_bits_of_unsharded_peers(sizes: list[int]) -> None:
    """Two islands, sharded alike or not: every rank's shard of the mean has the bits of the
    unsharded peers' mean, and every rank carries the same exact values and count."""
    updates, exact = _updates(2, 1), _exacts(2)
    ref = _unsharded(updates, exact, Reducer)[0]
    got = _islands(sizes, updates, exact, Reducer)
    assert ref is not None
    for j in range(len(sizes)):
        for a, b in zip(_assembled(got, sizes, j), ref.tensors, strict=True):
            assert _bits_equal(a, b.view(a.shape))
    for r in got.values():
        assert r is not None and r.contributors == 2 and r.exact is not None
        assert _bits_equal(r.exact, ref.exact)  # type: ignore[arg-type]


def test_a_non_finite_shard_takes_its_whole_island_out_of_the_round() -> None:
    """One rank of the island of two holds a NaN: the island contributes nothing on any of its
    ranks (one decision), so every rank gets the other island's update alone."""
    sizes = [2, 1]
    updates, exact = _updates(2, 2), _exacts(2)
    got = _islands(sizes, updates, exact, Reducer, spoil=(0, 1))
    for j in range(2):
        for a, b in zip(_assembled(got, sizes, j), updates[1], strict=True):
            assert torch.equal(a, b)
    assert all(r is not None and r.contributors == 1 for r in got.values())


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_coordinate_wise_robust_rules_by_shard_have_the_unsharded_bits(rule: str) -> None:
    """Three islands of 2, 1 and 1 ranks, f = 1: a coordinate-wise rule on each piece gives
    every coordinate the value the unsharded aggregation gives it, bit for bit."""
    sizes = [2, 1, 1]
    updates, exact = _updates(3, 3), _exacts(3)
    updates[2] = [t * 100 for t in updates[2]]  # an outlier the rules must resist

    def make() -> Reducer:
        return Reducer(aggregator=rule, byzantine_f=1)

    ref = _unsharded(updates, exact, make)[0]
    got = _islands(sizes, updates, exact, make)
    assert ref is not None
    for j in range(3):
        for a, b in zip(_assembled(got, sizes, j), ref.tensors, strict=True):
            assert _bits_equal(a, b.view(a.shape))


def test_block_quantized_shards_aligned_with_the_blocks_have_the_unsharded_bits() -> None:
    """int8 with blocks of 4 over 2 islands (2 ranks and 1): a tensor whose every piece starts
    and ends on the full tensor's block grid (and is long enough to keep its blocks whole) gets
    the unsharded bits; a tensor cut inside a block is identical on every island and within the
    quantization error of the unsharded result. :func:`quantized_span_exact` tells which."""
    sizes, shapes = [2, 1], [(8, 8), (6, 5), (16,)]
    updates, exact = _updates(2, 4, shapes), _exacts(2)

    def make() -> Reducer:
        return Reducer(compression="int8:block=4")

    ref = _unsharded(updates, exact, make)[0]
    got = _islands(sizes, updates, exact, make, shapes=shapes)
    assert ref is not None
    fmt = make_format("int8", block=4)
    a0, a1 = _assembled(got, sizes, 0, shapes), _assembled(got, sizes, 1, shapes)
    aligned = []
    for k, s in enumerate(shapes):
        assert _bits_equal(a0[k], a1[k])  # every island lands the same bits
        spans = [shard_placement(s, 2, i) for i in range(2)]
        n = spans[0].numel_full
        if all(quantized_span_exact(p.start, p.stop, n, 2, fmt) for p in spans):
            aligned.append(s)
            assert _bits_equal(a0[k], ref.tensors[k].view(s)), s
        else:
            torch.testing.assert_close(a0[k], ref.tensors[k].view(s), rtol=0.05, atol=0.05)
    assert aligned == [(8, 8), (16,)]  # and (6, 5), cut at element 15, is not
