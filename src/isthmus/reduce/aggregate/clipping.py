"""Centered clipping.

Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021
(arXiv 2012.10333).

Starting from ``v`` (the previous aggregate, or zero), repeat ``iterations`` times

    v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)

Each input moves ``v`` by at most ``tau / n``, whatever its size: that bounded influence is the
robustness argument, and it is why the rule should start from the previous aggregate (with
momentum, as in the paper) so that honest vectors sit within ``tau`` of ``v``. The paper uses one
iteration; ``tau`` is in the units of the vectors and needs tuning (100 is one library's default).
``n > 2f`` is required.

Every iterate is a combination of the inputs and the start vector, so the sharded engine runs the
iterations on the ``(n+1) x (n+1)`` Gram matrix of inputs and start, with no further
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
    require_positive_float,
    require_positive_int,
    run_reference,
    sq_dists_to_combination,
)

__all__ = ["CENTERED_CLIPPING", "CenteredClippingOptions", "centered_clipping"]


@dataclass(frozen=True, kw_only=True)
class CenteredClippingOptions:
    """Options of centered clipping."""

    tau: float = 100.0
    """Clipping radius around the current centre, in the units of the vectors."""
    iterations: int = 1
    """Clipping rounds (the paper uses 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "tau", require_positive_float("tau", self.tau, "centered_clipping")
        )
        require_positive_int("iterations", self.iterations, "centered_clipping")


def _reference(
    X: torch.Tensor, f: int, cfg: CenteredClippingOptions, start: torch.Tensor | None
) -> tuple[torch.Tensor, RuleInfo]:
    X64 = X.to(torch.float64)
    n = X.shape[0]
    v = (
        torch.zeros(X.shape[1], dtype=torch.float64, device=X.device)
        if start is None
        else start.to(torch.float64)
    )
    for _ in range(cfg.iterations):
        diff = X64 - v
        dist = torch.linalg.vector_norm(diff, dim=1)
        # tau / max(dist, tau) is min(1, tau / dist) without dividing by a zero distance
        scale = cfg.tau / dist.clamp_min(cfg.tau)
        v = v + (scale[:, None] * diff).sum(dim=0) / n
    return v.to(X.dtype), RuleInfo(iterations=cfg.iterations)


def _weights(
    G: torch.Tensor, f: int, cfg: CenteredClippingOptions, has_start: bool
) -> tuple[torch.Tensor, RuleInfo]:
    p = G.shape[0]
    n = p - 1 if has_start else p
    a = torch.zeros(p, dtype=torch.float64, device=G.device)
    if has_start:
        a[n] = 1.0
    for _ in range(cfg.iterations):
        dist = sq_dists_to_combination(G, a)[:n].sqrt()
        scale = cfg.tau / dist.clamp_min(cfg.tau)
        # v + (1/n) sum_i c_i (x_i - v), written on the coefficients of v
        a = a * (1.0 - scale.sum() / n)
        a[:n] += scale / n
    return a, RuleInfo(iterations=cfg.iterations)


CENTERED_CLIPPING = GramRule(
    name="centered_clipping",
    config=CenteredClippingOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    reference=_reference,
    weights=_weights,
    uses_start=True,
)


def centered_clipping(
    vectors: Sequence[torch.Tensor],
    f: int,
    *,
    start: torch.Tensor | None = None,
    tau: float = 100.0,
    iterations: int = 1,
) -> torch.Tensor:
    """Centered clipping from ``start`` (the previous aggregate; zero when ``None``).

    Non-finite vectors are excluded first. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` unless ``n > 2f`` or if ``start``
    is not a finite vector of the inputs' length; ``ValueError`` for invalid options.
    """
    stage = make_stage(CENTERED_CLIPPING, {"tau": tau, "iterations": iterations})
    return run_reference([stage], vectors, f, start=start).vector
