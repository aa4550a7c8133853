"""Block-wise quantization formats: pure tensor math, no state, no network.

The quantized collective built on them is :mod:`.quantize`.

Formats (every one uses one fp32 scale per block of ``block`` values, two for ``uint8``):

============  ======================================================  =============================
spec          code                                                    round-trip error, per value
============  ======================================================  =============================
``uint8``     min-max: ``q = round((x - lo) / step)``, 0..255,        ``<= step / 2`` with
              ``step = (hi - lo) / 255``; stores ``lo`` and ``step``   ``step = (hi - lo) / 255``
``int8``      symmetric (zero point 0): ``q = round(x / s)``,         ``<= s / 2``
              -127..127, ``s = max|x| / 127``; 0 is exact
``fp8_e4m3``  ``x / s`` cast to float8_e4m3fn (round to nearest       ``<= max(|x| 2^-4, s 2^-10)``
              even), ``s = max|x| / 448``
``fp8_e5m2``  ``x / s`` cast to float8_e5m2, ``s = max|x| / 57344``    ``<= max(|x| 2^-3, s 2^-17)``
``int4``      symmetric ``q = round(x / s)``, -7..7, ``s = max|x|/7``  ``<= s / 2``
``e3m0``      4-bit float, sign + 3 exponent bits, no mantissa:       ``<= max(|x| / 3, s 2^-7)``
              see below; ``s = max|x|``
============  ======================================================  =============================

(``lo``, ``hi``, ``max|x|`` are taken per block. Each bound holds up to fp32 rounding of the
scale arithmetic, a relative 2^-22 or so.)

E3M0, exactly: a nibble ``b3 b2 b1 b0``; ``b3`` is the sign and ``e = b2 b1 b0``. ``e = 0`` is
zero; ``e = 1..7`` is ``±2^(e - 7) * s``, so the magnitudes are ``s * {2^-6, ..., 2^-1, 1}``.
Encoding rounds ``|x| / s`` to the nearest of ``{0, 2^-6, ..., 1}`` in linear distance (ties go
up), which gives the bound above. Streaming DiLoCo reports sending outer gradients "in FP4 E3M0";
its exact bias and zero handling are not published, so this is our own definition.

4-bit codes are packed two per byte, the first value in the low nibble. A quantized row of ``n``
values (``n`` a multiple of the block) is one uint8 tensor: the codes, then the fp32 scales'
bytes (native byte order; all supported platforms are little-endian).

FP8 formats: Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .compressor import NonFiniteError, all_finite

__all__ = [
    "E3M0",
    "FORMATS",
    "Fp8",
    "Int4Symmetric",
    "Int8Symmetric",
    "Packed",
    "QuantFormat",
    "Uint8MinMax",
    "bits_per_value",
    "make_format",
    "pack_nibbles",
    "unpack_nibbles",
]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack values 0..15 (uint8, even-length last dim) two per byte, first value low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nibble packing needs an even number of values, got {codes.shape[-1]}")
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return lo | (hi << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: each byte gives two uint8 values 0..15."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _safe_div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x / s as a fresh tensor, dividing by 1 where s == 0. A scale is 0 only for an all-zero
    block (or one so tiny that its scale underflowed), whose values then quantize to 0 as they
    should, not to NaN."""
    return x / torch.where(s != 0, s, torch.ones_like(s))


def _div_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` correctly rounded on every device. CUDA divides by a Python number as a
    multiplication by its reciprocal, which can differ from the CPU's true division in the last
    bit; dividing by a tensor takes the true division on both, so a CPU peer and a CUDA peer
    quantize alike. Used on the per-block scales only (small tensors)."""
    return x / torch.full_like(x, c)


def _absmax(xb: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim (keepdim), from max and min: two reductions without a
    full-size temporary. NaN propagates."""
    # max(|max|, |min|) rather than max(max, -min): the latter can give -0.0 for a zero block
    return torch.maximum(xb.amax(dim=-1, keepdim=True).abs(), xb.amin(dim=-1, keepdim=True).abs())


def _pack_float_nibbles(q: torch.Tensor, offset: float, out: torch.Tensor) -> None:
    """Write ``q`` (float codes, last dim even) packed two per byte into the uint8 ``out``:
    ``(q[2i] + offset) | (q[2i+1] + offset) << 4``, computed exactly in fp32."""
    packed = torch.add(q[..., 0::2], q[..., 1::2], alpha=16.0)
    packed.add_(offset * 17.0)
    out.copy_(packed)


def _nibble_table(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: for every byte, the values of its low and its high nibble."""
    v = torch.tensor(list(values), dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack((v[b & 0x0F], v[b >> 4]), dim=1).to(device)


def _decode_nibbles(codes: torch.Tensor, table: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(rows, nblocks, block/2) packed bytes -> (rows, nblocks, block) fp32 via a per-byte table
    lookup (one gather, no unpacked temporaries), times the block scales."""
    r, nb, half = codes.shape
    pairs = table.index_select(0, codes.reshape(-1).to(torch.int32))
    return pairs.view(r, nb, 2 * half).mul_(scales)


@dataclass(frozen=True)
class Packed:
    """A quantized tensor: the uint8 payload (codes then scales) and what is needed to decode it."""

    data: torch.Tensor
    shape: tuple[int, ...]
    numel: int
    fmt: QuantFormat

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@dataclass(frozen=True, kw_only=True)
class QuantFormat(ABC):
    """A block-wise quantization format. Pure: no state, no network."""

    #: values per block; each block has its own scale(s). Smaller blocks: more accurate, more bytes.
    block: int = 128

    name: ClassVar[str] = "?"
    bits: ClassVar[int] = 8
    #: fp32 words of scale metadata per block
    scale_words: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"{self.name}: block must be a positive int, got {self.block!r}")
        if self.bits == 4 and self.block % 2:
            raise ValueError(
                f"{self.name}: 4-bit formats pack two values per byte, so block must be even; "
                f"got {self.block}"
            )

    def with_block(self, block: int) -> QuantFormat:
        return dataclasses.replace(self, block=block)

    @property
    def spec(self) -> str:
        return f"{self.name}:block={self.block}"

    # -- sizes ------------------------------------------------------------------------------------
    def row_bytes(self, n: int) -> int:
        """Payload bytes of one quantized row of ``n`` values (``n`` a multiple of the block)."""
        if n % self.block:
            raise ValueError(f"row length {n} is not a multiple of block {self.block}")
        return n * self.bits // 8 + (n // self.block) * self.scale_words * 4

    def padded(self, n: int) -> int:
        return -(-n // self.block) * self.block

    # -- block math (subclasses) --------------------------------------------------------------------
    @abstractmethod
    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Quantize ``xb`` (rows, nblocks, block) fp32: write the codes into ``codes`` (rows,
        nblocks, block * bits / 8) uint8, a view into the payload, and return the scales
        (rows, nblocks, scale_words) fp32. Must not modify ``xb``."""

    @abstractmethod
    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_encode_blocks`: (rows, nblocks, bytes per block) uint8 and
        (rows, nblocks, scale_words) fp32 -> a fresh (rows, nblocks, block) fp32 tensor."""

    # -- rows -------------------------------------------------------------------------------------
    # Quantizing is memory-bound: every full-size temporary costs a pass and, for large tensors,
    # fresh pages. The kernels below use one division (into a buffer they then modify in place)
    # and write codes straight into the payload.
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize each row of a (rows, n) fp32 tensor; returns (rows, row_bytes(n)) uint8.

        Raises :class:`NonFiniteError` if ``x`` holds NaN/Inf or a block's range overflows fp32
        (values beyond about ±1.7e38)."""
        if x.dim() != 2:
            raise ValueError(f"encode expects (rows, n), got shape {tuple(x.shape)}")
        rows, n = x.shape
        nbytes = self.row_bytes(n)  # validates n
        nb = n // self.block
        xb = x.to(torch.float32).reshape(rows, nb, self.block)
        out = torch.empty(rows, nbytes, dtype=torch.uint8, device=x.device)
        cb = n * self.bits // 8
        scales = self._encode_blocks(xb, out[:, :cb].view(rows, nb, -1))
        # NaN and Inf reach every block's scale (min/max propagate them), so checking the small
        # scale tensor replaces a full pass over x
        if not bool(torch.isfinite(scales).all()):
            if not all_finite(x):
                raise NonFiniteError(f"{self.name}: cannot quantize NaN/Inf values")
            raise NonFiniteError(
                f"{self.name}: a block's scale overflowed fp32 (values too large); "
                f"scale the tensor down before compressing"
            )
        out[:, cb:].copy_(scales.to(torch.float32).reshape(rows, -1).view(torch.uint8))
        return out

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """Inverse of :meth:`encode`: (rows, row_bytes(n)) uint8 -> (rows, n) fp32."""
        if payload.dim() != 2 or payload.dtype != torch.uint8:
            raise ValueError("decode expects a (rows, bytes) uint8 tensor")
        rows = payload.shape[0]
        expect = self.row_bytes(n)
        if payload.shape[1] != expect:
            raise ValueError(
                f"{self.name}: a row of {n} values has {expect} bytes, got {payload.shape[1]}"
            )
        cb = n * self.bits // 8
        nb = n // self.block
        codes = payload[:, :cb].reshape(rows, nb, -1)
        # reshape(-1).clone(): a fresh, aligned buffer (a slice of a row may start at an offset
        # that is not a multiple of 4, and viewing bytes as fp32 needs an aligned start)
        scales = payload[:, cb:].reshape(-1).clone().view(torch.float32)
        scales = scales.reshape(rows, nb, self.scale_words)
        return self._decode_blocks(codes, scales).reshape(rows, n)

    # -- whole tensors ------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> Packed:
        """Quantize any float tensor. The last block is padded by repeating the last value, so
        padding never widens a block's range."""
        flat = x.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        m = self.padded(n)
        if m > n:
            flat = torch.cat((flat, flat[-1:].expand(m - n)))
        data = (
            self.encode(flat.reshape(1, m)).reshape(-1)
            if m
            else flat.new_empty(0, dtype=torch.uint8)
        )
        return Packed(data=data, shape=tuple(x.shape), numel=n, fmt=self)

    def dequantize(self, p: Packed) -> torch.Tensor:
        """Float32 tensor of the original shape from :meth:`quantize`'s payload."""
        if p.fmt != self:
            raise ValueError(f"payload was quantized with {p.fmt.spec}, not {self.spec}")
        m = self.padded(p.numel)
        if not m:
            return torch.zeros(p.shape, dtype=torch.float32, device=p.data.device)
        out = self.decode(p.data.reshape(1, -1), m).reshape(-1)
        return out[: p.numel].reshape(p.shape)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-value bound on ``|x - dequantize(quantize(x))|`` from the table in the module
        docstring (without the fp32 slack), for a flat tensor whose length is a multiple of the
        block."""
        xb = x.detach().reshape(-1, self.block).to(torch.float32)
        return self._bound_blocks(xb).reshape(x.shape)

    @abstractmethod
    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class Uint8MinMax(QuantFormat):
    """Asymmetric 8-bit: per block ``lo`` and ``step = (hi - lo) / 255``."""

    name: ClassVar[str] = "uint8"
    bits: ClassVar[int] = 8
    scale_words: ClassVar[int] = 2

    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        lo = xb.amin(dim=-1, keepdim=True)
        hi = xb.amax(dim=-1, keepdim=True)
        # hi/255 - lo/255 rather than (hi - lo)/255: the difference of two finite values near the
        # fp32 limit overflows, and an encode that raised on one peer only would leave the others
        # waiting in the all-to-all
        step = _div_const(hi, 255.0) - _div_const(lo, 255.0)
        safe = torch.where(step != 0, step, torch.ones_like(step))
        y = (xb - lo).div_(safe)
        big = step.abs() > _UINT8_STEP_LIMIT
        if bool(big.any()):
            # a block spanning most of the fp32 range: x - lo overflows in fp32; those blocks
            # (only those, so a block's codes never depend on its neighbours) are done in fp64
            wide = (xb.double() - lo.double()).div_(safe.double()).float()
            y = torch.where(big, wide, y)
        codes.copy_(y.round_().clamp_(0, 255))
        return torch.cat((lo, step), dim=-1)

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        lo, step = scales[..., 0:1], scales[..., 1:2]
        out = (codes * step).add_(lo)
        big = step.abs() > _UINT8_STEP_LIMIT
        if bool(big.any()):
            # a block spanning most of the fp32 range: code * step overflows in fp32 but the value
            # itself (at most hi) does not; fp64 gets it right. Per block, so that a block decodes
            # to the same bits whichever blocks share the call (the pipelined all-reduce and its
            # reference cut the work differently); it depends only on the payload's bits, so
            # every peer decoding the same payload gets the same values.
            wide = (lo.double() + codes.double() * step.double()).float()
            out = torch.where(big, wide, out)
        return out

    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        step = xb.amax(1, keepdim=True) / 255.0 - xb.amin(1, keepdim=True) / 255.0
        return (step / 2).expand_as(xb)


@dataclass(frozen=True, kw_only=True)
class Int8Symmetric(QuantFormat):
    """Symmetric 8-bit (zero point fixed at 0): ``s = max|x| / 127``, codes -127..127."""

    name: ClassVar[str] = "int8"
    bits: ClassVar[int] = 8

    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = _div_const(_absmax(xb), 127.0)
        codes.view(torch.int8).copy_(_safe_div(xb, s).round_().clamp_(-127, 127))
        return s

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8) * scales

    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        return (_absmax(xb) / 127.0 / 2).expand_as(xb)


@dataclass(frozen=True, kw_only=True)
class Fp8(QuantFormat):
    """8-bit float (``kind`` e4m3 or e5m2) with a per-block scale mapping ``max|x|`` to the
    format's largest finite value."""

    kind: str = "e4m3"

    name: ClassVar[str] = "fp8"
    bits: ClassVar[int] = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8 kind must be 'e4m3' or 'e5m2', got {self.kind!r}")

    @property
    def spec(self) -> str:
        return f"fp8_{self.kind}:block={self.block}"

    @property
    def _dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kind == "e4m3" else torch.float8_e5m2

    @property
    def _fmax(self) -> float:
        return 448.0 if self.kind == "e4m3" else 57344.0

    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = _div_const(_absmax(xb), self._fmax)
        # the clamp matters: x / s can land a hair above the largest finite value, and casting
        # beyond it gives NaN (e4m3fn has no Inf) or Inf (e5m2) on some backends
        codes.view(self._dtype).copy_(_safe_div(xb, s).clamp_(-self._fmax, self._fmax))
        return s

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        # a 256-entry lookup gives exactly the cast's values and is several times faster on CPU
        # than converting float8 to float32
        table = torch.arange(256, dtype=torch.uint8).view(self._dtype).to(torch.float32)
        vals = table.to(codes.device).index_select(0, codes.reshape(-1).to(torch.int32))
        return vals.view(codes.shape).mul_(scales)

    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        s = _absmax(xb) / self._fmax
        rel, sub = (2.0**-4, 2.0**-10) if self.kind == "e4m3" else (2.0**-3, 2.0**-17)
        return torch.maximum(xb.abs() * rel, (s * sub).expand_as(xb))


@dataclass(frozen=True, kw_only=True)
class Int4Symmetric(QuantFormat):
    """Symmetric 4-bit: ``s = max|x| / 7``, codes -7..7 stored as ``code + 8``."""

    name: ClassVar[str] = "int4"
    bits: ClassVar[int] = 4

    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = _div_const(_absmax(xb), 7.0)
        _pack_float_nibbles(_safe_div(xb, s).round_().clamp_(-7, 7), 8.0, codes)
        return s

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        table = _nibble_table([c - 8.0 for c in range(16)], codes.device)
        return _decode_nibbles(codes, table, scales)

    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        return (_absmax(xb) / 7.0 / 2).expand_as(xb)


@dataclass(frozen=True, kw_only=True)
class E3M0(QuantFormat):
    """4-bit float with sign and 3 exponent bits, no mantissa (format in the module docstring)."""

    name: ClassVar[str] = "e3m0"
    bits: ClassVar[int] = 4

    def _encode_blocks(self, xb: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = _absmax(xb)
        y = _safe_div(xb, s)  # |y| <= 1
        # Rounding |y| to the nearest power of two in linear distance, ties up, on the fp32 bits:
        # with exponent E and mantissa M, |y| >= 1.5 * 2^(E-127) iff M >= 2^22, so adding 2^22
        # to the bits carries into the exponent exactly when |y| rounds up, and
        # k = ((bits + 2^22) >> 23) - 127 is log2 of the nearest power. The code is e = k + 7,
        # clamped to 1..7 for |y| >= 2^-7 (the halfway point between 0 and 2^-6) and 0 below.
        bits = y.abs().view(torch.int32)
        above = torch.bitwise_right_shift(bits, 23).sub_(119).clamp_(0, 1)  # 1 iff |y| >= 2^-7
        e = bits.add_(1 << 22).bitwise_right_shift_(23).sub_(120)
        torch.maximum(e, above, out=e).clamp_(0, 7)
        # the sign bit (8) only for nonzero magnitudes, so zero has the single code 0
        neg = torch.bitwise_right_shift(y.view(torch.int32), 31)  # -1 for negative, else 0
        e.sub_(neg.mul_(e.clamp(max=1)), alpha=8)
        packed = torch.add(e[..., 0::2], e[..., 1::2], alpha=16)
        codes.copy_(packed)
        return s

    def _decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        mags = [0.0] + [2.0 ** (i - 7) for i in range(1, 8)]
        table = _nibble_table(mags + [-m for m in mags], codes.device)
        return _decode_nibbles(codes, table, scales)

    def _bound_blocks(self, xb: torch.Tensor) -> torch.Tensor:
        s = _absmax(xb)
        return torch.maximum(xb.abs() / 3.0, (s * 2.0**-7).expand_as(xb))


# above this step, 255 * step overflows fp32 (decode then works in fp64)
_UINT8_STEP_LIMIT = torch.finfo(torch.float32).max / 256.0

#: format name -> constructor taking ``block=``
FORMATS: dict[str, type[QuantFormat]] = {
    "uint8": Uint8MinMax,
    "int8": Int8Symmetric,
    "int4": Int4Symmetric,
    "e3m0": E3M0,
}


def make_format(name: str, *, block: int = 128) -> QuantFormat:
    """Build a format by name: uint8, int8, fp8_e4m3, fp8_e5m2, int4, e3m0."""
    if name in ("fp8_e4m3", "fp8_e5m2"):
        return Fp8(block=block, kind=name[4:])
    cls = FORMATS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown quantization format {name!r}; use one of "
            f"{', '.join([*FORMATS, 'fp8_e4m3', 'fp8_e5m2'])}"
        )
    return cls(block=block)


def bits_per_value(fmt: QuantFormat) -> float:
    """Average payload bits per value including scales (for tables)."""
    return fmt.row_bytes(fmt.block) * 8 / fmt.block
