"""Every compressor over real in-process Gloo groups: identical bits on all peers, rollback,
non-finite inputs refused before anything is sent, byte prediction, non-contributing peers."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress import (
    NonFiniteError,
    make_compressor,
)
from isthmus.testing import local_groups, run_parallel
from support.compress import SPECS

SHAPES = {"w": (37, 23), "b": (5,)}


@pytest.fixture(scope="module")
def groups3():
    return local_groups(3)


def _inputs(rank: int, rnd: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * rnd + rank)
    return [(k, torch.randn(s, generator=g)) for k, s in SHAPES.items()]


@pytest.mark.parametrize("spec", SPECS)
def test_identical_bits_rollback_and_bytes(spec, groups3):
    def body(g):
        c = make_compressor(spec)
        results, sent, predicted = [], [], []
        for rnd in range(3):
            items = _inputs(g.rank, rnd)
            before = g.stats.bytes_sent
            out = c.reduce_sum_many(g, items)
            sent.append(g.stats.bytes_sent - before)
            if hasattr(c, "predict_bytes_many"):
                predicted.append(c.predict_bytes_many([t.shape for _, t in items], g.world))
            else:
                predicted.append(sum(c.predict_bytes(t.shape, g.world) for _, t in items))
            if rnd == 1:
                # abort this round: state must come back exactly, and the retry must repeat it
                saved = c.state_dict()
                c.rollback()
                assert not c.pending
                again = c.reduce_sum_many(g, items)
                assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True))
                c.rollback()
                _assert_state_equal(c.state_dict(), saved)
                out = c.reduce_sum_many(g, items)
            c.commit()
            results.append(out)
        return results, sent, predicted

    out = run_parallel(groups3, body)
    for rnd in range(3):
        for i, (key, shape) in enumerate(SHAPES.items()):
            ref = out[0][0][rnd][i]
            assert ref.shape == shape
            assert bool(torch.isfinite(ref).all())
            for r in (1, 2):
                assert torch.equal(out[r][0][rnd][i], ref), (spec, rnd, key, r)
    for r in range(3):
        sent, predicted = out[r][1], out[r][2]
        assert sent[0] == predicted[0] and sent[2] == predicted[2], (spec, sent, predicted)


# schemes whose per-tensor numerics do not depend on batching (no fp32 all-reduce of a sum)
_PER_KEY_EXACT = ("uint8", "int8", "fp8", "int4", "e3m0", "sign", "topk:0.05")


@pytest.mark.parametrize("spec", SPECS)
def test_many_tensors_share_a_few_collectives(spec, groups3):
    # a model's worth of tensors (an empty one included) costs a fixed number of collectives,
    # and the batched result equals reducing each tensor alone
    shapes = [(37, 23), (5,), (64,), (0,), (16, 8), (3, 3), (200,)]

    def body(g):
        gen = torch.Generator().manual_seed(7 + g.rank)
        items = [(f"t{i}", torch.randn(s, generator=gen)) for i, s in enumerate(shapes)]
        c = make_compressor(spec)
        calls, sent = g.stats.calls, g.stats.bytes_sent
        many = c.reduce_sum_many(g, items)
        calls, sent = g.stats.calls - calls, g.stats.bytes_sent - sent
        predicted = c.predict_bytes_many(shapes, g.world)
        singles = []
        for key, t in items:
            fresh = make_compressor(spec)
            singles.append(fresh.reduce_sum(g, key, t))
        return many, singles, calls, sent, predicted

    out = run_parallel(groups3, body)
    for r in range(3):
        many, singles, calls, sent, predicted = out[r]
        assert calls <= (3 if spec.startswith("powersgd") else 2), (spec, calls)
        assert sent == predicted, (spec, sent, predicted)
        for i, (a, b) in enumerate(zip(many, singles, strict=True)):
            assert a.shape == shapes[i] and torch.equal(a, out[0][0][i])
            if spec.startswith(_PER_KEY_EXACT):
                assert torch.equal(a, b), (spec, i)
            elif not spec.startswith("sketch"):  # sketch: estimates may tie-break differently
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (spec, i)


def _assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_state_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k])
        elif isinstance(a[k], tuple):  # numpy RandomState state
            assert repr(a[k]) == repr(b[k])
        else:
            assert a[k] == b[k]


@pytest.mark.parametrize("spec", SPECS)
def test_rollback_restores_state_exactly(spec, groups3):
    def body(g):
        c = make_compressor(spec)
        c.reduce_sum_many(g, _inputs(g.rank, 0))
        c.commit()
        committed = c.state_dict()
        c.reduce_sum_many(g, _inputs(g.rank, 1))
        assert c.pending or (not committed["local"] and not committed["shared"])
        c.rollback()
        _assert_state_equal(c.state_dict(), committed)
        # a fresh instance loaded from the checkpoint continues identically
        twin = make_compressor(spec)
        twin.load_state_dict(committed)
        a = c.reduce_sum_many(g, _inputs(g.rank, 2))
        b = twin.reduce_sum_many(g, _inputs(g.rank, 2))
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    assert run_parallel(groups3, body) == [True] * 3


@pytest.mark.parametrize("spec", SPECS)
def test_non_contributing_peer(spec, groups3):
    # rank 1 sits out with a NaN tensor; nothing of it may leak, and peers still agree
    def body(g):
        c = make_compressor(spec)
        items = _inputs(g.rank, 0)
        contribute = g.rank != 1
        if not contribute:
            items = [(k, torch.full_like(t, float("nan"))) for k, t in items]
        out = c.reduce_sum_many(g, items, contribute=contribute)
        c.commit()
        return out, c.state_dict()["local"]

    out = run_parallel(groups3, body)
    for i in range(len(SHAPES)):
        assert bool(torch.isfinite(out[0][0][i]).all())
        assert torch.equal(out[0][0][i], out[1][0][i]) and torch.equal(out[0][0][i], out[2][0][i])
    # the sitting-out peer kept no worker-side state for these keys
    local = out[1][1]
    for key in SHAPES:
        assert not {"e", "v", "h", "error"} & set(local.get(key, {})), (spec, local.get(key))
    if spec == "none":
        a, b = _inputs(0, 0), _inputs(2, 0)
        for i in range(len(SHAPES)):
            assert torch.allclose(out[0][0][i], a[i][1] + b[i][1])


@pytest.mark.parametrize("spec", SPECS)
def test_nan_is_rejected_before_anything_is_sent(spec):
    groups = local_groups(3, timeout_s=5)
    g = groups[0]
    c = make_compressor(spec)
    bad = torch.randn(6, 4)
    bad[2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"'layer\.weight'"):
        c.reduce_sum_many(g, [("ok", torch.randn(4)), ("layer.weight", bad)])
    assert g.stats.bytes_sent == 0 and g.stats.calls == 0
    assert not g.aborted and not c.pending
    assert issubclass(NonFiniteError, ValueError)


def test_int_tensors_and_duplicate_keys_are_refused(groups3):
    c = make_compressor("none")
    with pytest.raises(TypeError, match="floating-point"):
        c.reduce_sum(groups3[0], "x", torch.arange(4))
    with pytest.raises(ValueError, match="unique"):
        c.reduce_sum_many(groups3[0], [("x", torch.ones(2)), ("x", torch.ones(2))])
