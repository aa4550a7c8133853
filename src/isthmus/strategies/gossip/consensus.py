"""Consensus distance: how far the peers' models are from their average.

Kong, Lin, Koloskova, Jaggi and Stich, "Consensus Control for Decentralized Deep Learning"
(ICML 2021, arXiv 2102.04828) show that decentralized training matches centralized training as
long as the consensus distance stays below a critical value, which makes it the quantity to log
when tuning gossip schedules. Two forms:

* ``kind="mean"``: ``(1/n) sum_i ||x_i - x_bar||`` (the form the gossip strategy reports);
* ``kind="rms"``:  ``sqrt((1/n) sum_i ||x_i - x_bar||^2)`` (Kong et al.'s Xi).

All arithmetic is float64. The distributed RMS form needs a single all-reduce of
``[x_i - ref, ||x_i - ref||^2]``, using ``(1/n) sum ||y_i||^2 - ||y_bar||^2``; that difference
cancels badly when the models are far from ``ref`` but close to each other, so pass a
``reference`` every peer holds identically (the last global average, the initial model) when one
exists. The mean form needs ``x_bar`` before any norm, hence two all-reduces (the second a
scalar).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isthmus.comm.group import Group

__all__ = ["consensus_distance", "consensus_distance_group"]

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


def consensus_distance_group(
    group: Group,
    vec: torch.Tensor,
    *,
    kind: str = "rms",
    reference: torch.Tensor | None = None,
    contribute: bool = True,
) -> float:
    """The same value as :func:`consensus_distance` over the contributing ranks' ``vec``, on
    every rank.

    ``kind="rms"`` costs one all-reduce of ``numel + 2`` float64s; ``kind="mean"`` one of
    ``numel + 1`` float64s plus one scalar all-reduce. ``reference`` (identical on every rank)
    only improves the accuracy of the RMS form. A rank with ``contribute=False`` (a joiner whose
    model is stale) takes part in the collectives but is left out of the average and the
    distance; its ``vec`` only gives the size.

    Raises ``ValueError`` for a non-finite contributing ``vec`` before anything is sent and when
    no rank contributed; :class:`~isthmus.comm.group.CollectiveError` if a collective fails.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if contribute:
        x = _flat64(vec, f"rank {group.rank}'s vector")
    else:
        x = torch.zeros(vec.numel(), dtype=torch.float64)
    one = 1.0 if contribute else 0.0
    if kind == "mean":
        total = torch.empty(x.numel() + 1, dtype=torch.float64)
        total[:-1] = x
        total[-1] = one
        group.all_reduce(total, "sum")
        n = _count(total[-1])
        d = torch.linalg.vector_norm(x - total[:-1] / n).reshape(1) * one
        group.all_reduce(d, "sum")
        return float(d[0]) / n
    y = x
    if reference is not None:
        ref = _flat64(reference, "reference")
        if ref.numel() != x.numel():
            raise ValueError(f"reference has {ref.numel()} elements, vector has {x.numel()}")
        y = (x - ref) * one
    payload = torch.empty(y.numel() + 2, dtype=torch.float64)
    payload[:-2] = y
    payload[-2] = torch.dot(y, y)
    payload[-1] = one
    group.all_reduce(payload, "sum")
    n = _count(payload[-1])
    ybar = payload[:-2] / n
    # clamp: rounding can push a tiny true value below zero
    sq = float(payload[-2]) / n - float(torch.dot(ybar, ybar))
    return max(sq, 0.0) ** 0.5


def _count(t: torch.Tensor) -> float:
    n = float(t)
    if n < 0.5:
        raise ValueError("consensus distance with no contributing rank")
    return n
