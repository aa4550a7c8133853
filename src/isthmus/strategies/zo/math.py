"""The pure math of zeroth-order training with shared randomness (the ``zo`` strategy).

Everything here takes tensors and numbers and never touches the network, so every rule is tested
in one process; :mod:`isthmus.strategies.zo` runs it inside isthmus's rounds.

**Seeds.** The perturbation ``k`` of the member at rank ``rank`` in round ``round_`` of a run with
seed ``run_seed`` has the seed :func:`perturbation_seed` (BLAKE2b of the four integers, 63 bits),
and the ``j``-th distinct parameter of the model draws its part of ``z`` from a CPU
``torch.Generator`` seeded with :func:`tensor_seed` (BLAKE2b of that seed and ``j``). Every peer
knows the round and the ranks (a round's members are ranked by peer name), so no seed travels.

**Identical z on every device** (:func:`perturbation`): ``z`` is drawn on the CPU in float64 with
``torch.randn``, cast to the parameter's dtype on the CPU, then moved to the parameter's device.
float64 because torch's float32 ``randn`` on the CPU picks a kernel by instruction set, and two
kernels' float32 streams may differ in the last bits where their float64 streams agree, so float32
draws could differ between machines. The cost: a float64 draw and a cast of every parameter on
the CPU, plus a host-to-device copy for an accelerator, for each perturbation applied; it is not
hidden behind the forward passes.

**Tied parameters.** Parameters that are the same tensor (or views of the same memory with the
same shape and strides) are perturbed and updated once: :func:`distinct` keeps the first of each.
Two parameters that overlap in memory without being the same view cannot be perturbed
independently: :func:`distinct` raises ValueError for them.

**Quantization** (:class:`ScalarCodec`): see its docstring for the exact rule; with ``bits=8`` a
projected gradient is one byte on the wire.

**The update** (:func:`apply_update`): see its docstring; it is the same arithmetic, in the same
order, on every peer, and is written as separately rounded elementwise operations so that a CPU
and a CUDA peer compute the same bits.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ScalarCodec",
    "Span",
    "apply_update",
    "decayed",
    "distinct",
    "float32",
    "perturb_",
    "perturbation",
    "perturbation_seed",
    "projected_gradient",
    "tensor_seed",
]

_MASK63 = (1 << 63) - 1


def _hash_ints(*parts: int) -> int:
    # BLAKE2b over fixed-width little-endian integers: the same on every machine and Python
    # version (``hash()`` is salted per process, ``random`` streams may change between releases).
    # 63 bits so that the value is a valid seed for ``torch.Generator.manual_seed`` everywhere.
    data = b"isthmus-zo" + b"".join(struct.pack("<q", p) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK63


def perturbation_seed(run_seed: int, round_: int, rank: int, k: int = 0) -> int:
    """The seed of perturbation ``k`` of the member at ``rank`` in round ``round_``.

    Raises ``struct.error`` for a part outside the signed 64-bit range (a negative round or rank
    is accepted but never produced by a session)."""
    return _hash_ints(run_seed, round_, rank, k)


def tensor_seed(seed: int, index: int) -> int:
    """The ``torch.Generator`` seed of the ``index``-th distinct parameter under ``seed``."""
    return _hash_ints(seed, index)


def distinct(params: Sequence[torch.Tensor]) -> list[int]:
    """Indices (into ``params``) of the parameters to perturb: the first of every group that
    shares memory with the same view (tied weights, a parameter listed twice).

    Raises ValueError for two parameters that overlap in memory as different views: their
    perturbations would add up in the shared elements, which no peer could reproduce from the
    seeds alone."""
    seen: dict[tuple[object, ...], int] = {}
    spans: list[tuple[torch.device, int, int, int]] = []  # device, start, end, index
    keep: list[int] = []
    for i, p in enumerate(params):
        if p.numel() == 0:
            keep.append(i)
            continue
        start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
        key = (p.device, start, tuple(p.shape), tuple(p.stride()), p.dtype)
        if key in seen:
            continue
        # the span in bytes of the view (an over-estimate for strided views is fine: it only
        # makes the overlap test stricter)
        end = (
            start
            + (1 + sum((s - 1) * st for s, st in zip(p.shape, p.stride(), strict=True)))
            * p.element_size()
        )
        for dev, s0, e0, j in spans:
            if dev == p.device and start < e0 and s0 < end:
                raise ValueError(
                    f"parameters {j} and {i} overlap in memory as different views: zeroth-order "
                    f"perturbations need parameters that are either the same tensor or disjoint"
                )
        seen[key] = i
        spans.append((p.device, start, end, i))
        keep.append(i)
    return keep


Span = tuple[tuple[int, ...], int, int]
"""A shard of a parameter: the whole tensor's shape and the flat elements ``[start, stop)`` of
it that the shard holds (FSDP2's ``Shard(0)`` rows are one such run)."""


def perturbation(
    seed: int, index: int, like: torch.Tensor, span: Span | None = None
) -> torch.Tensor:
    """``z`` for the ``index``-th distinct parameter under ``seed``: standard normal, shaped like
    ``like``, in its dtype, on its device; the same bits on every device (see the module
    docstring). With ``span``, ``like`` is a shard of a whole tensor: ``z`` is drawn over the
    whole tensor (the generator cannot skip ahead) and the shard's elements are kept, so each
    shard's ``z`` has the bits of the whole ``z`` there. A fresh tensor the caller may change
    in place."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(tensor_seed(seed, index))
    if span is None:
        z = torch.randn(like.shape, generator=gen, dtype=torch.float64)
    else:
        shape, start, stop = span
        z = torch.randn(shape, generator=gen, dtype=torch.float64).reshape(-1)[start:stop]
        z = z.reshape(like.shape)
    return z.to(dtype=like.dtype).to(device=like.device)


def perturb_(
    params: Sequence[torch.Tensor],
    keep: Sequence[int],
    seed: int,
    scale: float,
    spans: Sequence[Span | None] | None = None,
) -> None:
    """``p += scale * z`` in place for every parameter in ``keep`` (from :func:`distinct`), each
    with its own slice of ``z`` under ``seed`` (``spans[i]``: parameter ``i`` is a shard, see
    :func:`perturbation`). Used for the loss evaluations only: the shared state is restored
    from a copy afterwards, so this arithmetic need not agree across devices. Call it under
    ``torch.no_grad()`` (autograd refuses in-place changes of leaf parameters)."""
    for j, i in enumerate(keep):
        p = params[i]
        p.add_(perturbation(seed, j, p, spans[i] if spans else None), alpha=scale)


def projected_gradient(loss_plus: float, loss_minus: float, eps: float) -> float:
    """MeZO's SPSA estimate of the directional derivative along ``z``:
    ``(L(theta + eps z) - L(theta - eps z)) / (2 eps)``, in float64. Non-finite when a loss is."""
    return (float(loss_plus) - float(loss_minus)) / (2.0 * eps)


def float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as a Python float; beyond float32's range, an
    infinity of its sign, NaN stays NaN). A coefficient that is exactly a float32 is used with
    the same value by every device, whatever precision its kernels take scalars in."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:  # struct refuses what rounds to an infinity
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class ScalarCodec:
    """Quantize projected gradients to ``bits`` bits, and pack a list of them into bytes.

    ``bits`` from 3 to 16: a sign and a logarithmic magnitude. Codes are integers in
    ``[-L, L]`` with ``L = 2**(bits-1) - 1`` (127 for 8 bits); the code ``-2**(bits-1)`` (-128)
    means *absent* (a member whose work must not count, or a non-finite estimate). Code 0 is
    the value 0; code ``+-k`` (``1 <= k <= L``) is ``+-m_k`` with the geometric grid
    ``m_k = g_min * rho**(k-1)``, ``rho = (g_max / g_min)**(1/(L-1))`` (for 8 bits and the
    defaults 1e-3..1e3, ``rho`` is about 1.116: levels 11.6% apart, at most about 5.6% relative
    error inside the range). Encoding rounds ``1 + ln(|g|/g_min) / ln(rho)`` to the nearest integer
    ``k``: ``k < 1`` (``|g|`` below ``g_min / sqrt(rho)``) gives 0 (flushed to zero), ``k > L``
    gives ``L`` (clipped to ``g_max``, keeping the sign). Decoding reads the level from a table
    of float32 values computed once (math.exp in float64, rounded to float32): peers whose libm
    differ in the last bit of a double agree on every level except with a vanishing probability,
    and the parity check would repair one that did not.

    ``bits`` 32: no quantization; the float32 bits of the estimate (absent: a NaN).

    On the wire: ``count`` codes as unsigned ``u = code + 2**(bits-1)`` (32 bits: the float's
    bits), packed little-endian, ``bits`` each, into ``ceil(bits * count / 8)`` bytes.

    Raises ValueError on construction for other ``bits`` or a range with ``0 < g_min < g_max``
    false.
    """

    bits: int = 8
    g_min: float = 1e-3
    g_max: float = 1e3

    def __post_init__(self) -> None:
        if self.bits != 32 and not 3 <= self.bits <= 16:
            raise ValueError(
                f"bits must be 3 to 16 (a logarithmic code) or 32 (float32), got {self.bits}"
            )
        if not (0 < self.g_min < self.g_max and math.isfinite(self.g_max)):
            raise ValueError(
                f"the range needs 0 < g_min < g_max (finite), got g_min={self.g_min}, "
                f"g_max={self.g_max}"
            )
        if self.bits != 32:
            step = math.log(self.g_max / self.g_min) / (self.levels - 1)
            table = tuple(
                float32(math.exp(math.log(self.g_min) + k * step)) for k in range(self.levels)
            )
            object.__setattr__(self, "_step", step)
            object.__setattr__(self, "_table", table)

    @property
    def levels(self) -> int:
        """``L``: magnitude levels per sign (127 for 8 bits)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def absent(self) -> int:
        """The code of an absent estimate (the wire value 0)."""
        return -(1 << (self.bits - 1))

    def payload_bytes(self, count: int) -> int:
        """Bytes of ``count`` packed codes: ``ceil(bits * count / 8)``."""
        return (self.bits * count + 7) // 8

    # -- one scalar -------------------------------------------------------------------------------
    def encode(self, g: float | None) -> int:
        """The code of ``g`` (None or non-finite: absent). Never raises for a float."""
        if self.bits == 32:
            # beyond float32's range the estimate is as useless as a NaN: absent too
            x = math.nan if g is None or not math.isfinite(float32(g)) else float32(g)
            return int(struct.unpack("<I", struct.pack("<f", x))[0])
        if g is None or not math.isfinite(g):
            return self.absent
        if g == 0.0:
            return 0
        step: float = self._step  # type: ignore[attr-defined]
        # two logs, not log(|g| / g_min): the quotient of a tiny |g| can underflow to 0
        k = round(1.0 + (math.log(abs(g)) - math.log(self.g_min)) / step)
        if k < 1:
            return 0
        k = min(k, self.levels)
        return k if g > 0 else -k

    def decode(self, code: int) -> float | None:
        """The value of ``code`` (None: absent). Raises ValueError for a code outside the range
        (a corrupted payload)."""
        if self.bits == 32:
            x = float(struct.unpack("<f", struct.pack("<I", code & 0xFFFFFFFF))[0])
            return x if math.isfinite(x) else None
        if code == self.absent:
            return None
        if not -self.levels <= code <= self.levels:
            raise ValueError(f"code {code} is outside [{-self.levels}, {self.levels}]")
        if code == 0:
            return 0.0
        table: tuple[float, ...] = self._table  # type: ignore[attr-defined]
        m = table[abs(code) - 1]
        return m if code > 0 else -m

    def quantize(self, g: float | None) -> float | None:
        """``decode(encode(g))``: the value every peer applies for ``g``."""
        return self.decode(self.encode(g))

    # -- a list of scalars, on the wire -----------------------------------------------------------
    def pack(self, codes: Sequence[int]) -> torch.Tensor:
        """``codes`` packed into a uint8 tensor of :meth:`payload_bytes` bytes (see the class
        docstring for the layout)."""
        offset = 0 if self.bits == 32 else 1 << (self.bits - 1)
        mask = (1 << self.bits) - 1
        acc = 0
        for i, c in enumerate(codes):
            acc |= ((c + offset) & mask) << (self.bits * i)
        raw = acc.to_bytes(self.payload_bytes(len(codes)), "little")
        return torch.tensor(list(raw), dtype=torch.uint8)

    def unpack(self, payload: torch.Tensor, count: int) -> list[int]:
        """The ``count`` codes packed in ``payload`` (a uint8 tensor). Raises ValueError for a
        payload of another length."""
        raw = bytes(payload.to(device="cpu", dtype=torch.uint8).reshape(-1).tolist())
        if len(raw) != self.payload_bytes(count):
            raise ValueError(
                f"a payload of {count} codes of {self.bits} bits has "
                f"{self.payload_bytes(count)} bytes, got {len(raw)}"
            )
        acc = int.from_bytes(raw, "little")
        offset = 0 if self.bits == 32 else 1 << (self.bits - 1)
        mask = (1 << self.bits) - 1
        return [((acc >> (self.bits * i)) & mask) - offset for i in range(count)]


def decayed(params: Sequence[torch.Tensor]) -> list[bool]:
    """Which parameters weight decay applies to: matrices and embeddings (two or more
    dimensions), not biases and norm gains, as MeZO leaves out biases and LayerNorm weights."""
    return [p.dim() >= 2 for p in params]


def apply_update(
    params: Sequence[torch.Tensor],
    keep: Sequence[int],
    seeds: Sequence[int],
    estimates: Sequence[float | None],
    *,
    lr: float,
    weight_decay: float = 0.0,
    decay: Sequence[bool] | None = None,
    spans: Sequence[Span | None] | None = None,
) -> int:
    """Apply one round's update in place and return ``N``, the number of estimates applied.

    ``seeds[m]`` and ``estimates[m]`` are the round's perturbations in the fixed order (member
    rank, then perturbation index) and their dequantized projected gradients (None: absent).
    With ``N`` the number of present estimates:

    1. ``N == 0``: nothing changes.
    2. If ``weight_decay > 0``: ``p *= float32(1 - lr * weight_decay)`` for every parameter in
       ``keep`` whose ``decay`` flag is set (default :func:`decayed`).
    3. For each present, nonzero estimate ``g_m`` in order, for each parameter in ``keep``:
       ``z = perturbation(seeds[m], j, p)``; ``z *= c_m``; ``p -= z`` with
       ``c_m = float32(lr * g_m / N)``.

    That is ``theta <- (1 - lr wd) theta - lr/N sum_m g_m z_m`` (MeZO's ``theta - lr (g z + wd
    theta)`` for one estimate, up to rounding), each step a separately rounded elementwise float
    operation on a float32 coefficient, so CPU and CUDA give the same bits (no fused
    multiply-add can merge them). Every operation is elementwise, so a shard (``spans[i]``, see
    :func:`perturbation`) lands the bits of the whole tensor's update there. Call under
    ``torch.no_grad()``. Raises ValueError if ``seeds`` and ``estimates`` differ in length."""
    if len(seeds) != len(estimates):
        raise ValueError(f"{len(seeds)} seeds but {len(estimates)} estimates")
    present = [(s, g) for s, g in zip(seeds, estimates, strict=True) if g is not None]
    n = len(present)
    if n == 0:
        return 0
    if weight_decay > 0:
        flags = decayed(params) if decay is None else list(decay)
        factor = float32(1.0 - lr * weight_decay)
        for i in keep:
            if flags[i]:
                params[i].mul_(factor)
    for seed, g in present:
        if g == 0.0:
            continue  # z * 0 changes nothing; skipping it saves regenerating z
        coef = float32(lr * g / n)
        for j, i in enumerate(keep):
            p = params[i]
            z = perturbation(seed, j, p, spans[i] if spans else None)
            z.mul_(coef)
            p.sub_(z)
    return n
