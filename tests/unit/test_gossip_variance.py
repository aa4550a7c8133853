"""Variance-corrected averaging and the pure consensus distance, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from isthmus.strategies.gossip.math.consensus import consensus_distance
from isthmus.strategies.gossip.math.variance import (
    corrected_average,
    segment_variances,
    variance_correct,
    variance_correct_flat,
    variance_target,
)


def _xavier_layers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(64, 32, generator=g) * math.sqrt(2 / 96),
        torch.randn(32, 16, generator=g) * math.sqrt(2 / 48),
        torch.randn(1, generator=g),  # a scalar: averaged, never rescaled
    ]


def test_variance_correct_hits_the_target_and_keeps_the_mean():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, generator=g, dtype=torch.float64) * 0.1 + 3.0
    out = variance_correct(w, 0.04, eps=0.0)
    assert out.var(correction=0).item() == pytest.approx(0.04, rel=1e-12)
    assert out.mean().item() == pytest.approx(w.mean().item(), rel=1e-12)
    # the paper's eps: the variance lands at (t + eps) * v / (v + eps)
    v = w.var(correction=0).item()
    out = variance_correct(w, 0.04)
    assert out.var(correction=0).item() == pytest.approx((0.04 + 1e-4) * v / (v + 1e-4), rel=1e-10)
    assert out.dtype == w.dtype
    assert variance_correct(w.float(), 0.04).dtype == torch.float32


def test_averaging_uncorrelated_models_shrinks_variance_and_correction_restores_it():
    models = [_xavier_layers(s) for s in range(8)]
    own, received = models[0], models[1:]
    plain = corrected_average(own, received, target="own", eps=1e-4)
    naive = [torch.stack([m[i] for m in models]).mean(0) for i in range(3)]
    for layer in range(2):
        target = sum(m[layer].var(correction=0).item() for m in received) / len(received)
        v = naive[layer].var(correction=0).item()
        assert v < target / 5  # the vanishing variance
        exact = corrected_average(own, received, eps=0.0)[layer]
        assert exact.var(correction=0).item() == pytest.approx(target, rel=1e-5)
        assert exact.mean().item() == pytest.approx(naive[layer].mean().item(), abs=1e-6)
        # with the paper's eps the variance lands at (t + eps) * v / (v + eps)
        out = corrected_average(own, received)[layer]
        assert out.var(correction=0).item() == pytest.approx(
            (target + 1e-4) * v / (v + 1e-4), rel=1e-5
        )
        own_v = own[layer].var(correction=0).item()
        assert plain[layer].var(correction=0).item() == pytest.approx(
            (own_v + 1e-4) * v / (v + 1e-4), rel=1e-5
        )
    assert torch.allclose(corrected_average(own, received)[2], naive[2], rtol=1e-6)  # not rescaled


def test_variance_target_modes():
    assert variance_target(1.0, [3.0, 5.0]) == 4.0
    assert variance_target(1.0, [3.0, 5.0], target="own") == 1.0
    assert variance_target(1.0, [3.0, 5.0], target="mix", mix=0.25) == pytest.approx(0.25 + 3.0)
    assert variance_target(2.0, []) == 2.0
    with pytest.raises(ValueError, match="variance target"):
        variance_target(1.0, [], target="max")
    with pytest.raises(ValueError, match="mix"):
        variance_target(1.0, [1.0], target="mix", mix=1.5)


def test_flat_form_equals_layer_form():
    models = [_xavier_layers(s) for s in range(4)]
    sizes = [t.numel() for t in models[0]]
    flats = [torch.cat([t.reshape(-1) for t in m]) for m in models]
    avg = torch.stack(flats).mean(0)
    recv_vars = torch.stack([segment_variances(f, sizes) for f in flats[1:]]).mean(0)
    flat_out = variance_correct_flat(avg, sizes, recv_vars)
    layer_out = torch.cat([t.reshape(-1) for t in corrected_average(models[0], models[1:])])
    assert torch.allclose(flat_out, layer_out, atol=1e-6)
    assert segment_variances(flats[0], sizes)[2].item() == 0.0


def test_non_finite_and_mismatched_inputs_are_rejected():
    bad = _xavier_layers(1)
    bad[1][0, 0] = float("nan")
    with pytest.raises(ValueError, match="model 1 layer 1 contains NaN"):
        corrected_average(_xavier_layers(0), [bad])
    with pytest.raises(ValueError, match="NaN or Inf"):
        variance_correct(torch.tensor([1.0, float("inf")]), 1.0)
    with pytest.raises(ValueError, match="target variance"):
        variance_correct(torch.ones(3), float("nan"))
    with pytest.raises(ValueError, match="shape"):
        corrected_average(_xavier_layers(0), [[t.reshape(-1) for t in _xavier_layers(1)]])
    with pytest.raises(ValueError, match="add up"):
        variance_correct_flat(torch.ones(5), [2, 2], [1.0, 1.0])


def test_consensus_distance_pure():
    xs = [
        torch.tensor([0.0, 0.0]),
        torch.tensor([2.0, 0.0]),
        torch.tensor([1.0, 3.0]),
        torch.tensor([1.0, -3.0]),
    ]
    # mean is (1, 0); distances 1, 1, 3, 3
    assert consensus_distance(xs) == pytest.approx(2.0)
    assert consensus_distance(xs, kind="rms") == pytest.approx(math.sqrt(5.0))
    assert consensus_distance([torch.ones(4)] * 3) == 0.0
    with pytest.raises(ValueError, match="vector 1 contains NaN"):
        consensus_distance([torch.ones(2), torch.tensor([0.0, float("nan")])])
