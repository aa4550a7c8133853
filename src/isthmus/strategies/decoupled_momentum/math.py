"""DeMo's transform and message, as pure functions: a 2-D DCT over tiles, top-k per tile.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (2024);
reference optimizer bloc97/DeMo (Nous Research).

Every tensor is viewed as a matrix: ``(shape[0], numel / shape[0])`` for two or more dimensions,
``(1, numel)`` for a vector or scalar. Each axis of length ``n`` is cut into tiles of ``s``, the
largest divisor of ``n`` not above ``chunk`` (the reference's rule; 64 by default), so a 96 x 32
matrix has 48 x 32 tiles and a vector of 32 has 1 x 32 tiles. On each tile the orthonormal
DCT-II runs along both axes (``X = D_s1 T D_s2^T``); the ``k`` coefficients of largest magnitude
per tile (``min(k, s1 * s2)``) are kept.

The message of one peer, of fixed size (:attr:`DCTCodec.payload_bytes`)::

    header   4 * (1 + E) bytes: float32 [present, exact values...]   (E: the floating buffers)
    per tensor with T tiles: T * k' * (2 + 4) bytes: the int16 positions in their tile, then
             the float32 coefficients (k' = min(k, tile size))

Receivers sum the present messages' coefficients in rank order (a plain sum per coefficient)
and apply the inverse DCT (``T = D_s1^T X D_s2``) in float64, rounded once to float32. The DCT
bases are built from Python's ``math.cos`` in float64 (not torch's vectorized cos, whose last
bits may depend on the CPU's instruction set). Peers on one kind of CPU and one torch build
therefore compute the same bits; across CPU kinds the float64 matrix products may round
differently in rare cases (the parity check then repairs the peer that differs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from isthmus.strategies.sparseloco.math import (
    Decoded,
    read_as,
    read_header,
    sum_present,
    topk_rows,
)

__all__ = ["DCTCodec", "dct_basis", "tile_size"]


def tile_size(n: int, chunk: int) -> int:
    """The largest divisor of ``n`` that is at most ``chunk`` (1 if ``n`` is 0)."""
    best = 1
    for d in range(1, min(n, chunk) + 1):
        if n % d == 0:
            best = d
    return best


@lru_cache(maxsize=64)
def dct_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` in float64: ``D[k, j] = a_k cos(pi (2j + 1) k
    / (2n))`` with ``a_0 = sqrt(1/n)``, ``a_k = sqrt(2/n)``; ``D @ D.T`` is the identity."""
    rows = []
    for k in range(n):
        a = math.sqrt((1.0 if k == 0 else 2.0) / n)
        rows.append([a * math.cos(math.pi * (2 * j + 1) * k / (2 * n)) for j in range(n)])
    return torch.tensor(rows, dtype=torch.float64)


@dataclass(frozen=True)
class _Tiling:
    rows: int
    cols: int
    s1: int
    s2: int
    k: int

    @property
    def tiles(self) -> int:
        return (self.rows // self.s1) * (self.cols // self.s2)

    @property
    def size(self) -> int:
        return self.s1 * self.s2

    @property
    def kept(self) -> int:
        return self.tiles * self.k


def _matrix(shape: torch.Size) -> tuple[int, int]:
    n = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 0:
        return shape[0], n // shape[0]
    return 1, n


class DCTCodec:
    """DeMo's compressor over tensors of fixed shapes (see the module docstring). Raises
    ValueError for a chunk outside 1 to 181 (a tile must hold at most 32768 positions) or
    ``k`` < 1."""

    def __init__(self, shapes: Sequence[torch.Size], chunk: int, k: int, exact: int = 0) -> None:
        if not 1 <= chunk <= 181:
            raise ValueError(
                f"chunk must be 1 to 181 (a tile's positions travel as int16), got {chunk}"
            )
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        self.chunk, self.k, self.exact = chunk, k, exact
        self.tilings = []
        for s in shapes:
            r, c = _matrix(torch.Size(s))
            s1, s2 = tile_size(r, chunk), tile_size(c, chunk)
            self.tilings.append(_Tiling(r, c, s1, s2, min(k, s1 * s2)))

    @property
    def header_bytes(self) -> int:
        return 4 * (1 + self.exact)

    @property
    def payload_bytes(self) -> int:
        """The size of every peer's message, in bytes."""
        return self.header_bytes + sum(6 * t.kept for t in self.tilings)

    @property
    def density(self) -> float:
        total = sum(t.rows * t.cols for t in self.tilings)
        return sum(t.kept for t in self.tilings) / max(1, total)

    @staticmethod
    def _tiles(x: torch.Tensor, t: _Tiling) -> torch.Tensor:
        """``[tiles, s1, s2]`` view-copy of a matrix, tiles in row-major order."""
        return (
            x.reshape(t.rows // t.s1, t.s1, t.cols // t.s2, t.s2)
            .permute(0, 2, 1, 3)
            .reshape(-1, t.s1, t.s2)
        )

    @staticmethod
    def _untile(x: torch.Tensor, t: _Tiling) -> torch.Tensor:
        return (
            x.reshape(t.rows // t.s1, t.cols // t.s2, t.s1, t.s2)
            .permute(0, 2, 1, 3)
            .reshape(t.rows * t.cols)
        )

    @staticmethod
    def _both_axes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ x_i @ b.T`` for every tile ``x_i`` of ``x`` ``[tiles, s1, s2]``, as two plain
        matrix products (a batch of small products costs far more on the CPU). A side of 1 is
        skipped: its basis is exactly [[1.0]]."""
        n, s1, s2 = x.shape
        if s2 > 1:
            x = (x.reshape(n * s1, s2) @ b.T).reshape(n, s1, s2)
        if s1 > 1:
            x = (x.transpose(1, 2).reshape(n * s2, s1) @ a.T).reshape(n, s2, s1).transpose(1, 2)
        return x

    def transform(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The DCT coefficients of tensor ``i`` (any shape of its numel), ``[tiles, s1 * s2]``
        in float32 (computed in float64)."""
        t = self.tilings[i]
        tiles = self._tiles(x.detach().reshape(-1).to(torch.float64), t)
        coef = self._both_axes(tiles, dct_basis(t.s1), dct_basis(t.s2))
        return coef.reshape(t.tiles, t.size).to(torch.float32)

    def inverse(self, coef: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i`` (flat float32) from its coefficients ``[tiles * s1 * s2]`` (float32),
        inverted in float64 and rounded once."""
        t = self.tilings[i]
        x = coef.to(torch.float64).reshape(t.tiles, t.s1, t.s2)
        out = self._both_axes(x, dct_basis(t.s1).T, dct_basis(t.s2).T)
        return self._untile(out, t).to(torch.float32)

    def encode(
        self, tensors: Sequence[torch.Tensor], exact: torch.Tensor | None, present: bool = True
    ) -> torch.Tensor:
        """The message (uint8, :attr:`payload_bytes` long) for ``tensors`` (the momenta)."""
        head = torch.zeros(1 + self.exact)
        head[0] = 1.0 if present else 0.0
        if exact is not None:
            head[1:] = exact.to(torch.float32)
        parts = [head.view(torch.uint8)]
        for i, x in enumerate(tensors):
            t = self.tilings[i]
            if x.numel() != t.rows * t.cols:
                raise ValueError(f"a tensor of {x.numel()} elements, expected {t.rows * t.cols}")
            idx, vals = topk_rows(self.transform(x, i), t.k)
            parts.append(idx.reshape(-1).to(torch.int16).view(torch.uint8))
            parts.append(vals.reshape(-1).contiguous().view(torch.uint8))
        msg = torch.cat(parts)
        assert msg.numel() == self.payload_bytes
        return msg

    def decode(self, msg: torch.Tensor) -> Decoded:
        """Read a message: per tensor, the flat positions in its coefficient vector ``[tiles *
        s1 * s2]`` and the coefficients. Raises ValueError for a message of another size."""
        msg, head = read_header(msg, self.payload_bytes, self.header_bytes)
        off = self.header_bytes
        entries = []
        for t in self.tilings:
            local = read_as(msg[off : off + 2 * t.kept], torch.int16).to(torch.int64)
            off += 2 * t.kept
            vals = read_as(msg[off : off + 4 * t.kept], torch.float32)
            off += 4 * t.kept
            base = torch.arange(t.tiles, dtype=torch.int64).repeat_interleave(t.k) * t.size
            entries.append((base + local, vals))
        return Decoded(bool(head[0] == 1.0), head[1:].clone(), entries)

    def coefficients(self, decoded: Decoded) -> list[torch.Tensor]:
        """One decoded message as dense coefficient vectors (float32)."""
        return [
            torch.zeros(t.tiles * t.size).index_put_((pos,), vals)
            for (pos, vals), t in zip(decoded.entries, self.tilings, strict=True)
        ]

    def sum(self, messages: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        """Sum the present messages' coefficients in rank order; returns (coefficient sums,
        exact sum, number present)."""
        sizes = [t.tiles * t.size for t in self.tilings]
        return sum_present(self.decode, sizes, self.exact, messages)
