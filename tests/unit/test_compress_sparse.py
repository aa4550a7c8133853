"""Top-k / random-k and error feedback in one process: compressor properties and convergence on a
quadratic."""

from __future__ import annotations

import math

import pytest
import torch

from isthmus.reduce.compress.compressor import derive_seed
from isthmus.reduce.compress.sparse import (
    SparseCompressor,
    SparseConfig,
    densify,
    econtrol_update,
    ef14_update,
    ef21_update,
    k_for,
    randk_indices,
    sparse_reduce_mode,
    topk_select,
)


def test_topk_contraction():
    g = torch.Generator().manual_seed(0)
    for d, k in [(100, 1), (100, 10), (257, 64), (50, 50)]:
        for _ in range(20):
            x = torch.randn(d, generator=g, dtype=torch.float64) * torch.rand(
                d, generator=g, dtype=torch.float64
            )
            c = densify(*topk_select(x, k), d)
            assert float((x - c).pow(2).sum()) <= (1 - k / d) * float(x.pow(2).sum()) + 1e-12
            assert int((c != 0).sum()) <= k


def test_randk_is_unbiased():
    d, k, draws = 40, 4, 4000
    x = torch.linspace(-2, 3, d, dtype=torch.float64)
    acc = torch.zeros(d, dtype=torch.float64)
    for s in range(draws):
        idx = randk_indices(d, k, derive_seed(7, "w", s))
        acc += densify(idx, x[idx], d) * (d / k)
    mean = acc / draws
    # per coordinate the mean of `draws` samples has std |x_i| sqrt((d/k - 1) / draws)
    std = x.abs() * math.sqrt((d / k - 1) / draws)
    z = ((mean - x).abs() / std.clamp_min(1e-12))[x.abs() > 1e-9]
    assert float(z.max()) < 5.0
    # while a single draw is far from x
    one = densify(randk_indices(d, k, 1), x[randk_indices(d, k, 1)], d) * (d / k)
    assert float((one - x).norm()) > float(x.norm())


def test_randk_indices_are_shared_and_change_per_round():
    a = randk_indices(1000, 10, derive_seed(0, "w", 3))
    b = randk_indices(1000, 10, derive_seed(0, "w", 3))
    c = randk_indices(1000, 10, derive_seed(0, "w", 4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len(set(a.tolist())) == 10


def test_reduce_mode_rule():
    # gather (w-1) * 8k bytes vs dense 2 (w-1)/w * 4d bytes: gather iff k * w < d
    assert sparse_reduce_mode(1000, 10, 4) == "gather"
    assert sparse_reduce_mode(1000, 250, 4) == "dense"
    assert sparse_reduce_mode(1000, 249, 4) == "gather"
    c = SparseCompressor(SparseConfig(kind="topk", ratio=0.01))
    assert c.predict_bytes(10_000, 4) == 3 * 100 * 8
    assert SparseCompressor(SparseConfig(kind="randk", ratio=0.01)).predict_bytes(10_000, 4) == 600
    assert k_for(0.01, 150) == 2 and k_for(0.5, 1) == 1 and k_for(0.1, 0) == 0


# --- convergence on a heterogeneous quadratic, 4 simulated workers (pure math) -----------------


def _quadratic(seed: int = 0, n: int = 4, d: int = 20):
    g = torch.Generator().manual_seed(seed)
    a = [
        torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
        + torch.eye(d, dtype=torch.float64)
        for _ in range(n)
    ]
    b = [torch.randn(d, generator=g, dtype=torch.float64) * 3 for _ in range(n)]
    h = sum(ai.T @ ai for ai in a) / n
    x_star = torch.linalg.solve(h, sum(ai.T @ bi for ai, bi in zip(a, b, strict=True)) / n)

    def f(x):
        return float(sum(((ai @ x - bi) ** 2).sum() for ai, bi in zip(a, b, strict=True)) / (2 * n))

    def grads(x):
        return [ai.T @ (ai @ x - bi) for ai, bi in zip(a, b, strict=True)]

    lip = float(torch.linalg.eigvalsh(h).max())
    return f, grads, x_star, lip


def _run(
    feedback: str, *, lr_factor: float, steps: int, k: int = 2, eta: float = 0.1, seed: int = 0
):
    f, grads, x_star, lip = _quadratic(seed)
    n, d = 4, x_star.numel()

    def comp(v):
        return densify(*topk_select(v, k), d)

    x = torch.zeros(d, dtype=torch.float64)
    e = [torch.zeros(d, dtype=torch.float64) for _ in range(n)]
    h = [torch.zeros(d, dtype=torch.float64) for _ in range(n)]
    for _ in range(steps):
        gs = grads(x)
        if feedback == "none":
            step = sum(comp(gi) for gi in gs) / n
        elif feedback == "ef":
            cs = []
            for i in range(n):
                c, e[i] = ef14_update(gs[i], e[i], comp)
                cs.append(c)
            step = sum(cs) / n
        elif feedback == "ef21":
            for i in range(n):
                _, h[i] = ef21_update(gs[i], h[i], comp)
            step = sum(h) / n
        else:
            for i in range(n):
                _, e[i], h[i] = econtrol_update(gs[i], e[i], h[i], eta, comp)
            step = sum(h) / n
        x = x - (lr_factor / lip) * step
    return f(x) - f(x_star), x


def test_error_feedback_converges_where_plain_topk_stalls():
    gap_none, _ = _run("none", lr_factor=0.1, steps=1000)
    gap_none_small, _ = _run("none", lr_factor=0.05, steps=2000)
    gap_ef, _ = _run("ef", lr_factor=0.1, steps=1000)
    gap_ef_small, _ = _run("ef", lr_factor=0.05, steps=2000)
    gap_ef21, _ = _run("ef21", lr_factor=0.5, steps=300)
    gap_ec, _ = _run("econtrol", lr_factor=0.5, steps=300, eta=0.1)
    # plain top-k stalls far from the optimum, whatever the step size
    assert gap_none > 5.0 and gap_none_small > 5.0
    # EF14 reaches a neighbourhood that shrinks with the step size (heterogeneous data)
    assert gap_ef < 0.1 * gap_none and gap_ef_small < 0.5 * gap_ef
    # EF21 and EControl converge to the optimum
    assert gap_ef21 < 1e-9 and gap_ec < 1e-9


def test_econtrol_with_eta_zero_is_ef21():
    _, x_ec = _run("econtrol", lr_factor=0.5, steps=50, eta=0.0)
    _, x_21 = _run("ef21", lr_factor=0.5, steps=50)
    assert torch.equal(x_ec, x_21)


def test_config_validation():
    with pytest.raises(ValueError, match="ratio"):
        SparseConfig(kind="topk", ratio=0.0)
    with pytest.raises(ValueError, match="kind"):
        SparseConfig(kind="bottomk", ratio=0.1)
    with pytest.raises(ValueError, match="feedback"):
        SparseConfig(kind="topk", ratio=0.1, feedback="ef99")
    with pytest.raises(ValueError, match="eta"):
        SparseConfig(kind="topk", ratio=0.1, feedback="econtrol", eta=2.0)


def test_randk_large_tensor_path():
    d, k = 5_000_000, 1000  # above the randperm limit: sampled without an O(d) permutation
    a = randk_indices(d, k, 11)
    assert a.numel() == k and len(set(a.tolist())) == k
    assert int(a.min()) >= 0 and int(a.max()) < d
    assert torch.equal(a, randk_indices(d, k, 11))
    assert not torch.equal(a, randk_indices(d, k, 12))
