"""Geometric median by the smoothed Weiszfeld algorithm.

Pillutla, Kakade, Harchaoui, "Robust Aggregation for Federated Learning", IEEE Transactions on
Signal Processing 2022 (arXiv 1912.13445); Weiszfeld, Tohoku Mathematical Journal 1937.

The geometric median ``argmin_v sum_i ||v - x_i||`` has breakdown point 1/2: fewer than half of
the vectors cannot drag it arbitrarily far, so ``n > 2f`` is required. Weiszfeld's iteration
``v <- sum_i beta_i x_i / sum_i beta_i`` with ``beta_i = 1 / max(nu, ||v - x_i||)`` starts from the
mean; the smoothing ``nu`` keeps a weight finite when ``v`` lands on an input. It stops after
``max_iter`` iterations, or earlier once an iteration moves ``v`` by less than ``tol`` times the
median distance from ``v`` to the inputs. (A test on the relative change of the objective, as in
some implementations, stops far too early when one huge outlier dominates the objective.)

Every iterate is a convex combination of the inputs, so its distance to each input follows from
the Gram matrix and the combination weights: ``||x_i - v||^2 = G_ii - 2 (G a)_i + a^T G a``. The
sharded engine therefore runs all iterations on the ``n x n`` matrix with no further
communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.reduce.aggregate.aggregator import (
    GramRule,
    RuleInfo,
    make_stage,
    median_of_rows,
    require_positive_float,
    require_positive_int,
    run_reference,
    sq_dists_to_combination,
)

__all__ = ["GEOMETRIC_MEDIAN", "GeometricMedianOptions", "geometric_median"]


@dataclass(frozen=True, kw_only=True)
class GeometricMedianOptions:
    """Options of the smoothed Weiszfeld algorithm."""

    nu: float = 0.1
    """Smoothing: distances below ``nu`` count as ``nu`` (same units as the vectors)."""
    max_iter: int = 100
    """Upper bound on Weiszfeld iterations."""
    tol: float = 1e-6
    """Stop once an iteration moves the estimate by less than ``tol`` times the median distance
    from the estimate to the inputs (0 runs all ``max_iter`` iterations)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nu", require_positive_float("nu", self.nu, "geometric_median"))
        require_positive_int("max_iter", self.max_iter, "geometric_median")
        object.__setattr__(
            self,
            "tol",
            require_positive_float("tol", self.tol, "geometric_median", allow_zero=True),
        )


def _median(dist: torch.Tensor) -> float:
    return float(median_of_rows(dist[:, None])[0])


def _reference(
    X: torch.Tensor, f: int, cfg: GeometricMedianOptions, start: torch.Tensor | None
) -> tuple[torch.Tensor, RuleInfo]:
    X64 = X.to(torch.float64)
    v = X64.mean(dim=0)
    it = 0
    while it < cfg.max_iter:
        dist = torch.linalg.vector_norm(X64 - v, dim=1)
        beta = 1.0 / dist.clamp_min(cfg.nu)
        v_new = (beta[:, None] * X64).sum(dim=0) / beta.sum()
        move = float(torch.linalg.vector_norm(v_new - v))
        v = v_new
        it += 1
        if move <= cfg.tol * _median(dist):
            break
    return v.to(X.dtype), RuleInfo(iterations=it)


def _weights(
    G: torch.Tensor, f: int, cfg: GeometricMedianOptions, has_start: bool
) -> tuple[torch.Tensor, RuleInfo]:
    m = G.shape[0]
    a = torch.full((m,), 1.0 / m, dtype=torch.float64, device=G.device)
    it = 0
    while it < cfg.max_iter:
        dist = sq_dists_to_combination(G, a).sqrt()
        beta = 1.0 / dist.clamp_min(cfg.nu)
        a_new = beta / beta.sum()
        step = a_new - a
        move = float((step @ G @ step).clamp_min(0.0).sqrt())
        a = a_new
        it += 1
        if move <= cfg.tol * _median(dist):
            break
    return a, RuleInfo(iterations=it)


GEOMETRIC_MEDIAN = GramRule(
    name="geometric_median",
    config=GeometricMedianOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    reference=_reference,
    weights=_weights,
)


def geometric_median(
    vectors: Sequence[torch.Tensor],
    f: int,
    *,
    nu: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-6,
) -> torch.Tensor:
    """Approximate geometric median by smoothed Weiszfeld (see the module docstring).

    Non-finite vectors are excluded first. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` unless ``n > 2f``; ``ValueError``
    for invalid options.
    """
    stage = make_stage(GEOMETRIC_MEDIAN, {"nu": nu, "max_iter": max_iter, "tol": tol})
    return run_reference([stage], vectors, f).vector
