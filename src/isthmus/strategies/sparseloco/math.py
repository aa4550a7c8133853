"""SparseLoCo's compressor and its message, as pure functions (no network, no model).

Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
arXiv:2508.15706 (2025); reference code tplr-ai/SparseLoCo (its compressor descends from
bloc97/DeMo's chunked top-k).

Each peer compresses its error-feedback accumulator ``e`` (one fp32 tensor per parameter):

1. **chunk-wise top-k**: the flattened tensor is cut into chunks of ``chunk`` elements (the last
   one may be shorter); in each chunk the ``k`` entries of largest magnitude are kept
   (``min(k, len)`` in a short chunk). The reference tiles matrices into 2-D 64 x 64 blocks;
   isthmus takes 1-D chunks of the flattened tensor (the same 4096 elements per chunk by
   default, but rows of a matrix rather than square tiles).
2. **quantization** of the kept values to ``bits`` bits, per parameter, with the reference's
   statistical quantizer: ``shift = mean(v)``, ``c = v - shift``, ``scale = 6 * std(c) / L``
   (``L = 2**bits`` levels, unbiased std; 1.0 if that is 0 or not finite), code
   ``clamp(round(c / scale + L // 2), 0, L - 1)``, and each level decodes to the mean of the
   ``c`` that fell in it (0 for an empty level) plus ``shift``. With one bit that grid would
   put everything above -1.5 std in one level, so ``bits=1`` splits at the mean instead: code
   ``c >= 0``, each side decoding to its own mean. ``bits=32`` sends the float32 values
   themselves.

The message of one peer is a fixed-size byte string (every peer of a run computes the same size
from the shapes and the config, so it can be all-gathered)::

    header   4 * (1 + E) bytes: float32 [present, exact values...]
             (E exact values: the strategy's step count and floating buffers)
    per parameter with K kept entries (K = sum over chunks of min(k, chunk length)):
        indices  2 * K bytes: int16, the position inside its chunk (chunk <= 32768)
        codes    ceil(bits * K / 8) bytes: packed little-endian, 8 / bits codes per byte
        table    4 * (2**bits + 1) bytes: float32 [shift, level means...]
    (bits=32: values 4 * K bytes of float32 and no table)

:meth:`SparseCodec.payload_bytes` is that size; :func:`sum_messages` decodes the messages of a
round in rank order and sums them into dense fp32 tensors, skipping absent ones, so that every
peer, holding the same bytes, computes the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Decoded",
    "SparseCodec",
    "Windows",
    "in_window",
    "pack_codes",
    "quantize",
    "read_header",
    "sum_messages",
    "sum_present",
    "topk_rows",
    "unpack_codes",
]

QUANT_RANGE = 6.0
"""The quantizer's range in standard deviations (the reference's ``quantization_range``)."""
_BITS = (1, 2, 4, 8, 32)


def topk_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest magnitude of each row of a 2-D tensor: (positions int64,
    values), both ``[rows, k]``, positions in ascending order within a row (so the message does
    not depend on how torch.topk orders its result). Ties between equal magnitudes are broken
    by torch.topk, on the sender only: receivers read the positions from the message."""
    _, idx = torch.topk(rows.abs(), k, dim=1, largest=True, sorted=False)
    idx, _ = torch.sort(idx, dim=1)
    return idx, torch.gather(rows, 1, idx)


def quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float32 vector to ``bits`` bits (see the module docstring). Returns
    (codes uint8, table float32 ``[shift, level means...]``); decode with ``table[1:][codes] +
    table[0]``. An empty vector gives empty codes and a table of zeros."""
    levels = 2**bits
    if v.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(levels + 1)
    v = v.to(torch.float32)
    shift = v.mean()
    c = v - shift
    n = c.numel()
    std = c.norm() / math.sqrt(n - 1) if n > 1 else torch.zeros(())
    scale = float(QUANT_RANGE * std / levels)
    if not (scale > 0 and math.isfinite(scale)):
        scale = 1.0
    if bits == 1:
        # the grid below centres level 1 of {0, 1} on the mean: one level would hold all but the
        # lowest values, and the code would carry almost nothing; split at the mean instead
        codes = (c >= 0).to(torch.uint8)
    else:
        codes = torch.clamp(torch.round(c / scale + levels // 2), 0, levels - 1).to(torch.uint8)
    sums = torch.zeros(levels).index_add_(0, codes.long(), c)
    counts = torch.zeros(levels).index_add_(0, codes.long(), torch.ones(n))
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros(()))
    return codes, torch.cat([shift.view(1), means])


def read_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a message as ``dtype`` (copied: a slice at an odd offset cannot be viewed)."""
    return raw.clone().view(dtype)


def read_header(msg: torch.Tensor, size: int, header: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A message of ``size`` bytes, contiguous, and its float32 header (its first ``header``
    bytes: present, exact values...). Raises ValueError for a message of another size."""
    if msg.numel() != size:
        raise ValueError(f"a message of {msg.numel()} bytes, expected {size}")
    msg = msg.contiguous()
    return msg, read_as(msg[:header], torch.float32)


def dequantize(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[1:][codes.long()] + table[0]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` bits (1, 2, 4 or 8), little-endian within a byte:
    ``ceil(bits * n / 8)`` bytes."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8)
    padded[:n] = codes
    grid = padded.view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (grid << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    grid = (packed.to(torch.int32).view(-1, 1) >> shifts) & (2**bits - 1)
    return grid.reshape(-1)[:n].to(torch.uint8)


@dataclass(frozen=True)
class _Layout:
    numel: int
    full: int  # chunks of exactly `chunk` elements
    tail: int  # elements in the last, shorter chunk (0: none)
    k_full: int
    k_tail: int

    @property
    def kept(self) -> int:
        return self.full * self.k_full + self.k_tail


@dataclass
class Decoded:
    """One peer's decoded message: whether it is present, its exact values (step count and
    buffers, fp32) and, per parameter, the flat positions and the values to add there."""

    present: bool
    exact: torch.Tensor
    entries: list[tuple[torch.Tensor, torch.Tensor]]


class SparseCodec:
    """Chunk-wise top-k plus quantization of a list of tensors of fixed shapes, into SparseLoCo's
    fixed-size message (see the module docstring). Raises ValueError for a chunk outside 1 to
    32768, ``k`` < 1 or bits other than 1, 2, 4, 8 or 32."""

    def __init__(
        self, shapes: Sequence[torch.Size], chunk: int, k: int, bits: int, exact: int = 0
    ) -> None:
        if not 1 <= chunk <= 32768:
            raise ValueError(f"chunk must be 1 to 32768 (positions travel as int16), got {chunk}")
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        if bits not in _BITS:
            raise ValueError(f"bits must be one of {_BITS}, got {bits}")
        self.chunk, self.k, self.bits, self.exact = chunk, k, bits, exact
        self.layouts = []
        for s in shapes:
            n = math.prod(s)
            full, tail = divmod(n, chunk)
            self.layouts.append(_Layout(n, full, tail, min(k, chunk), min(k, tail)))

    @property
    def header_bytes(self) -> int:
        return 4 * (1 + self.exact)

    def param_bytes(self, i: int) -> int:
        kept = self.layouts[i].kept
        if self.bits == 32:
            return 2 * kept + 4 * kept
        return 2 * kept + -(-self.bits * kept // 8) + 4 * (2**self.bits + 1)

    @property
    def payload_bytes(self) -> int:
        """The size of every peer's message, in bytes."""
        return self.header_bytes + sum(self.param_bytes(i) for i in range(len(self.layouts)))

    @property
    def density(self) -> float:
        """Kept entries over all entries."""
        total = sum(lay.numel for lay in self.layouts)
        return sum(lay.kept for lay in self.layouts) / max(1, total)

    def _select(self, flat: torch.Tensor, lay: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions within their chunk, flat positions, values) of the kept entries."""
        pos, vals = [], []
        if lay.full:
            idx, v = topk_rows(flat[: lay.full * self.chunk].view(lay.full, self.chunk), lay.k_full)
            pos.append(idx.reshape(-1))
            vals.append(v.reshape(-1))
        if lay.tail:
            idx, v = topk_rows(flat[lay.full * self.chunk :].view(1, lay.tail), lay.k_tail)
            pos.append(idx.reshape(-1))
            vals.append(v.reshape(-1))
        if not pos:  # a parameter with no elements keeps nothing
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
        return torch.cat(pos), torch.cat(vals)

    def _flat_positions(self, local: torch.Tensor, lay: _Layout) -> torch.Tensor:
        base = torch.arange(lay.full, dtype=torch.int64).repeat_interleave(lay.k_full) * self.chunk
        if lay.tail:
            base = torch.cat([base, torch.full((lay.k_tail,), lay.full * self.chunk)])
        return base + local

    def encode(
        self, tensors: Sequence[torch.Tensor], exact: torch.Tensor | None, present: bool = True
    ) -> torch.Tensor:
        """The message (uint8, :attr:`payload_bytes` long) for ``tensors`` (the accumulators)
        and ``exact`` (``self.exact`` fp32 values). An absent message (``present=False``) has
        the same size and carries nothing that will be read. Raises ValueError for tensors of
        other sizes."""
        parts = [self._header(exact, present)]
        for t, lay in zip(tensors, self.layouts, strict=True):
            flat = t.detach().reshape(-1).to(torch.float32)
            if flat.numel() != lay.numel:
                raise ValueError(f"a tensor of {flat.numel()} elements, expected {lay.numel}")
            local, vals = self._select(flat, lay)
            parts.append(local.to(torch.int16).view(torch.uint8))
            if self.bits == 32:
                parts.append(vals.contiguous().view(torch.uint8))
            else:
                codes, table = quantize(vals, self.bits)
                parts.append(pack_codes(codes, self.bits))
                parts.append(table.view(torch.uint8))
        msg = torch.cat(parts)
        assert msg.numel() == self.payload_bytes
        return msg

    def _header(self, exact: torch.Tensor | None, present: bool) -> torch.Tensor:
        head = torch.zeros(1 + self.exact)
        head[0] = 1.0 if present else 0.0
        if exact is not None:
            head[1:] = exact.to(torch.float32)
        return head.view(torch.uint8)

    def decode(self, msg: torch.Tensor) -> Decoded:
        """Read one message (the bytes :meth:`encode` made). Raises ValueError for a message of
        another size."""
        msg, head = read_header(msg, self.payload_bytes, self.header_bytes)
        off = self.header_bytes
        entries = []
        for i, lay in enumerate(self.layouts):
            kept = lay.kept
            local = read_as(msg[off : off + 2 * kept], torch.int16).to(torch.int64)
            off += 2 * kept
            if self.bits == 32:
                vals = read_as(msg[off : off + 4 * kept], torch.float32)
                off += 4 * kept
            else:
                nb = -(-self.bits * kept // 8)
                codes = unpack_codes(msg[off : off + nb], self.bits, kept)
                off += nb
                table = read_as(msg[off : off + 4 * (2**self.bits + 1)], torch.float32)
                off += 4 * (2**self.bits + 1)
                vals = dequantize(codes, table)
            entries.append((self._flat_positions(local, lay), vals))
            assert off == self.header_bytes + sum(self.param_bytes(j) for j in range(i + 1))
        return Decoded(bool(head[0] == 1.0), head[1:].clone(), entries)

    def dense(self, decoded: Decoded, windows: Windows | None = None) -> list[torch.Tensor]:
        """One decoded message as dense fp32 tensors (flat): what its sender removes from its
        accumulator; with ``windows``, only the flat elements ``[a, b)`` of each tensor (a
        shard's part of it)."""
        wins = windows or [(0, lay.numel) for lay in self.layouts]
        out = []
        for (pos, vals), (a, b) in zip(decoded.entries, wins, strict=True):
            pos, vals = in_window(pos, vals, a, b)
            out.append(torch.zeros(b - a).index_put_((pos,), vals))
        return out


Windows = Sequence[tuple[int, int]]
"""Per tensor, the flat elements ``[a, b)`` of the whole tensor that a rank holds."""


def in_window(
    pos: torch.Tensor, vals: torch.Tensor, a: int, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries at flat positions ``[a, b)``, their positions made relative to ``a``."""
    keep = (pos >= a) & (pos < b)
    return pos[keep] - a, vals[keep]


def sum_messages(
    codec: SparseCodec, messages: Sequence[torch.Tensor], windows: Windows | None = None
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Decode a round's messages (in rank order) and sum the present ones, in that order, into
    dense flat fp32 tensors (one per parameter; with ``windows``, each one's elements ``[a,
    b)`` only) and the exact values. Returns (sums, exact sum, number present)."""
    sizes = [lay.numel for lay in codec.layouts]
    return sum_present(codec.decode, sizes, codec.exact, messages, windows)


def sum_present(
    decode: Callable[[torch.Tensor], Decoded],
    sizes: Sequence[int],
    exact_len: int,
    messages: Sequence[torch.Tensor],
    windows: Windows | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Sum the present messages' entries (``decode``: a message's positions and values, one
    pair per dense fp32 vector of ``sizes``) and exact values, in the messages' order. Returns
    (sums, exact sum, number present). Positions are distinct within one message, so each
    addition is a plain sum per element and the result depends only on the bytes and their
    order; with ``windows`` (a shard's flat elements ``[a, b)`` of each vector) every element
    of a window gets the same additions in the same order, so its bits are the whole sum's."""
    wins = windows or [(0, n) for n in sizes]
    sums = [torch.zeros(b - a) for a, b in wins]
    exact = torch.zeros(exact_len)
    present = 0
    for msg in messages:
        d = decode(msg)
        if not d.present:
            continue
        present += 1
        exact += d.exact
        for s, (pos, vals), (a, b) in zip(sums, d.entries, wins, strict=True):
            s.index_add_(0, *in_window(pos, vals, a, b))
    return sums, exact, present
