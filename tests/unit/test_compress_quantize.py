"""Quantization formats in one process: round-trip bounds, payload sizes, packing, shard layout."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.compressor import NonFiniteError
from isthmus.reduce.compress.formats import E3M0, make_format, pack_nibbles, unpack_nibbles
from isthmus.reduce.compress.quantize import (
    quantized_all_reduce,
    quantized_all_reduce_reference,
    shard_layout,
)
from isthmus.testing import local_groups
from support.compress import FORMATS, hard_input


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("block", [64, 32])
def test_round_trip_error_bound(name, block):
    fmt = make_format(name, block=block)
    x = hard_input()
    p = fmt.quantize(x)
    assert p.data.dtype == torch.uint8
    assert p.nbytes == fmt.row_bytes(x.numel())
    y = fmt.dequantize(p)
    assert y.dtype == torch.float32 and y.shape == x.shape
    bound = fmt.error_bound(x)
    err = (x - y).abs()
    # the table's bounds, with slack for the fp32 arithmetic on scales only
    assert bool((err <= bound * (1 + 1e-5) + x.abs() * 1e-6).all()), float((err / bound).max())
    assert torch.equal(y[128:192], torch.zeros(64))  # zeros stay exact
    # and the bound is not vacuous: the error reaches a good part of it somewhere
    assert float((err / bound.clamp_min(1e-30)).max()) > 0.5


@pytest.mark.parametrize("name", FORMATS)
def test_payload_sizes(name):
    fmt = make_format(name, block=64)
    bits = 4 if name in ("int4", "e3m0") else 8
    words = 2 if name == "uint8" else 1
    assert fmt.row_bytes(640) == 640 * bits // 8 + 10 * words * 4
    # odd lengths are padded to whole blocks (by repeating the last value)
    p = fmt.quantize(torch.linspace(-1, 1, 100))
    assert p.nbytes == fmt.row_bytes(128)
    assert fmt.dequantize(p).shape == (100,)


def test_nibble_packing_round_trip():
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_e3m0_codes_are_as_documented():
    fmt = E3M0(block=8)
    s = 2.0
    x = torch.tensor([1.0, 0.5, 0.375, -0.7, 2.0**-7, 0.0, -(2.0**-8), 0.024]) * s
    y = fmt.dequantize(fmt.quantize(x)) / s
    # 0.375 is the midpoint of 0.25 and 0.5 (ties go up); -0.7 -> -0.5 (0.75 is the boundary);
    # 2^-7 is halfway to the smallest magnitude 2^-6 and goes up; -2^-8 rounds to zero
    expect = torch.tensor([1.0, 0.5, 0.5, -0.5, 2.0**-6, 0.0, 0.0, 2.0**-5])
    assert torch.equal(y, expect)


def test_fp8_dtypes_exist_on_cpu():
    x = torch.tensor([1.0, -2.0, 448.0])
    assert torch.equal(x.to(torch.float8_e4m3fn).float(), x)
    assert torch.equal(x.to(torch.float8_e5m2).float(), x)


def test_quantize_rejects_non_finite():
    fmt = make_format("int8")
    with pytest.raises(NonFiniteError):
        fmt.quantize(torch.tensor([1.0, float("nan")]))
    # a block spanning nearly the whole fp32 range encodes and decodes without overflowing (an
    # encode that raised on one peer only would strand the others in the collective)
    fmt8 = make_format("uint8", block=2)
    x = torch.tensor([-3e38, 3e38])
    y = fmt8.dequantize(fmt8.quantize(x))
    assert bool(torch.isfinite(y).all())
    assert bool(((y - x).abs() <= fmt8.error_bound(x) * (1 + 1e-5)).all())
    # values inside such a block too, not only its ends
    fmt4 = make_format("uint8", block=4)
    x = torch.tensor([-3e38, 3e38, 2e38, -1e38])
    y = fmt4.dequantize(fmt4.quantize(x))
    assert bool(((y - x).abs() <= fmt4.error_bound(x) * (1 + 1e-5)).all())
    # and a block gets the same bits whether or not such a block shares its call
    normal = torch.tensor([0.1, -2.5, 3.75, 1e-3])
    alone = fmt4.dequantize(fmt4.quantize(normal))
    together = fmt4.dequantize(fmt4.quantize(torch.cat([normal, x])))[:4]
    assert torch.equal(alone.view(torch.int32), together.view(torch.int32))


def test_shard_layout_shrinks_blocks_for_small_tensors():
    fmt = make_format("int4", block=128)
    f, shard = shard_layout(16, 3, fmt)
    assert f.block == 6 and shard == 6  # ceil(16/3) = 6 values per peer, one block each
    f, shard = shard_layout(10_000, 3, fmt)
    assert f.block == 128 and shard == 3456 and shard * 3 >= 10_000
    f, shard = shard_layout(5, 4, make_format("e3m0"))
    assert f.block % 2 == 0 and shard * 4 >= 5


def test_world_of_one_is_a_round_trip():
    (g,) = local_groups(1)
    fmt = make_format("fp8_e4m3", block=16)
    x = torch.randn(40)
    out = quantized_all_reduce(g, x, fmt)
    assert torch.equal(out, quantized_all_reduce_reference([x], fmt))
    assert g.stats.bytes_sent == 0
