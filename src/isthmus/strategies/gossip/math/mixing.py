"""Mixing weights for gossip averaging: Metropolis-Hastings weights and their checks.

For an undirected graph, the Metropolis-Hastings weights (Xiao and Boyd, "Fast linear iterations
for distributed averaging", Systems & Control Letters 2004; Boyd, Diaconis and Xiao, "Fastest
mixing Markov chain on a graph", SIAM Review 2004) are

    W_ij = 1 / (1 + max(deg_i, deg_j))   for every edge {i, j}
    W_ii = 1 - sum_j W_ij

They need only the degrees of a rank and its neighbours, are symmetric and doubly stochastic by
construction, and give linear convergence to the exact average on any connected graph. The speed
is set by the spectral gap ``1 - max(|lambda_2|, |lambda_n|)`` of ``W``.

Every peer computes its own row with :func:`metropolis_row`; the order of the entries (sorted
neighbours) and the arithmetic are fixed so that the pure reference and the distributed exchange
produce the same bits.
"""

from __future__ import annotations

import numpy as np

from isthmus.strategies.gossip.math.topology import Topology

__all__ = [
    "check_mixing_matrix",
    "is_doubly_stochastic",
    "is_symmetric",
    "metropolis_matrix",
    "metropolis_row",
    "second_largest_eigenvalue",
    "spectral_gap",
]


def metropolis_row(top: Topology, i: int) -> tuple[float, dict[int, float]]:
    """``(W_ii, {j: W_ij})`` for rank ``i``, neighbours in increasing order.

    ``W_ii`` is ``1 - sum`` of the neighbour weights added in that order, so it is the same float
    on every peer. Raises ``IndexError`` if ``i`` is not a rank of ``top``.
    """
    if not 0 <= i < top.n:
        raise IndexError(f"rank {i} is outside 0..{top.n - 1}")
    di = top.degree(i)
    weights = {j: 1.0 / (1 + max(di, top.degree(j))) for j in top.neighbors(i)}
    total = 0.0
    for j in top.neighbors(i):
        total += weights[j]
    return 1.0 - total, weights


def metropolis_matrix(top: Topology) -> np.ndarray:
    """The ``n x n`` Metropolis-Hastings mixing matrix (float64)."""
    w = np.zeros((top.n, top.n), dtype=np.float64)
    for i in range(top.n):
        self_w, row = metropolis_row(top, i)
        w[i, i] = self_w
        for j, x in row.items():
            w[i, j] = x
    return w


def is_symmetric(w: np.ndarray, atol: float = 1e-12) -> bool:
    return bool(w.ndim == 2 and w.shape[0] == w.shape[1] and np.allclose(w, w.T, rtol=0, atol=atol))


def is_doubly_stochastic(w: np.ndarray, atol: float = 1e-12) -> bool:
    """Non-negative, every row and every column summing to 1 (within ``atol``)."""
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        return False
    return bool(
        (w >= -atol).all()
        and np.allclose(w.sum(axis=0), 1.0, rtol=0, atol=atol)
        and np.allclose(w.sum(axis=1), 1.0, rtol=0, atol=atol)
    )


def second_largest_eigenvalue(w: np.ndarray) -> float:
    """``max(|lambda_2|, |lambda_n|)`` of a symmetric mixing matrix: the factor by which one
    gossip step shrinks the distance to consensus in the worst case. ``0.0`` for ``n == 1``.

    Raises ``ValueError`` for a non-symmetric matrix (its eigenvalues may be complex; symmetrize
    first) or one with non-finite entries.
    """
    if not np.isfinite(w).all():
        raise ValueError("mixing matrix has NaN or Inf entries")
    if not is_symmetric(w, atol=1e-10):
        raise ValueError("second_largest_eigenvalue needs a symmetric mixing matrix")
    if w.shape[0] <= 1:
        return 0.0
    mags = np.sort(np.abs(np.linalg.eigvalsh(w)))
    # the largest magnitude is the consensus eigenvalue 1; the next one bounds convergence
    return float(mags[-2])


def spectral_gap(w: np.ndarray) -> float:
    """``1 - max(|lambda_2|, |lambda_n|)``: 0 for a disconnected graph, 1 for exact averaging
    in one step (the complete graph with uniform weights)."""
    return 1.0 - second_largest_eigenvalue(w)


def check_mixing_matrix(w: np.ndarray, atol: float = 1e-12) -> None:
    """Raise ``ValueError`` saying which property fails unless ``w`` is square, finite, symmetric
    and doubly stochastic."""
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("mixing matrix has NaN or Inf entries")
    if not is_symmetric(w, atol):
        bad = np.argwhere(~np.isclose(w, w.T, rtol=0, atol=atol))[0]
        raise ValueError(
            f"mixing matrix is not symmetric: W[{bad[0]},{bad[1]}] != W[{bad[1]},{bad[0]}]"
        )
    if not is_doubly_stochastic(w, atol):
        raise ValueError(
            "mixing matrix is not doubly stochastic (negative entries or rows/columns not summing "
            f"to 1): row sums {np.round(w.sum(axis=1), 6).tolist()}"
        )
