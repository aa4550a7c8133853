"""The bit-parity quantized all-reduce over real in-process Gloo groups: equal to its reference,
non-contributors, overflow failing alike on every peer, pipelined chunks, NaN refused."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.compressor import NonFiniteError
from isthmus.reduce.compress.formats import make_format
from isthmus.reduce.compress.quantize import (
    QuantizedAllReduce,
    quantized_all_reduce,
    quantized_all_reduce_reference,
)
from isthmus.testing import local_groups, run_parallel
from support.compress import FORMATS, hard_input


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_all_reduce_bit_parity_and_reference(name):
    world = 3
    groups = local_groups(world)
    fmt = make_format(name, block=32)
    xs = [hard_input(1000, seed=r) for r in range(world)]

    def body(g):
        return quantized_all_reduce(g, xs[g.rank], fmt), g.stats.bytes_sent

    out = run_parallel(groups, body)
    ref = quantized_all_reduce_reference(xs, fmt)
    for r in range(world):
        assert torch.equal(out[r][0], out[0][0])  # identical bits on every peer
    assert torch.equal(out[0][0], ref)  # and exactly the single-process reference
    # close to the true sum: each input and the sum carry one quantization error
    true = sum(xs)
    rel = float((out[0][0] - true).norm() / true.norm())
    limit = {
        "uint8": 0.01,
        "int8": 0.02,
        "fp8_e4m3": 0.06,
        "fp8_e5m2": 0.12,
        "int4": 0.2,
        "e3m0": 0.45,
    }[name]
    assert rel < limit, rel
    # byte accounting matches the prediction on every rank
    c = QuantizedAllReduce(fmt)
    assert [b for _, b in out] == [c.predict_bytes(1000, world)] * world
    assert c.predict_bytes(1000, world) < 1000 * 4 * 2 * (world - 1) / world * (
        0.6 if fmt.bits == 4 else 0.35
    )


def test_non_contributor_adds_nothing():
    groups = local_groups(2)
    fmt = make_format("int8", block=16)
    x = torch.linspace(-3, 5, 50)

    def body(g):
        return quantized_all_reduce(g, x, fmt, contribute=g.rank == 0)

    a, b = run_parallel(groups, body)
    assert torch.equal(a, b)
    single = quantized_all_reduce_reference([x, torch.zeros(50)], fmt)
    assert torch.equal(a, single)


@pytest.mark.parametrize("name", ["int8", "uint8", "e3m0"])
def test_overflowing_sum_fails_alike_on_every_peer(name):
    from isthmus.reduce.compress import make_compressor

    groups = local_groups(2)
    c = make_compressor(f"{name}:block=4")

    def body(g):
        x = torch.tensor([3e38, 1.0, -2.0, 3.0, 0.5, 0.25, 1.0, 2.0])
        try:
            c_local = make_compressor(c.name)
            c_local.reduce_sum(g, "w", x)
        except NonFiniteError as e:
            return str(e)
        return "no error"

    msgs = run_parallel(groups, body)
    assert all("reduced sum for tensor 'w'" in m for m in msgs), msgs


@pytest.mark.parametrize("name", ["int4", "uint8", "e3m0"])
def test_pipelined_chunks_give_the_same_bits_and_bytes(name):
    # tiny chunks force many pipeline stages (and segments that split tensors and share chunks);
    # every tensor must still equal its single-tensor reference bit for bit
    from isthmus.reduce.compress.quantize import quantized_all_reduce_many

    world = 3
    groups = local_groups(world)
    fmt = make_format(name, block=16)
    sizes = [1000, 7, 0, 300, 64]
    xs = [
        [hard_input(2000, seed=10 * r + i)[:n] for i, n in enumerate(sizes)] for r in range(world)
    ]

    def body(g):
        calls, sent = g.stats.calls, g.stats.bytes_sent
        out = quantized_all_reduce_many(g, xs[g.rank], fmt, chunk_values=48)
        return out, g.stats.calls - calls, g.stats.bytes_sent - sent

    res = run_parallel(groups, body)
    c = QuantizedAllReduce(fmt)
    for i in range(len(sizes)):
        ref = quantized_all_reduce_reference([xs[r][i] for r in range(world)], fmt)
        for r in range(world):
            assert torch.equal(res[r][0][i], ref), (name, i, r)
    for r in range(world):
        assert res[r][1] > 2  # really pipelined: several all-to-all/all-gather pairs
        assert res[r][2] == c.predict_bytes_many([(n,) for n in sizes], world)


def test_nan_input_is_refused_before_the_pipeline_starts():
    from isthmus.reduce.compress.quantize import quantized_all_reduce_many

    (g, *_) = local_groups(2, timeout_s=5)
    x = torch.randn(10_000)
    x[9_999] = float("nan")  # in the last chunk: must fail before the first one is sent
    with pytest.raises(NonFiniteError, match="nothing was sent"):
        quantized_all_reduce_many(g, [x], make_format("int8"), chunk_values=64)
    assert g.stats.calls == 0
