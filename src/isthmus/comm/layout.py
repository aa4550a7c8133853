"""The island-independent layout of the shared state: pure math, no network.

An *island* is a peer made of N local ranks; each rank holds a *shard* of every sharded tensor
(FSDP2's ``Shard(0)``: the rows ``[i c, (i + 1) c)`` of a tensor of R rows, ``c = ceil(R / N)``,
clipped to R) and a whole copy of the replicated ones (buffers, counters). Islands of different
sizes shard the same tensor differently, so nothing that crosses islands may depend on N. This
module describes every rank's holding as flat element ranges of the *full* state, which does not:

* :class:`Placement`: which flat elements ``[start, stop)`` of a tensor of ``full_shape`` a rank
  holds (None in the APIs below means the whole tensor, replicated).
* :class:`StateLayout`: the full state as one flat index space (every tensor's elements, in
  schema order, at a fixed offset) cut into fixed *spans* of ``span`` elements; a rank's holding
  as ``(start, stop)`` intervals of that space (:meth:`StateLayout.intervals`).
* :func:`owner_pieces`: for islands of any sizes, the pieces of the flat space on which the owner
  of every island is one rank, each with that tuple of owners. The ranks that own a piece
  exchange it with each other; with equal island sizes that is local rank ``i`` of every island
  (the HSDP pattern), with unequal sizes a rank of a small island meets several ranks of a
  larger one, each on its own part.
* :func:`layout_hash`: a hash of a tensor that does not depend on how it is sharded. Every rank
  hashes its own elements and the island sums the partial hashes (mod 2**64): islands of
  different sizes, or a plain peer holding the whole tensor, get the same value for the same
  bytes without moving any of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

__all__ = [
    "Placement",
    "StateLayout",
    "hash_hex",
    "layout_hash",
    "merge",
    "owner_pieces",
    "piece_groups",
    "row_chunk",
    "shard_placement",
    "tensor_pieces",
]

Interval = tuple[int, int]


def row_chunk(rows: int, size: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that rank ``index`` of ``size`` holds of a dimension of
    ``rows`` under ``Shard(0)`` (torch.chunk's rule, which FSDP2 uses: chunks of
    ``ceil(rows / size)``, the last ones short or empty). Raises ValueError for a bad index."""
    if size < 1 or not 0 <= index < size:
        raise ValueError(f"rank {index} of {size}: not a rank")
    chunk = -(-rows // size) if rows else 0
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True)
class Placement:
    """The flat elements ``[start, stop)`` of a tensor of ``full_shape`` that one rank holds."""

    full_shape: tuple[int, ...]
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.numel_full:
            raise ValueError(
                f"placement [{self.start}, {self.stop}) outside a tensor of {self.numel_full}"
            )

    @property
    def numel_full(self) -> int:
        return math.prod(self.full_shape)

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_placement(full_shape: Sequence[int], size: int, index: int) -> Placement:
    """The :class:`Placement` of rank ``index`` of ``size`` under ``Shard(0)``."""
    shape = tuple(int(d) for d in full_shape)
    if not shape:  # a scalar cannot be split: rank 0 holds it
        return Placement(shape, 0, 1 if index == 0 else 0)
    row = math.prod(shape[1:])
    r0, r1 = row_chunk(shape[0], size, index)
    return Placement(shape, r0 * row, r1 * row)


class StateLayout:
    """The full shared state as one flat index space, cut into fixed spans.

    ``tensors`` is the schema: ``(name, full numel)`` in registration order. Tensor ``k`` takes
    the flat elements ``[offset_k, offset_k + numel_k)``. ``span`` (elements, >= 1) is the size of
    the fixed spans the space is cut into (the last one short); spans never depend on how an
    island is sharded. Raises ValueError for a repeated name or a bad span.
    """

    def __init__(self, tensors: Sequence[tuple[str, int]], *, span: int = 1 << 20) -> None:
        if span < 1:
            raise ValueError(f"span must be >= 1 element, got {span}")
        self.span = span
        self.offsets: dict[str, int] = {}
        self.numels: dict[str, int] = {}
        off = 0
        for name, n in tensors:
            if name in self.offsets:
                raise ValueError(f"tensor {name!r} appears twice in the layout")
            if n < 0:
                raise ValueError(f"tensor {name!r} has a negative size {n}")
            self.offsets[name] = off
            self.numels[name] = n
            off += n
        self.total = off

    def spans(self) -> list[Interval]:
        """The fixed spans ``[start, stop)`` of the flat space."""
        return [(s, min(s + self.span, self.total)) for s in range(0, self.total, self.span)]

    def intervals(self, holding: dict[str, Placement | None]) -> list[Interval]:
        """The flat intervals a rank holds, sorted and merged: ``holding`` maps every tensor of
        the layout to its :class:`Placement` (None: the whole tensor). Raises KeyError naming a
        tensor missing from ``holding`` and ValueError for a placement of another size."""
        out: list[Interval] = []
        for name, off in self.offsets.items():
            if name not in holding:
                raise KeyError(f"no placement for tensor {name!r}")
            p = holding[name]
            n = self.numels[name]
            if p is None:
                lo, hi = 0, n
            else:
                if p.numel_full != n:
                    raise ValueError(
                        f"placement of {name!r} covers {p.numel_full} elements, not {n}"
                    )
                lo, hi = p.start, p.stop
            if hi > lo:
                out.append((off + lo, off + hi))
        return merge(out)

    def span_owners(self, ranks: Sequence[Sequence[Interval]]) -> list[tuple[int, ...]]:
        """For every span, the ranks (of one island: ``ranks[i]`` is rank i's intervals) that
        hold any element of it."""
        owners = []
        for s0, s1 in self.spans():
            owners.append(
                tuple(i for i, ivs in enumerate(ranks) if any(a < s1 and b > s0 for a, b in ivs))
            )
        return owners


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted, with touching and overlapping intervals joined; empty ones dropped."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def owner_pieces(
    islands: Sequence[Sequence[Sequence[Interval]]], total: int
) -> list[tuple[Interval, tuple[int, ...]]]:
    """Cut the flat space ``[0, total)`` into pieces with one owner per island.

    ``islands[j][i]`` is the intervals that rank ``i`` of island ``j`` holds (a sharded state:
    the ranks of one island hold disjoint intervals that together cover the space). Returns
    ``((start, stop), owners)`` in order, ``owners[j]`` the rank of island ``j`` that holds the
    whole piece; neighbouring pieces with the same owners are joined. Raises ValueError when an
    element is held by no rank or by two ranks of one island."""
    cuts = {0, total}
    for ranks in islands:
        for ivs in ranks:
            for a, b in ivs:
                cuts.update((a, b))
    points = sorted(c for c in cuts if 0 <= c <= total)
    out: list[tuple[Interval, tuple[int, ...]]] = []
    for a, b in itertools.pairwise(points):
        owners = []
        for j, ranks in enumerate(islands):
            held = [i for i, ivs in enumerate(ranks) if any(x <= a and b <= y for x, y in ivs)]
            if len(held) != 1:
                what = "no rank" if not held else f"ranks {held}"
                raise ValueError(f"elements [{a}, {b}) are held by {what} of island {j}")
            owners.append(held[0])
        key = tuple(owners)
        if out and out[-1][1] == key and out[-1][0][1] == a:
            out[-1] = ((out[-1][0][0], b), key)
        else:
            out.append(((a, b), key))
    return out


def tensor_pieces(
    full_shape: Sequence[int], sizes: Sequence[int]
) -> list[tuple[Interval, tuple[int, ...]]]:
    """The pieces of one tensor's flat elements for islands of ``sizes`` ranks each sharding it
    with ``Shard(0)``: ``((start, stop), owners)`` as :func:`owner_pieces` gives them."""
    shape = tuple(int(d) for d in full_shape)
    islands = [
        [[(p.start, p.stop)] for p in (shard_placement(shape, n, i) for i in range(n))]
        for n in sizes
    ]
    total = math.prod(shape)
    return owner_pieces(islands, total) if total else []


def piece_groups(shapes: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every tuple of owners (rank of island 0, rank of island 1, ...) that holds some piece of
    the tensors of ``shapes``, sorted: one cross-island group each. Rank 0 of every island
    always meets in ``(0, ..., 0)`` (the groups' shared first member set). With equal sizes
    these are ``(i, ..., i)``."""
    out = {tuple(0 for _ in sizes)}
    for shape in shapes:
        out.update(owners for _, owners in tensor_pieces(shape, sizes))
    return sorted(out)


# -- the layout-independent hash -----------------------------------------------------------------
_MIX1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64
_BLOCK = 1 << 20


def _units(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t``'s bytes as int64 values of one unit each (2 bytes, 1 for 1-byte dtypes), and the
    units per element."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8).to(torch.int64), 1
    return flat.view(torch.int16).to(torch.int64) & 0xFFFF, size // 2


def layout_hash(local: torch.Tensor, placement: Placement | None = None) -> int:
    """This rank's share of the layout-independent hash of a tensor (an int64 in two's
    complement); the hash of the whole tensor is the sum of the shares of the ranks that hold
    it, mod 2**64. ``placement`` says which flat elements ``local`` holds (None: all of them).

    The hash is ``sum_j w(j) * u_j`` over the tensor's 2-byte units ``u_j`` (bytes for 1-byte
    dtypes), ``w`` a mixing function of the unit's position in the full tensor: equal bytes give
    equal hashes however the tensor is split, and a changed unit changes the sum unless its
    weight times the change is 0 mod 2**64 (weights are odd, so that needs a change of 2**64).
    It detects corruption and divergence; it is no defence against a forged collision."""
    units, per = _units(local)
    first = 0 if placement is None else placement.start * per
    total = torch.zeros((), dtype=torch.int64)
    for lo in range(0, units.numel(), _BLOCK):
        chunk = units[lo : lo + _BLOCK]
        j = torch.arange(first + lo, first + lo + chunk.numel(), dtype=torch.int64)
        w = j * _MIX1 + _MIX2  # int64 arithmetic wraps mod 2**64
        w = w ^ (w >> 31)
        w = w * _MIX2
        w = w | 1
        total += (w * chunk).sum()
    return int(total)


def hash_hex(total: int, shape: Sequence[int], dtype: str) -> str:
    """The hex text of a summed :func:`layout_hash` (with its tensor's shape and dtype, so that
    two tensors of the same bytes and another shape differ)."""
    h = xxhash.xxh3_64()
    h.update((total & ((1 << 64) - 1)).to_bytes(8, "little"))
    h.update(repr((tuple(shape), dtype)).encode())
    return h.hexdigest()
