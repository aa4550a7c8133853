"""One gossip step's arithmetic, with no network: mixing a rank's vector with its neighbours',
and the references that compute a step for every rank at once in one process.

A gossip step (Boyd et al., "Randomized gossip algorithms", 2006; D-PSGD in Lian et al., "Can
Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017) replaces each rank's
vector by a weighted average of itself and its neighbours, with the Metropolis-Hastings weights
of :mod:`.mixing`:

    x_i <- W_ii x_i + sum_j W_ij x_j

Because ``W`` is symmetric and doubly stochastic, the mean over ranks is preserved and repeated
steps converge to it on a connected graph.

With a compressor (``encode``/``decode`` hooks) a rank only sees ``x_hat_j =
decode(encode(x_j))``. The plain form would then drift away from the true mean, so the compressed
step uses the difference form of CHOCO-Gossip (Koloskova, Stich and Jaggi, ICML 2019, arXiv
1902.00340, without its error memory):

    x_i <- x_i + gamma * sum_j W_ij (x_hat_j - x_hat_i)

which preserves the mean exactly in exact arithmetic for any deterministic ``decode`` (the sum
over all ranks cancels because ``W`` is symmetric), while consensus is only reached up to the
compression error. ``x_hat_i`` is decoded from the very payload this rank sent, so it is the
same value its neighbours use.

The distributed steps in :mod:`isthmus.strategies.gossip.exchange` must reproduce
:func:`gossip_reference` and :func:`variance_corrected_gossip_reference` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from isthmus.strategies.gossip.math.mixing import metropolis_row
from isthmus.strategies.gossip.math.topology import Topology
from isthmus.strategies.gossip.math.variance import (
    VARIANCE_EPS,
    segment_variances,
    variance_correct_flat,
    variance_target,
)

__all__ = [
    "Decode",
    "Encode",
    "gossip_reference",
    "mix",
    "variance_corrected_gossip_reference",
]

Encode = Callable[[torch.Tensor], torch.Tensor]
"""Flat vector -> 1-D payload tensor. The payload dtype must be the same on every rank; its
length may vary between calls and ranks (it is sent ahead in a header)."""
Decode = Callable[[torch.Tensor, int], torch.Tensor]
"""(payload, number of elements of the original vector) -> flat vector. Must be deterministic:
the sender and every receiver decode the same payload and must get the same result."""


def _flat(vec: torch.Tensor, what: str) -> torch.Tensor:
    if not vec.is_floating_point():
        raise ValueError(f"{what} has dtype {vec.dtype}; gossip averages floating-point vectors")
    flat = vec.detach().reshape(-1).contiguous()
    if not bool(torch.isfinite(flat).all()):
        raise ValueError(f"{what} contains NaN or Inf; refusing to send it to other peers")
    return flat


def _check_received(t: torch.Tensor, src: int) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"vector received from rank {src} contains NaN or Inf; not mixing it in (that peer's "
            f"model diverged; abort the round and resync it)"
        )


def _codec_pair(encode: Encode | None, decode: Decode | None) -> bool:
    if (encode is None) != (decode is None):
        raise ValueError("pass both encode and decode, or neither")
    return encode is not None


def mix(
    own: torch.Tensor,
    received: dict[int, torch.Tensor],
    self_weight: float,
    weights: dict[int, float],
    *,
    base: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Combine one rank's vector with its neighbours' (a new tensor, dtype of ``own``).

    Without ``base``: ``self_weight * own + sum_j weights[j] * received[j]``. With ``base`` (the
    compressed form, ``own`` being the decoded ``x_hat_i``): ``base + gamma * sum_j weights[j] *
    (received[j] - own)``. Neighbours are added in increasing rank order, so the result is
    reproducible bit for bit. Raises ``ValueError`` if ``received`` and ``weights`` name
    different neighbours.
    """
    if set(received) != set(weights):
        raise ValueError(f"received from {sorted(received)} but have weights for {sorted(weights)}")
    if base is None:
        out = own * self_weight
        for j in sorted(weights):
            out.add_(received[j], alpha=weights[j])
        return out
    delta = torch.zeros_like(own)
    for j in sorted(weights):
        delta.add_(received[j] - own, alpha=weights[j])
    return base.reshape(-1) + delta * gamma


def gossip_reference(
    vectors: Sequence[torch.Tensor],
    topology: Topology,
    *,
    encode: Encode | None = None,
    decode: Decode | None = None,
    gamma: float = 1.0,
) -> list[torch.Tensor]:
    """One gossip step for every rank at once, in one process: the pure reference that
    :func:`gossip_step` must reproduce bit for bit. ``encode`` is called once per rank, in rank
    order, like the distributed version does on each rank. Raises ``ValueError`` like
    :func:`gossip_step`."""
    if len(vectors) != topology.n:
        raise ValueError(f"{len(vectors)} vectors for a topology of {topology.n} ranks")
    coded = _codec_pair(encode, decode)
    flats = [_flat(v, f"vector {i}") for i, v in enumerate(vectors)]
    seen = flats
    if coded:
        assert encode is not None and decode is not None
        seen = [decode(encode(f).reshape(-1).contiguous(), f.numel()).reshape(-1) for f in flats]
    for i, s in enumerate(seen):
        _check_received(s, i)
    out = []
    for i in range(topology.n):
        self_w, weights = metropolis_row(topology, i)
        got = {j: seen[j] for j in weights}
        if coded:
            out.append(mix(seen[i], got, self_w, weights, base=flats[i], gamma=gamma))
        else:
            out.append(mix(flats[i], got, self_w, weights))
    return out


def _corrected_targets(
    own: torch.Tensor,
    received: Sequence[torch.Tensor],
    sizes: Sequence[int],
    target: str,
    mix_weight: float,
) -> list[float]:
    own_v = segment_variances(own, sizes).tolist()
    recv_v = [segment_variances(r, sizes).tolist() for r in received]
    return [
        variance_target(own_v[k], [rv[k] for rv in recv_v], target=target, mix=mix_weight)
        for k in range(len(sizes))
    ]


def variance_corrected_gossip_reference(
    vectors: Sequence[torch.Tensor],
    topology: Topology,
    sizes: Sequence[int],
    *,
    target: str = "received",
    mix_weight: float = 0.5,
    min_numel: int = 2,
    eps: float = VARIANCE_EPS,
) -> list[torch.Tensor]:
    """Pure reference of :func:`variance_corrected_gossip_step` for all ranks at once."""
    mixed = gossip_reference(vectors, topology)
    flats = [_flat(v, f"vector {i}") for i, v in enumerate(vectors)]
    out = []
    for i in range(topology.n):
        targets = _corrected_targets(
            flats[i], [flats[j] for j in topology.neighbors(i)], sizes, target, mix_weight
        )
        out.append(variance_correct_flat(mixed[i], sizes, targets, min_numel=min_numel, eps=eps))
    return out
