"""A fixed global batch, whoever is in the round: which samples a step uses and who takes which.

ElasWave ("ElasWave: An Elastic-Native System for Scalable Hybrid-Parallel Training", 2025)
keeps an elastic run's computation the same whatever the membership: the global batch size, the
gradient's scale and the random state stay put when peers come and go. These are the pure functions behind :class:`~isthmus.strategies.ddp.DDP`'s
``global_batch``:

* **Positions.** Step ``t`` consumes the global-stream positions ``[t B, (t + 1) B)``. A
  position depends on the step alone, never on a rank or on how many peers there are, so an
  aborted attempt retried by the survivors, a kill or a join leaves the samples of every step as
  they were.
* **Samples.** :class:`GlobalOrder` maps a position to a sample index through one seeded
  permutation per pass over the data (:class:`~isthmus.data.ledger.EpochOrder`): position ``p``
  is sample ``order(p // n)[p % n]``. Anything random about a sample (a dropout mask, an
  augmentation) should be drawn from :func:`sample_seed` of its position, so that the sample
  computes the same whichever peer takes it.
* **Shares.** The ``B`` positions of a step are split among the round's ``world`` members in
  contiguous shares, the first ``B % world`` one larger (:func:`share_positions`); a share
  larger than a peer's micro-batch is cut into micro-batches (:func:`micro_batches`) whose
  gradients are accumulated.
* **Islands.** On a peer made of several local ranks the peer's share is split again among
  its ranks, the same way (:func:`island_part`, as the elastic sampler's ``local_rank`` does).
  Every rank runs as many forward and backward passes as the rank with the most micro-batches
  (the island's own gradient averaging runs a collective in each), the others padding with
  passes that add nothing.
* **Weights.** Each peer reports the mean gradient over its share and counts as many times as
  its share has samples, so the weighted mean is the mean gradient over the ``B`` samples,
  whatever the split (the reducer's ``weight``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np
import xxhash

from isthmus.data.ledger import EpochOrder, share_bounds

__all__ = [
    "GlobalOrder",
    "island_part",
    "micro_batches",
    "sample_seed",
    "share_positions",
    "step_positions",
]


def _check(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def step_positions(step: int, global_batch: int) -> range:
    """The ``global_batch`` positions step ``step`` consumes. Raises ValueError for a negative
    step or a global batch below 1."""
    _check("step", step, 0)
    _check("global_batch", global_batch, 1)
    return range(step * global_batch, (step + 1) * global_batch)


def share_positions(step: int, global_batch: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of step ``step``'s positions among ``world`` members
    (empty when ``world > global_batch`` and this rank gets none). Raises ValueError unless
    ``0 <= rank < world``."""
    lo, hi = share_bounds(global_batch, rank, world)
    base = step_positions(step, global_batch).start
    return range(base + lo, base + hi)


def micro_batches(positions: range, micro_batch: int) -> list[range]:
    """``positions`` cut into consecutive pieces of at most ``micro_batch`` (0: one piece).
    Raises ValueError for a negative ``micro_batch``."""
    _check("micro_batch", micro_batch, 0)
    size = micro_batch or max(1, len(positions))
    return [positions[i : i + size] for i in range(0, len(positions), size)]


def island_part(
    share: range, micro_batch: int, local_rank: int, local_world: int
) -> tuple[list[range], int]:
    """Rank ``local_rank``'s part of an island's ``share`` (split among its ``local_world``
    ranks as :func:`share_positions` splits a step among peers) cut into micro-batches of at
    most ``micro_batch``, and how many passes every rank of the island runs: the micro-batches
    of the largest part (the first), so that a rank with fewer (or none) runs padding passes.
    An empty share gives no part and no pass. Raises ValueError unless
    ``0 <= local_rank < local_world``, or for a negative ``micro_batch``."""
    lo, hi = share_bounds(len(share), local_rank, local_world)
    first_lo, first_hi = share_bounds(len(share), 0, local_world)
    passes = len(micro_batches(range(first_hi - first_lo), micro_batch))
    return micro_batches(share[lo:hi], micro_batch), passes


def sample_seed(seed: int, position: int) -> int:
    """A 63-bit seed for whatever is random about the sample at ``position`` (its step is
    ``position // B``), the same on every peer: ``xxh64(seed, position)``."""
    return xxhash.xxh64_intdigest(struct.pack("<2Q", seed, position)) >> 1


class GlobalOrder:
    """Positions -> sample indices for a data set of ``num_samples``: a fresh seeded
    permutation per pass (see the module docstring). Raises ValueError for ``num_samples < 1``
    or a seed outside ``[0, 2^63)``."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples = num_samples
        self._order = EpochOrder(num_samples, seed)

    def __call__(self, positions: Iterable[int]) -> np.ndarray:
        """Sample indices (int64) of ``positions`` (ints >= 0), in their order."""
        p = np.fromiter(positions, dtype=np.int64)
        if p.size and p.min() < 0:
            raise ValueError("positions must be >= 0")
        out = np.empty_like(p)
        passes = p // self.num_samples
        for e in np.unique(passes):
            at = passes == e
            out[at] = self._order(int(e), p[at] % self.num_samples)
        return out
