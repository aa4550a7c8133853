"""Compression test inputs: the compressor specs and quantization formats the tests cover, and
inputs built to reach the corners of the block formats."""

from __future__ import annotations

import torch

# every compressor family, each error-feedback variant, and the dense path of top-k
SPECS = [
    "none",
    "uint8:block=32",
    "int8:block=32",
    "fp8_e4m3:block=32",
    "fp8_e5m2:block=32",
    "int4:block=32",
    "e3m0:block=32",
    "topk:0.05",
    "topk:0.5",  # dense path (k * world >= d)
    "randk:0.1",
    "topk:0.05+ef",
    "randk:0.1+ef",
    "topk:0.05+ef21",
    "topk:0.05+econtrol",
    "randk:0.1+econtrol:eta=0.05",
    "powersgd:rank=2",
    "sign",
    "sketch:0.05,rows=3,width=0.3",
]

FORMATS = ["uint8", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "e3m0"]


def hard_input(n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Normal values with outliers, an all-zero block, a constant block and tiny values (to reach
    the fp8 subnormal range inside a block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::97] *= 50.0
    x[128:192] = 0.0
    x[256:320] = -3.25
    x[512:576] *= 1e-6
    x[520] = 1.0
    return x


def spiky_input(n: int, seed: int) -> torch.Tensor:
    """Normal values with outliers, an all-zero block and a block of tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::97] *= 50.0
    x[128:192] = 0.0
    x[512:576] *= 1e-6
    return x
