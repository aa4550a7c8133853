"""Pre-aggregators: nearest-neighbour mixing, bucketing, norm clipping.

A pre-aggregator maps the ``n`` input vectors to new vectors before a robust rule runs, to make
that rule work better when honest vectors differ from each other (heterogeneous data). All three
are linear maps ``A @ X`` whose matrix ``A`` depends on the inputs only through their Gram matrix
(or not at all), so the sharded engine applies them without moving any vector.

* nnm: replace each vector by the average of its ``n - f`` nearest neighbours (itself included).
  Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing by Mixing: A Recipe for Optimal
  Byzantine ML under Heterogeneity", AISTATS 2023 (arXiv 2302.01772). Needs ``n > 2f``.
* bucketing: shuffle the vectors with a seeded permutation and average consecutive buckets of
  ``s``; ``ceil(n / s)`` vectors come out, and the following rule still assumes ``f`` byzantine
  among them (each byzantine vector spoils at most one bucket). Karimireddy, He, Jaggi,
  "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR 2022
  (arXiv 2006.09365). Every peer must pass the same ``seed`` (e.g. the round number) so all
  draw the same buckets.
* clip: scale every vector whose norm exceeds ``c`` down to norm ``c``; by default ``c`` is the
  median of the norms, so a minority of huge vectors cannot set it. (Static clipping as used
  across the robust-learning literature; the median default is this library's choice.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.reduce.aggregate.aggregator import (
    NoOptions,
    PreAggregator,
    gram_sq_dists,
    make_stage,
    median_of_rows,
    pairwise_sq_dists,
    require_non_negative_int,
    require_positive_float,
    require_positive_int,
    run_reference_pre,
)

__all__ = [
    "BUCKETING",
    "CLIP",
    "NNM",
    "BucketingOptions",
    "ClipOptions",
    "bucketing",
    "clip",
    "nnm",
]


# -- nnm ---------------------------------------------------------------------------------------


def _nnm_matrix(D: torch.Tensor, f: int) -> torch.Tensor:
    n = D.shape[0]
    k = n - f
    # stable sort: among equally distant neighbours the lower index is taken, on every peer alike
    nearest = torch.sort(D, dim=1, stable=True).indices[:, :k]
    A = torch.zeros(n, n, dtype=torch.float64, device=D.device)
    A.scatter_(1, nearest, 1.0 / k)
    return A


def _nnm_reference(X: torch.Tensor, f: int, cfg: NoOptions) -> torch.Tensor:
    n = X.shape[0]
    D = pairwise_sq_dists(X.to(torch.float64))
    nearest = torch.sort(D, dim=1, stable=True).indices[:, : n - f]
    return torch.stack([X[nearest[i]].to(torch.float64).mean(dim=0) for i in range(n)]).to(X.dtype)


def _nnm_mixing(G: torch.Tensor | None, m: int, f: int, cfg: NoOptions) -> torch.Tensor:
    assert G is not None
    return _nnm_matrix(gram_sq_dists(G), f)


NNM = PreAggregator(
    name="nnm",
    config=NoOptions,
    min_n=lambda f, cfg: 2 * f + 1,
    requirement="n > 2f",
    reference=_nnm_reference,
    mixing=_nnm_mixing,
    output_count=lambda m, cfg: m,
)


# -- bucketing ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BucketingOptions:
    """Options of bucketing."""

    s: int = 2
    """Bucket size (the last bucket may be smaller)."""
    seed: int = 0
    """Seed of the shuffle; pass the same value on every peer (e.g. the round number)."""

    def __post_init__(self) -> None:
        require_positive_int("s", self.s, "bucketing")
        require_non_negative_int("seed", self.seed, "bucketing")


def _buckets(m: int, cfg: BucketingOptions) -> list[list[int]]:
    # torch's CPU generator gives the same permutation on every machine for a given seed
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    perm = torch.randperm(m, generator=gen).tolist()
    return [perm[i : i + cfg.s] for i in range(0, m, cfg.s)]


def _bucketing_reference(X: torch.Tensor, f: int, cfg: BucketingOptions) -> torch.Tensor:
    groups = _buckets(X.shape[0], cfg)
    return torch.stack([X[g].to(torch.float64).mean(dim=0) for g in groups]).to(X.dtype)


def _bucketing_mixing(
    G: torch.Tensor | None, m: int, f: int, cfg: BucketingOptions
) -> torch.Tensor:
    groups = _buckets(m, cfg)
    A = torch.zeros(len(groups), m, dtype=torch.float64)
    for row, g in enumerate(groups):
        A[row, g] = 1.0 / len(g)
    return A if G is None else A.to(G.device)


BUCKETING = PreAggregator(
    name="bucketing",
    config=BucketingOptions,
    min_n=lambda f, cfg: 1,
    requirement="n >= 1",
    reference=_bucketing_reference,
    mixing=_bucketing_mixing,
    output_count=lambda m, cfg: math.ceil(m / cfg.s),
    needs_gram=False,
    preserves_indices=False,
)


# -- clip --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ClipOptions:
    """Options of norm clipping."""

    c: float | None = None
    """Largest norm let through; ``None`` means the median of the inputs' norms."""

    def __post_init__(self) -> None:
        if self.c is not None:
            object.__setattr__(self, "c", require_positive_float("c", self.c, "clip"))


def _clip_scales(norms: torch.Tensor, cfg: ClipOptions) -> torch.Tensor:
    c = float(median_of_rows(norms[:, None])[0]) if cfg.c is None else cfg.c
    # vectors at or under the threshold (zero vectors included) are left alone
    return torch.where(norms > c, c / norms.clamp_min(1e-300), torch.ones_like(norms))


def _clip_reference(X: torch.Tensor, f: int, cfg: ClipOptions) -> torch.Tensor:
    X64 = X.to(torch.float64)
    scales = _clip_scales(torch.linalg.vector_norm(X64, dim=1), cfg)
    return (X64 * scales[:, None]).to(X.dtype)


def _clip_mixing(G: torch.Tensor | None, m: int, f: int, cfg: ClipOptions) -> torch.Tensor:
    assert G is not None
    return torch.diag(_clip_scales(torch.diagonal(G).clamp_min(0.0).sqrt(), cfg))


CLIP = PreAggregator(
    name="clip",
    config=ClipOptions,
    min_n=lambda f, cfg: 1,
    requirement="n >= 1",
    reference=_clip_reference,
    mixing=_clip_mixing,
    output_count=lambda m, cfg: m,
)


# -- public functions --------------------------------------------------------------------------


def nnm(vectors: Sequence[torch.Tensor], f: int) -> list[torch.Tensor]:
    """Nearest-neighbour mixing: each vector becomes the mean of its ``n - f`` nearest (itself
    included). Non-finite vectors are dropped first (outputs follow the finite inputs in order).
    Raises :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` unless ``n > 2f``."""
    return run_reference_pre(make_stage(NNM, {}), vectors, f)


def bucketing(
    vectors: Sequence[torch.Tensor], f: int, *, s: int = 2, seed: int = 0
) -> list[torch.Tensor]:
    """Average seeded random buckets of ``s`` vectors; returns ``ceil(n / s)`` vectors.
    Non-finite vectors are dropped first. Raises ``ValueError`` for invalid options."""
    return run_reference_pre(make_stage(BUCKETING, {"s": s, "seed": seed}), vectors, f)


def clip(vectors: Sequence[torch.Tensor], f: int, *, c: float | None = None) -> list[torch.Tensor]:
    """Scale vectors with norm above ``c`` (default: the median norm) down to norm ``c``.
    Non-finite vectors are dropped first. Raises ``ValueError`` for an invalid ``c``."""
    return run_reference_pre(make_stage(CLIP, {"c": c}), vectors, f)
