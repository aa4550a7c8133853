"""Variance-corrected model averaging.

"Vanishing Variance Problem in Fully Decentralized Neural-Network Systems" (arXiv 2404.04616)
observes that averaging k *uncorrelated* models divides each layer's weight variance by about k,
destroying the scale that Xavier/Kaiming initialization set up and slowing gossip learning. After
averaging, each layer is rescaled around its mean back to a target variance:

    w <- (w - mean(w)) * sqrt((s2_target + eps) / (var(w) + eps)) + mean(w),   eps = 1e-4

with ``s2_target`` the mean of the received models' variances of that layer (``target="received"``,
the paper's choice), this peer's own variance (``"own"``) or a mix of the two (``"mix"``).

Variances are population variances (divide by ``numel``) computed in float64; the result keeps
the input dtype. Layers with fewer than ``min_numel`` elements (scalars) are averaged but not
rescaled, since their variance is 0 and says nothing about initialization scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "VARIANCE_EPS",
    "corrected_average",
    "segment_variances",
    "variance_correct",
    "variance_correct_flat",
    "variance_target",
]

VARIANCE_EPS = 1e-4
"""The paper's stabilizer in both numerator and denominator."""

_TARGETS = ("received", "own", "mix")


def _require_finite(t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} contains NaN or Inf; refusing to average it into other models")


def _check_target(target: str, mix: float) -> None:
    if target not in _TARGETS:
        raise ValueError(f"variance target must be one of {_TARGETS}, got {target!r}")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1] (weight of the own variance), got {mix}")


def variance_correct(
    w: torch.Tensor, target_var: float, *, eps: float = VARIANCE_EPS
) -> torch.Tensor:
    """Return ``w`` rescaled around its mean so that its variance moves to ``target_var``.

    With ``eps > 0`` the variance lands at ``(target_var + eps) * var / (var + eps)``, i.e. at
    ``target_var`` up to ``eps``-relative terms; it is exact for ``eps = 0`` (then a constant
    ``w`` raises, having no spread to scale). Raises ``ValueError`` for non-finite ``w``, a
    negative or non-finite ``target_var``, or ``eps < 0``.
    """
    _require_finite(w, "tensor to variance-correct")
    if not (target_var >= 0.0 and target_var < float("inf")):
        raise ValueError(f"target variance must be finite and >= 0, got {target_var}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    x = w.detach().to(torch.float64)
    mean = x.mean()
    var = x.var(correction=0) if x.numel() > 1 else torch.zeros((), dtype=torch.float64)
    if eps == 0 and float(var) == 0.0:
        raise ValueError("cannot rescale a constant tensor to a variance with eps=0")
    scale = torch.sqrt((target_var + eps) / (var + eps))
    return ((x - mean) * scale + mean).to(w.dtype)


def variance_target(
    own: float, received: Sequence[float], *, target: str = "received", mix: float = 0.5
) -> float:
    """The ``s2_target`` for one layer: mean of ``received`` variances, ``own``, or
    ``mix * own + (1 - mix) * mean(received)``. With nothing received, every mode uses ``own``."""
    _check_target(target, mix)
    if target == "own" or not received:
        return float(own)
    recv = sum(float(v) for v in received) / len(received)
    if target == "received":
        return recv
    return mix * float(own) + (1.0 - mix) * recv


def corrected_average(
    own: Sequence[torch.Tensor],
    received: Sequence[Sequence[torch.Tensor]],
    *,
    target: str = "received",
    mix: float = 0.5,
    include_own: bool = True,
    min_numel: int = 2,
    eps: float = VARIANCE_EPS,
) -> list[torch.Tensor]:
    """Average models layer by layer, then variance-correct each layer.

    ``own`` is this peer's list of layers, ``received`` one list per received model with the same
    shapes. The average is uniform over ``own`` (if ``include_own``) and the received models.
    Raises ``ValueError`` for mismatched layers, nothing to average, or non-finite values (named
    by model and layer index).
    """
    _check_target(target, mix)
    models = ([own] if include_own else []) + [list(r) for r in received]
    if not models:
        raise ValueError("nothing to average: include_own=False and no models received")
    for m_idx, m in enumerate(models):
        if len(m) != len(own):
            raise ValueError(f"model {m_idx} has {len(m)} layers, own model has {len(own)}")
        for l_idx, (a, b) in enumerate(zip(m, own, strict=True)):
            if a.shape != b.shape:
                raise ValueError(
                    f"model {m_idx} layer {l_idx} has shape {tuple(a.shape)}, own has {tuple(b.shape)}"
                )
            _require_finite(a, f"model {m_idx} layer {l_idx}")
    out = []
    for l_idx, layer in enumerate(own):
        acc = torch.zeros(layer.shape, dtype=torch.float64)
        for m in models:
            acc += m[l_idx].detach().to(torch.float64)
        avg = (acc / len(models)).to(layer.dtype)
        if layer.numel() < min_numel:
            out.append(avg)
            continue
        s2 = variance_target(
            float(layer.detach().double().var(correction=0)),
            [float(r[l_idx].detach().double().var(correction=0)) for r in received],
            target=target,
            mix=mix,
        )
        out.append(variance_correct(avg, s2, eps=eps))
    return out


def segment_variances(flat: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Population variance (float64) of each consecutive segment of the 1-D ``flat``; ``sizes``
    are the layer sizes of a flattened model. Segments of one element get 0. Raises
    ``ValueError`` if the sizes do not add up to ``flat.numel()``."""
    if sum(sizes) != flat.numel():
        raise ValueError(f"layer sizes add up to {sum(sizes)}, vector has {flat.numel()} elements")
    x = flat.detach().reshape(-1).to(torch.float64)
    out = torch.zeros(len(sizes), dtype=torch.float64)
    for k, seg in enumerate(torch.split(x, list(sizes))):
        if seg.numel() > 1:
            out[k] = seg.var(correction=0)
    return out


def variance_correct_flat(
    flat: torch.Tensor,
    sizes: Sequence[int],
    target_vars: Sequence[float] | torch.Tensor,
    *,
    min_numel: int = 2,
    eps: float = VARIANCE_EPS,
) -> torch.Tensor:
    """:func:`variance_correct` applied segment by segment to a flattened model (a new tensor).

    This is the form the gossip exchange uses: the peer mixes flat vectors, computes each
    neighbour's :func:`segment_variances` from what it received, and corrects the mixed vector.
    Raises like :func:`variance_correct`, and ``ValueError`` if ``target_vars`` does not have one
    entry per segment.
    """
    if sum(sizes) != flat.numel():
        raise ValueError(f"layer sizes add up to {sum(sizes)}, vector has {flat.numel()} elements")
    targets = [float(v) for v in target_vars]
    if len(targets) != len(sizes):
        raise ValueError(f"{len(targets)} target variances for {len(sizes)} layers")
    _require_finite(flat, "flat model vector")
    parts = []
    for seg, s2 in zip(torch.split(flat.reshape(-1), list(sizes)), targets, strict=True):
        parts.append(seg.clone() if seg.numel() < min_numel else variance_correct(seg, s2, eps=eps))
    return torch.cat(parts) if parts else flat.clone()
