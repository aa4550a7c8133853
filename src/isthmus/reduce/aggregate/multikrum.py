"""Krum and Multi-Krum.

Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries: Byzantine Tolerant
Gradient Descent", NeurIPS 2017.

Each vector ``x_i`` is scored by the sum of squared distances to its ``n - f - 2`` nearest other
vectors; Krum returns the vector with the lowest score, Multi-Krum the average of the ``m`` lowest
scored (``m = n - f`` by default). The paper's guarantee needs ``n >= 2f + 3`` (so each score
counts at least one neighbour and honest vectors outnumber byzantine ones by more than two), and
that is what these functions require.

Scores depend only on pairwise distances, and ``||x_i - x_j||^2 = G_ii + G_jj - 2 G_ij`` for the
Gram matrix ``G``, so the sharded engine decides from the ``n x n`` matrix alone. Ties in score
go to the lower index, on every peer alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.reduce.aggregate.aggregator import (
    GramRule,
    NoOptions,
    RuleInfo,
    gram_sq_dists,
    make_stage,
    pairwise_sq_dists,
    require_positive_int,
    run_reference,
)

__all__ = ["KRUM", "MULTI_KRUM", "MultiKrumOptions", "krum", "multi_krum"]


@dataclass(frozen=True, kw_only=True)
class MultiKrumOptions:
    """Options of Multi-Krum."""

    m: int | None = None
    """How many of the best-scored vectors to average; ``None`` means ``n - f``. A value larger
    than the number of vectors left after excluding non-finite ones is clamped (and noted)."""

    def __post_init__(self) -> None:
        if self.m is not None:
            require_positive_int("m", self.m, "multi_krum")


def _scores(D: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of every point from the squared-distance matrix ``D`` (float64)."""
    n = D.shape[0]
    k = n - f - 2
    # the point itself sits at distance 0 in its own row; put it last so it is never counted
    D = D.clone()
    D.fill_diagonal_(float("inf"))
    nearest = torch.sort(D, dim=1).values[:, :k]
    return nearest.sum(dim=1)


def _best(scores: torch.Tensor, m: int) -> list[int]:
    # stable sort: equal scores keep index order, so the lower index wins a tie
    return torch.sort(scores, stable=True).indices[:m].tolist()


def _resolve_m(n: int, f: int, cfg: MultiKrumOptions) -> tuple[int, tuple[str, ...]]:
    if cfg.m is None:
        return n - f, ()
    if cfg.m > n:
        return n, (f"multi_krum: m={cfg.m} clamped to the {n} vectors available",)
    return cfg.m, ()


def _krum_reference(
    X: torch.Tensor, f: int, cfg: NoOptions, start: torch.Tensor | None
) -> tuple[torch.Tensor, RuleInfo]:
    idx = _best(_scores(pairwise_sq_dists(X.to(torch.float64)), f), 1)
    return X[idx[0]].clone(), RuleInfo(selected=tuple(idx))


def _krum_weights(
    G: torch.Tensor, f: int, cfg: NoOptions, has_start: bool
) -> tuple[torch.Tensor, RuleInfo]:
    idx = _best(_scores(gram_sq_dists(G), f), 1)
    w = torch.zeros(G.shape[0], dtype=torch.float64, device=G.device)
    w[idx[0]] = 1.0
    return w, RuleInfo(selected=tuple(idx))


def _multi_krum_reference(
    X: torch.Tensor, f: int, cfg: MultiKrumOptions, start: torch.Tensor | None
) -> tuple[torch.Tensor, RuleInfo]:
    m, notes = _resolve_m(X.shape[0], f, cfg)
    idx = _best(_scores(pairwise_sq_dists(X.to(torch.float64)), f), m)
    out = X[sorted(idx)].to(torch.float64).mean(dim=0).to(X.dtype)
    return out, RuleInfo(selected=tuple(sorted(idx)), notes=notes)


def _multi_krum_weights(
    G: torch.Tensor, f: int, cfg: MultiKrumOptions, has_start: bool
) -> tuple[torch.Tensor, RuleInfo]:
    m, notes = _resolve_m(G.shape[0], f, cfg)
    idx = _best(_scores(gram_sq_dists(G), f), m)
    w = torch.zeros(G.shape[0], dtype=torch.float64, device=G.device)
    w[idx] = 1.0 / m
    return w, RuleInfo(selected=tuple(sorted(idx)), notes=notes)


KRUM = GramRule(
    name="krum",
    config=NoOptions,
    min_n=lambda f, cfg: 2 * f + 3,
    requirement="n >= 2f + 3",
    reference=_krum_reference,
    weights=_krum_weights,
)
MULTI_KRUM = GramRule(
    name="multi_krum",
    config=MultiKrumOptions,
    min_n=lambda f, cfg: 2 * f + 3,
    requirement="n >= 2f + 3",
    reference=_multi_krum_reference,
    weights=_multi_krum_weights,
)


def krum(vectors: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """Return (a copy of) the input vector with the lowest Krum score.

    Non-finite vectors are excluded first. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` unless ``n >= 2f + 3``.
    """
    return run_reference([make_stage(KRUM, {})], vectors, f).vector


def multi_krum(vectors: Sequence[torch.Tensor], f: int, *, m: int | None = None) -> torch.Tensor:
    """Average of the ``m`` (default ``n - f``) vectors with the lowest Krum scores.

    Non-finite vectors are excluded first. Raises ``AggregationError`` unless ``n >= 2f + 3``,
    ``ValueError`` if ``m < 1``.
    """
    return run_reference([make_stage(MULTI_KRUM, {"m": m})], vectors, f).vector
