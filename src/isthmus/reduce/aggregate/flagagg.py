"""Flag Aggregator.

Almasi, Mishra, Vamanan, Ravi, "Flag Aggregator: Scalable Distributed Training under Failures
and Augmented Losses using Convex Optimization", arXiv, February 2023; the authors' code is at
github.com/hamidralmasi/FlagAggregator.

Each input is normalised to a unit vector ``u_i = x_i / ||x_i||`` (a zero vector stays zero). The
aggregator looks for an ``r``-dimensional subspace ``Y`` that explains the inputs in the
"flag median" sense, minimising ``sum_i sqrt(1 - ||Y^T u_i||^2)`` (the sines of the angles
between inputs and subspace), by iteratively reweighted least squares: with weights
``w_i = (|1 - ||Y^T u_i||^2| + eps)^(-1/4)``, ``Y`` becomes the top-``r`` left singular vectors of
``[w_1 u_1, ..., w_n u_n]``. With ``lam > 0`` the matrix also gets the pairwise columns
``w_ij (u_i - u_j)`` for ordered pairs ``i != j``, weighted like the inputs and scaled by
``lam / (n (n - 1))`` (the paper's regulariser). The output is ``Y Y^T sum_i u_i / r``.

Departures from the authors' script, on purpose: the first subspace is the unweighted flag mean
(all weights 1) rather than a random one, so that every peer and the reference start from the
same point and the iterate stays in the span of the inputs; iteration stops after ``max_iter``
(default 4, as in their script) or as soon as the objective stops improving, keeping the better
subspace.

Note the scale: the output is built from *unit* vectors, so its norm is at most ``n / r``
whatever the inputs' norms; scale the learning rate accordingly. The paper does not state a
bound on ``f``; only ``n >= r`` is required.

Everything above depends on the inputs only through the cosine matrix ``C = D^-1 G D^-1``
(``G`` the Gram matrix, ``D`` the diagonal of norms): with ``H = diag(w^2) + 2 Laplacian(w_ij^2)``
and ``L = H^(1/2)``, ``Y = U L V S^-1`` where ``L C L = V S^2 V^T``. The sharded engine therefore
runs all IRLS iterations on the ``n x n`` Gram matrix and finishes with one linear combination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from isthmus.reduce.aggregate.aggregator import (
    GramRule,
    RuleInfo,
    gram_sq_dists,
    make_stage,
    require_positive_float,
    require_positive_int,
    run_reference,
)

__all__ = ["FLAG", "FlagOptions", "flag"]

T = TypeVar("T")

# Eigen-directions whose eigenvalue is below this fraction of the largest carry no data; they
# are dropped rather than divided by (the vector-space reference picks arbitrary directions
# orthogonal to all inputs there, which project every input to zero: same result).
_RANK_TOL = 1e-12
# The authors stop once the objective improves by less than this (absolute; it is a sum of sines).
_IMPROVE_TOL = 1e-10


@dataclass(frozen=True, kw_only=True)
class FlagOptions:
    """Options of the Flag Aggregator."""

    r: int = 1
    """Dimension of the subspace (1 in the paper's default, 8 in some of its scripts)."""
    lam: float = 0.0
    """Weight of the pairwise regulariser (``lambda`` in the paper); 0 disables it."""
    max_iter: int = 4
    """Upper bound on IRLS iterations after the initial flag mean."""
    eps: float = 1e-7
    """Keeps the IRLS weights finite for inputs lying in the subspace."""

    def __post_init__(self) -> None:
        require_positive_int("r", self.r, "flag")
        object.__setattr__(
            self, "lam", require_positive_float("lam", self.lam, "flag", allow_zero=True)
        )
        require_positive_int("max_iter", self.max_iter, "flag")
        object.__setattr__(self, "eps", require_positive_float("eps", self.eps, "flag"))


def _pair_scale(n: int, cfg: FlagOptions) -> float:
    return cfg.lam / (n * (n - 1)) if n > 1 else 0.0


def _weights_from(proj_sq: torch.Tensor, eps: float) -> torch.Tensor:
    return ((1.0 - proj_sq).abs() + eps) ** -0.25


def _objective(proj_sq: torch.Tensor) -> float:
    return float((1.0 - proj_sq).clamp_min(0.0).sqrt().sum())


def _irls(
    subspace_of: Callable[[torch.Tensor, torch.Tensor | None], T],
    proj_of: Callable[[T], tuple[torch.Tensor, torch.Tensor]],
    n: int,
    cfg: FlagOptions,
    device: torch.device,
) -> tuple[T, int]:
    """Shared IRLS loop. ``subspace_of(w, wp)`` builds a subspace from input and pair weights;
    ``proj_of(Y)`` returns (per-input squared projections, pairwise squared projections)."""
    scale = _pair_scale(n, cfg)
    use_pairs = cfg.lam > 0 and n > 1
    w = torch.ones(n, dtype=torch.float64, device=device)
    wp = torch.full((n, n), scale, dtype=torch.float64, device=device) if use_pairs else None
    Y = subspace_of(w, wp)
    ps, pp = proj_of(Y)
    obj = _objective(ps)
    it = 0
    while it < cfg.max_iter and obj > _IMPROVE_TOL:
        w = _weights_from(ps, cfg.eps)
        if use_pairs:
            wp = _weights_from(pp, cfg.eps) * scale
        Y_new = subspace_of(w, wp)
        ps_new, pp_new = proj_of(Y_new)
        obj_new = _objective(ps_new)
        if obj_new > obj:
            break  # the authors keep the previous subspace when a step makes things worse
        improvement = obj - obj_new
        Y, ps, pp, obj = Y_new, ps_new, pp_new, obj_new
        it += 1
        if improvement <= _IMPROVE_TOL:
            break
    return Y, it


def _unit_rows(X64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norms = torch.linalg.vector_norm(X64, dim=1)
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(1e-300), torch.zeros_like(norms))
    return X64 * inv[:, None], inv


def _reference(
    X: torch.Tensor, f: int, cfg: FlagOptions, start: torch.Tensor | None
) -> tuple[torch.Tensor, RuleInfo]:
    n = X.shape[0]
    U, _ = _unit_rows(X.to(torch.float64))  # n x d, one unit vector per row
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]

    def subspace_of(w: torch.Tensor, wp: torch.Tensor | None) -> torch.Tensor:
        cols = [U * w[:, None]]
        if wp is not None:
            cols.append(torch.stack([(U[i] - U[j]) * wp[i, j] for i, j in pairs]))
        M = torch.cat(cols).T  # d x K
        left = torch.linalg.svd(M, full_matrices=False).U
        return left[:, : min(cfg.r, left.shape[1])]

    def proj_of(Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        P = U @ Y  # n x r: coordinates of each unit input in the subspace
        return (P * P).sum(dim=1), gram_sq_dists(P @ P.T)

    Y, it = _irls(subspace_of, proj_of, n, cfg, X.device)
    out = Y @ (Y.T @ U.sum(dim=0)) / cfg.r
    return out.to(X.dtype), RuleInfo(iterations=it)


def _weights(
    G: torch.Tensor, f: int, cfg: FlagOptions, has_start: bool
) -> tuple[torch.Tensor, RuleInfo]:
    n = G.shape[0]
    norms = torch.diagonal(G).clamp_min(0.0).sqrt()
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(1e-300), torch.zeros_like(norms))
    C = inv[:, None] * G * inv[None, :]  # inner products of the unit inputs

    def subspace_of(w: torch.Tensor, wp: torch.Tensor | None) -> torch.Tensor:
        # H = B B^T for the column-coefficient matrix B of [w_i u_i, wp_ij (u_i - u_j)]
        H = torch.diag(w * w)
        if wp is not None:
            Q = wp * wp
            Q.fill_diagonal_(0.0)
            H = H + 2.0 * (torch.diag(Q.sum(dim=1)) - Q)
        lam_h, vec_h = torch.linalg.eigh(H)
        L = (vec_h * lam_h.clamp_min(0.0).sqrt()) @ vec_h.T
        s2, V = torch.linalg.eigh(L @ C @ L)
        order = torch.argsort(s2, descending=True)[: cfg.r]
        s2, V = s2[order], V[:, order]
        keep = s2 > _RANK_TOL * max(float(s2[0]), 0.0) if s2.numel() else s2 > 0
        inv_s = torch.where(keep, 1.0 / s2.clamp_min(1e-300).sqrt(), torch.zeros_like(s2))
        return (L @ V) * inv_s[None, :]  # A: Y = [u_1 ... u_n] A

    def proj_of(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        P = (A.T @ C).T  # n x r, row j = Y^T u_j
        return (P * P).sum(dim=1), gram_sq_dists(P @ P.T)

    A, it = _irls(subspace_of, proj_of, n, cfg, G.device)
    P = (A.T @ C).T
    coeff_unit = A @ P.sum(dim=0) / cfg.r  # Y Y^T sum_j u_j, on the unit inputs
    return coeff_unit * inv, RuleInfo(iterations=it)


FLAG = GramRule(
    name="flag",
    config=FlagOptions,
    min_n=lambda f, cfg: max(1, cfg.r),
    requirement="n >= r",
    reference=_reference,
    weights=_weights,
)


def flag(
    vectors: Sequence[torch.Tensor],
    f: int,
    *,
    r: int = 1,
    lam: float = 0.0,
    max_iter: int = 4,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Flag Aggregator (see the module docstring; ``f`` is only checked, the rule does not use it).

    Non-finite vectors are excluded first. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` if fewer than ``r`` vectors remain;
    ``ValueError`` for invalid options.
    """
    stage = make_stage(FLAG, {"r": r, "lam": lam, "max_iter": max_iter, "eps": eps})
    return run_reference([stage], vectors, f).vector
