"""Consensus distance: how far the peers' models are from their average.

Kong, Lin, Koloskova, Jaggi and Stich, "Consensus Control for Decentralized Deep Learning"
(ICML 2021, arXiv 2102.04828) show that decentralized training matches centralized training as
long as the consensus distance stays below a critical value, which makes it the quantity to log
when tuning gossip schedules. Two forms:

* ``kind="mean"``: ``(1/n) sum_i ||x_i - x_bar||`` (the form the gossip strategy reports);
* ``kind="rms"``:  ``sqrt((1/n) sum_i ||x_i - x_bar||^2)`` (Kong et al.'s Xi).

All arithmetic is float64. :func:`consensus_distance` computes either form from every peer's
vector in one process; the same value over a group, on every rank, is
:func:`isthmus.strategies.gossip.exchange.consensus_distance_group`. Its RMS form needs a single
all-reduce of ``[x_i - ref, ||x_i - ref||^2]``, using ``(1/n) sum ||y_i||^2 - ||y_bar||^2``;
that difference cancels badly when the models are far from ``ref`` but close to each other, so
pass a ``reference`` every peer holds identically (the last global average, the initial model)
when one exists. The mean form needs ``x_bar`` before any norm, hence two all-reduces (the
second a scalar).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["consensus_distance"]

_KINDS = ("mean", "rms")


def _flat64(x: torch.Tensor, what: str) -> torch.Tensor:
    y = x.detach().reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"{what} contains NaN or Inf; consensus distance is undefined")
    return y


def consensus_distance(vectors: Sequence[torch.Tensor], *, kind: str = "mean") -> float:
    """Consensus distance of ``vectors`` (one per peer, same number of elements).

    Raises ``ValueError`` for an empty list, mismatched sizes, non-finite values or an unknown
    ``kind``.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if not vectors:
        raise ValueError("consensus distance of no vectors")
    xs = [_flat64(v, f"vector {i}") for i, v in enumerate(vectors)]
    if len({x.numel() for x in xs}) != 1:
        raise ValueError(f"vectors differ in size: {[x.numel() for x in xs]}")
    bar = torch.stack(xs).mean(dim=0)
    norms = torch.stack([torch.linalg.vector_norm(x - bar) for x in xs])
    if kind == "mean":
        return float(norms.mean())
    return float(torch.sqrt((norms * norms).mean()))


def _count(t: torch.Tensor) -> float:
    n = float(t)
    if n < 0.5:
        raise ValueError("consensus distance with no contributing rank")
    return n
