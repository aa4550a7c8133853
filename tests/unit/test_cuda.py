"""CUDA tensors take the same code paths as CPU ones and give the same bits: each quantization
format encodes and decodes CUDA tensors to the CPU's bytes.

Skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.formats import make_format
from support.compress import FORMATS, spiky_input

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only CI)"
)


@pytest.mark.parametrize("name", FORMATS)
def test_encode_and_decode_give_the_cpu_bytes_on_cuda(name):
    fmt = make_format(name, block=64)
    rows = spiky_input(4 * 1024, seed=1).reshape(4, 1024)
    cpu = fmt.encode(rows)
    gpu = fmt.encode(rows.cuda())
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), cpu)
    dec_cpu = fmt.decode(cpu, 1024)
    dec_gpu = fmt.decode(gpu, 1024)
    assert torch.equal(dec_gpu.cpu().view(torch.int32), dec_cpu.view(torch.int32))
