"""Coordinate-wise rules: mean, median, trimmed mean, mean-around-median.

Each works on every coordinate independently, so the sharded engine runs it unchanged on the
columns a peer owns.

* mean: the plain average (not robust: one byzantine vector moves it anywhere). It still applies
  the non-finite policy, so a NaN from one peer is excluded rather than spread.
* median: coordinate-wise median; trimmed mean: drop the ``f`` largest and ``f`` smallest values
  per coordinate and average the rest. Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018 (arXiv 1803.01498).
* meamed (mean around median): per coordinate, the average of the ``n - f`` values closest to the
  median. Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", 2018 (arXiv 1802.10116).

All robust ones need ``n > 2f``; with fewer vectors a majority could be byzantine and no
coordinate-wise statistic can tell which values are honest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isthmus.reduce.aggregate.aggregator import (
    CoordinateRule,
    NoOptions,
    make_stage,
    median_of_rows,
    run_reference,
)

__all__ = ["MEAMED", "MEAN", "MEDIAN", "TRIMMED_MEAN", "meamed", "mean", "median", "trimmed_mean"]


def _mean_columns(X: torch.Tensor, f: int, cfg: NoOptions) -> torch.Tensor:
    return X.mean(dim=0)


def _median_columns(X: torch.Tensor, f: int, cfg: NoOptions) -> torch.Tensor:
    return median_of_rows(X)


def _trimmed_mean_columns(X: torch.Tensor, f: int, cfg: NoOptions) -> torch.Tensor:
    n = X.shape[0]
    if f == 0:
        return X.mean(dim=0)
    s = torch.sort(X, dim=0).values
    return s[f : n - f].mean(dim=0)


def _meamed_columns(X: torch.Tensor, f: int, cfg: NoOptions) -> torch.Tensor:
    n = X.shape[0]
    med = median_of_rows(X)
    # a stable sort breaks ties in distance by vector index, so two values equally far from the
    # median on either side are chosen the same way on every peer and in the reference
    order = torch.sort((X - med).abs(), dim=0, stable=True).indices[: n - f]
    return torch.gather(X, 0, order).mean(dim=0)


MEAN = CoordinateRule(
    name="mean",
    config=NoOptions,
    min_n=lambda f, cfg: 1,
    requirement="n >= 1",
    columns=_mean_columns,
)
MEDIAN = CoordinateRule(
    name="median",
    config=NoOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    columns=_median_columns,
)
TRIMMED_MEAN = CoordinateRule(
    name="trimmed_mean",
    config=NoOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    columns=_trimmed_mean_columns,
)
MEAMED = CoordinateRule(
    name="meamed",
    config=NoOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    columns=_meamed_columns,
)


def mean(vectors: Sequence[torch.Tensor], f: int = 0) -> torch.Tensor:
    """Average of the finite vectors (``f`` is only checked, the mean cannot use it).

    Vectors holding NaN/Inf are excluded and logged. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` if none is finite.
    """
    return run_reference([make_stage(MEAN, {})], vectors, f).vector


def median(vectors: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """Coordinate-wise median (midpoint of the two middle values for an even count).

    Non-finite vectors are excluded first. Raises ``AggregationError`` unless ``n > 2f``.
    """
    return run_reference([make_stage(MEDIAN, {})], vectors, f).vector


def trimmed_mean(vectors: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """Per coordinate, drop the ``f`` largest and ``f`` smallest values and average the rest.

    Non-finite vectors are excluded first. Raises ``AggregationError`` unless ``n > 2f``.
    """
    return run_reference([make_stage(TRIMMED_MEAN, {})], vectors, f).vector


def meamed(vectors: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """Per coordinate, the average of the ``n - f`` values closest to the median (ties broken by
    vector index). Non-finite vectors are excluded first. Raises ``AggregationError`` unless
    ``n > 2f``."""
    return run_reference([make_stage(MEAMED, {})], vectors, f).vector
