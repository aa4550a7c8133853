"""1-bit sign compression and count sketches in one process: packing, norms, linearity, heavy
hitters, configuration checks."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.sign import pack_bits, sign_compress, unpack_bits
from isthmus.reduce.compress.sketch import CountSketch, SketchConfig


def test_bit_packing_round_trip():
    bits = torch.randint(0, 2, (3, 24), dtype=torch.uint8)
    packed = pack_bits(bits)
    assert packed.shape == (3, 3) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == sum(int(bits[0, i]) << i for i in range(8))
    assert torch.equal(unpack_bits(packed), bits)


def test_sign_compress_keeps_the_norm():
    v = torch.randn(2, 64)
    bits, scale = sign_compress(v, torch.tensor([64, 40]))
    c0 = (bits[0].float() * 2 - 1) * scale[0]
    assert torch.allclose(c0.norm(), v[0].norm())
    assert torch.allclose(scale[1], v[1, :40].norm() / 40**0.5)  # only valid values count


def test_count_sketch_is_linear_and_finds_heavy_hitters():
    d = 1000
    cs = CountSketch(d, rows=5, cols=200, seed=3)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    assert torch.allclose(cs.sketch(a + b), cs.sketch(a) + cs.sketch(b), atol=1e-5)
    x = torch.randn(d, generator=gen) * 0.01
    heavy = torch.tensor([3, 500, 777])
    x[heavy] = torch.tensor([10.0, -8.0, 6.0])
    est = cs.estimate(cs.sketch(x))
    assert set(torch.topk(est.abs(), 3).indices.tolist()) == set(heavy.tolist())
    assert torch.allclose(est[heavy], x[heavy], atol=0.1)


def test_sketch_config_validation():
    with pytest.raises(ValueError, match="k must be"):
        SketchConfig(k=0)
    with pytest.raises(ValueError, match="rows"):
        SketchConfig(rows=0)
    with pytest.raises(ValueError, match="momentum"):
        SketchConfig(momentum=1.0)
