"""The elastic sampler's bookkeeping as plain functions: orders, ranges, blocks, shares, commits.

Nothing here touches a tensor, a session or a file; :class:`~isthmus.data.sampler.ElasticSampler`
stores a :class:`Position` in shared tensors and calls these functions. Tests drive them with
made-up round plans.

**Positions.** Every epoch has its own order of the ``n`` sample indices (:class:`EpochOrder`).
The orders of epochs ``e, e + 1, ...`` are laid end to end into one stream, and a *position* is
an offset into that stream counted from the start of epoch ``Position.epoch``: position ``p``
is index ``order(epoch + p // n)[p % n]``. Counting from the current epoch keeps the stored
numbers small; :func:`commit` re-bases them when an epoch is finished.

**What is still owed.** A :class:`Position` describes the set of positions not yet used by a
committed round: the ledger ranges (handed out earlier, not used, so owed again) plus everything
from the cursor on. Ledger ranges lie below the cursor, sorted, disjoint and never adjacent, so
"ledger first, then the cursor" is simply ascending order over that set.

**Blocks.** Global batch ``t`` since the last commit is block ``t``: the next ``batch_size``
positions of that ascending sequence, except that a block never crosses into another epoch's
positions (it ends short instead). A block may thus come from epoch ``e + 1`` while a range of
epoch ``e`` is still in the ledger (the cursor ran past the end of the order in the middle of an
interval); the epoch advances at a commit once nothing of it is owed any more.

**Shares.** A block of ``b`` positions is split by rank into ``world`` contiguous shares, the
first ``b % world`` ranks one larger (as :func:`numpy.array_split` does).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "EpochOrder",
    "Position",
    "Range",
    "commit",
    "draw",
    "merge",
    "share",
    "share_bounds",
    "subtract",
    "take",
]

Range = tuple[int, int]
"""``(start, length)`` of a run of consecutive positions; ``length >= 1``."""

# Stands in for "no end" in the last segment (the cursor's): larger than any real position,
# small enough that arithmetic on it stays inside int64.
_OPEN = 1 << 62
_U64 = np.uint64
# The splitmix64 finalizer's constants (Steele, Lea, Flood 2014): a cheap, well-mixing bijection
# on 64-bit words, used as the Feistel round function.
_M1 = np.array([0xBF58476D1CE4E5B9], dtype=_U64)
_M2 = np.array([0x94D049BB133111EB], dtype=_U64)
_ROUNDS = 6


class EpochOrder:
    """A seeded permutation of ``range(n)`` per epoch, evaluated at any positions on demand.

    ``order(epoch, positions)`` maps positions (ints in ``[0, n)``) to sample indices. The
    permutation is a keyed Feistel network on the smallest even-bit-width domain holding ``n``,
    with cycle walking for values ``>= n`` (Black & Rogaway, "Ciphers with Arbitrary Finite
    Domains", 2002). Why not ``torch.randperm``: this needs O(1) memory and no O(n) set-up per
    epoch (a billion-window dataset would otherwise build a 8 GB table on every peer), reads any
    position directly, and is defined here, so its output cannot change with a torch or numpy
    release while peers of one run or a resumed checkpoint rely on it. Keys come from
    ``xxh64(seed, epoch, round)``; no global RNG is read or advanced.
    """

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"an order needs at least one sample, got n={n}")
        if not 0 <= seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2^63), got {seed}")
        self.n = n
        self.seed = seed
        self._half = max(1, math.ceil((n - 1).bit_length() / 2))
        self._mask = _U64((1 << self._half) - 1)
        self._keys: dict[int, list[np.ndarray[Any, np.dtype[np.uint64]]]] = {}

    def _round_keys(self, epoch: int) -> list[np.ndarray[Any, np.dtype[np.uint64]]]:
        keys = self._keys.get(epoch)
        if keys is None:
            keys = [
                np.array([xxhash.xxh64_intdigest(struct.pack("<3Q", self.seed, epoch, r))], _U64)
                for r in range(_ROUNDS)
            ]
            if len(self._keys) > 8:
                self._keys.clear()
            self._keys[epoch] = keys
        return keys

    def _feistel(
        self, x: np.ndarray[Any, np.dtype[np.uint64]], keys: list[np.ndarray[Any, Any]]
    ) -> np.ndarray[Any, np.dtype[np.uint64]]:
        h = _U64(self._half)
        left, right = x >> h, x & self._mask
        for k in keys:
            z = right ^ k
            z = (z ^ (z >> _U64(30))) * _M1
            z = (z ^ (z >> _U64(27))) * _M2
            z = z ^ (z >> _U64(31))
            left, right = right, left ^ (z & self._mask)
        return (left << h) | right

    def __call__(self, epoch: int, positions: Iterable[int] | np.ndarray[Any, Any]) -> np.ndarray:
        """Sample indices (int64) at ``positions`` of epoch ``epoch``'s order.

        Raises ValueError for a position outside ``[0, n)`` or a negative epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        p = np.asarray(list(positions) if not isinstance(positions, np.ndarray) else positions)
        p = p.astype(np.int64, copy=False).reshape(-1)
        if p.size and (p.min() < 0 or p.max() >= self.n):
            raise ValueError(f"positions must be in [0, {self.n})")
        keys = self._round_keys(epoch)
        y = self._feistel(p.astype(_U64), keys)
        # Cycle walking: a value outside [0, n) is encrypted again until it lands inside. The
        # domain is under 4n, so this takes fewer than 4 passes on average, and it terminates
        # because the cycle through a start value < n returns to it.
        out = y >= _U64(self.n)
        while out.any():
            y[out] = self._feistel(y[out], keys)
            out = y >= _U64(self.n)
        return y.astype(np.int64)


@dataclass(frozen=True)
class Position:
    """The shared position of an elastic sampler, as plain ints.

    ``epoch``: the oldest epoch with positions still owed. ``cursor``: first position never
    handed out. ``ledger``: ranges handed out but not used by a committed round, sorted,
    disjoint, non-adjacent, all below ``cursor``. ``assigners``: the members of the last
    committed round (the membership under which the batches since then are split); empty before
    the first commit.
    """

    epoch: int = 0
    cursor: int = 0
    ledger: tuple[Range, ...] = ()
    assigners: tuple[int, ...] = ()


def merge(ranges: Iterable[Range]) -> list[Range]:
    """Sort ranges and merge overlapping or adjacent ones; empty ranges are dropped."""
    out: list[list[int]] = []
    for s, n in sorted(r for r in ranges if r[1] > 0):
        if out and s <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], s + n - out[-1][0])
        else:
            out.append([s, n])
    return [(s, n) for s, n in out]


def subtract(ranges: Iterable[Range], remove: Iterable[Range]) -> list[Range]:
    """The positions of ``ranges`` not in ``remove``, as merged ranges."""
    rem = merge(remove)
    out: list[Range] = []
    j = 0
    for s, n in merge(ranges):
        a, end = s, s + n
        while j < len(rem) and rem[j][0] + rem[j][1] <= a:
            j += 1
        k = j
        while a < end and k < len(rem) and rem[k][0] < end:
            rs, re_ = rem[k][0], rem[k][0] + rem[k][1]
            if rs > a:
                out.append((a, rs - a))
            a = max(a, re_)
            k += 1
        if a < end:
            out.append((a, end - a))
    return out


def draw(
    ledger: Sequence[Range], cursor: int, n: int, batch_size: int, count: int
) -> list[tuple[Range, ...]]:
    """The first ``count`` blocks owed by a position (see the module docstring).

    Each block is a tuple of ranges in draw order, at most ``batch_size`` positions, all of one
    epoch (a block that reaches an epoch's end stops short). Costs O(count + ranges read).
    """
    if n < 1 or batch_size < 1 or count < 0:
        raise ValueError(
            f"need n >= 1, batch_size >= 1, count >= 0; got {n}, {batch_size}, {count}"
        )
    segs = [(s, s + length) for s, length in ledger]
    segs.append((cursor, _OPEN))
    i, p = 0, segs[0][0]
    blocks: list[tuple[Range, ...]] = []
    for _ in range(count):
        while p >= segs[i][1]:
            i += 1
            p = segs[i][0]
        boundary = (p // n + 1) * n
        parts: list[Range] = []
        need = batch_size
        while need:
            if p >= segs[i][1]:
                i += 1
                p = segs[i][0]
                if p >= boundary:
                    break
            got = min(need, segs[i][1] - p, boundary - p)
            parts.append((p, got))
            p += got
            need -= got
            if p >= boundary:
                break
        blocks.append(tuple(parts))
    return blocks


def share_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[lo, hi)`` offsets of ``rank``'s share of a block of ``size``: contiguous, the first
    ``size % world`` ranks one larger. Raises ValueError unless ``0 <= rank < world``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    q, r = divmod(size, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


def take(ranges: Sequence[Range], lo: int, hi: int) -> tuple[Range, ...]:
    """Offsets ``[lo, hi)`` of the positions listed by ``ranges`` (in their order), as ranges."""
    out: list[Range] = []
    off = 0
    for s, length in ranges:
        a, b = max(lo, off), min(hi, off + length)
        if a < b:
            out.append((s + a - off, b - a))
        off += length
        if off >= hi:
            break
    return tuple(out)


def share(block: Sequence[Range], rank: int, world: int) -> tuple[Range, ...]:
    """``rank``'s share (ranges of positions) of ``block`` split ``world`` ways."""
    lo, hi = share_bounds(sum(length for _, length in block), rank, world)
    return take(block, lo, hi)


def commit(
    pos: Position,
    *,
    n: int,
    batch_size: int,
    drawn: int,
    members: Sequence[int],
    resynced: Collection[int],
) -> tuple[Position, list[Range]]:
    """Apply one committed round to the position; return the new one and the ranges used.

    ``drawn`` blocks were handed out since the last commit, split among ``pos.assigners``.
    The *contributors* are the assigners that are members of the committed round and were not
    resynced in it: their shares are used. Every other drawn position (shares of peers that
    died, left or were repaired; everything when there were no assigners yet) stays owed: it
    goes back to the ledger, or back under the cursor when it is the tail of what was drawn.
    Then ``assigners`` becomes ``members``, and when nothing of the oldest epoch is owed any
    more the positions are re-based onto the next epoch that is.

    The returned used ranges are positions relative to ``pos.epoch`` (not the new base). This
    is a pure function: the same inputs give the same result on every peer.
    """
    blocks = draw(pos.ledger, pos.cursor, n, batch_size, drawn)
    world = len(pos.assigners)
    keep = set(members)
    ranks = [r for r, p in enumerate(pos.assigners) if p in keep and p not in resynced]
    used = merge(rg for b in blocks for r in ranks for rg in share(b, r, world))
    end = max((s + length for b in blocks for s, length in b), default=pos.cursor)
    cursor = max(pos.cursor, end)
    owed = subtract([*pos.ledger, (pos.cursor, cursor - pos.cursor)], used)
    if owed and owed[-1][0] + owed[-1][1] == cursor:
        # Owed positions that end at the cursor were simply not used yet: moving the cursor
        # back over them keeps the ledger small and hands them out in the same order.
        cursor = owed.pop()[0]
    low = owed[0][0] if owed else cursor
    shift = (low // n) * n
    new = Position(
        epoch=pos.epoch + low // n,
        cursor=cursor - shift,
        ledger=tuple((s - shift, length) for s, length in owed),
        assigners=tuple(members),
    )
    return new, used
