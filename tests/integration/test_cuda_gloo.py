"""Compression of CUDA tensors over real in-process Gloo groups gives the CPU's bits: the quantized
all-reduce of every format, and every other compressor agreeing across peers.

One GPU cannot host a multi-rank NCCL group, so these use Gloo groups carrying CUDA tensors (Gloo
copies them through the host); the quantization itself runs on the GPU. Skipped, with the
reason, where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress import make_compressor
from isthmus.reduce.compress.formats import make_format
from isthmus.reduce.compress.quantize import quantized_all_reduce, quantized_all_reduce_reference
from isthmus.testing import local_groups, run_parallel
from support.compress import FORMATS, spiky_input

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only CI)"
)


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_all_reduce_of_cuda_tensors_has_the_cpu_bits(name):
    world = 3
    fmt = make_format(name, block=32)
    xs = [spiky_input(3000, seed=r) for r in range(world)]
    ref = quantized_all_reduce_reference(xs, fmt)
    assert torch.equal(quantized_all_reduce_reference([x.cuda() for x in xs], fmt).cpu(), ref)
    groups = local_groups(world)

    def body(g):
        out = quantized_all_reduce(g, xs[g.rank].cuda(), fmt)
        assert out.is_cuda
        return out.cpu()

    for out in run_parallel(groups, body):
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("spec", ["topk:0.05", "randk:0.05", "powersgd:rank=2", "sign", "sketch"])
def test_other_compressors_run_on_cuda_and_agree_across_peers(spec):
    world = 2
    groups = local_groups(world)
    compressors = [make_compressor(spec) for _ in range(world)]
    xs = [spiky_input(64 * 48, seed=10 + r).reshape(64, 48) for r in range(world)]

    def body(g):
        c = compressors[g.rank]
        out = c.reduce_sum(g, "w", xs[g.rank].cuda())
        c.commit()
        assert out.is_cuda
        return out.cpu()

    a, b = run_parallel(groups, body)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
