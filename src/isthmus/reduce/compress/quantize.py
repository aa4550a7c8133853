"""The bit-parity quantized all-reduce over the formats of :mod:`.formats`.

Quantized all-reduce with bit parity, after PCCL (Keiblinger et al., "Prime Collective
Communications Library -- Technical Report", arXiv 2505.14065, 2025): pad the flat tensor to ``world`` equal shards of
whole blocks; each peer quantizes each shard and an all-to-all sends shard ``j`` to peer ``j``;
the owner dequantizes the ``world`` copies, sums them in fp32 in rank order, quantizes the sum
once, and an all-gather of those bytes gives every peer the same bytes, which all dequantize
(owner included, so the owner's copy is the dequantized value too). The result therefore has
identical bits everywhere; it carries two quantization errors (the inputs' and the sum's).
On Gloo the all-to-all is :meth:`~isthmus.comm.group.Group.exchange`: the same slices to the
same peers, sent one shift at a time with one connection per direction, which moves the bytes at
about a ring's rate on shaped links where Gloo's own all_to_all falls well short.
Everything is elementwise or a fixed-order reduction, so CUDA tensors take the same path, and
give the CPU's bits: the scales divide by tensors, never by Python numbers (see
:func:`.formats._div_const`); tests/unit/test_cuda.py checks it where a GPU exists (it ran on an H100).

Several tensors (a model's parameters) go through the same two collectives: each tensor keeps
its own shard layout and blocks (so every value is quantized exactly as if the tensor were
reduced alone), and row ``j`` of every tensor's payload is concatenated into the one row sent to
peer ``j``. A model with 50 parameters thus costs 2 collectives per round, not 100; the bytes
are the same. Large tensors are cut into chunks of whole blocks that travel one after the other
while the next chunk is quantized (a two-deep pipeline), which hides the quantization behind the
transfer on slow links and bounds the temporaries; the bits are again the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.group import Group, wire_bytes

from .compressor import Compressor, NonFiniteError, all_finite, numel_of
from .formats import QuantFormat

__all__ = [
    "CHUNK_VALUES",
    "QuantConfig",
    "QuantizedAllReduce",
    "quantized_all_reduce",
    "quantized_all_reduce_many",
    "quantized_all_reduce_reference",
    "shard_layout",
]


def shard_layout(numel: int, world: int, fmt: QuantFormat) -> tuple[QuantFormat, int]:
    """(format with the block actually used, shard length) for an all-reduce of ``numel`` values.

    Shards are ``ceil(numel / world)`` values rounded up to whole blocks. For tensors smaller
    than ``world`` blocks the block shrinks to one shard (kept even for 4-bit formats), so a
    16-value bias is not padded to ``world * 128`` values. Every peer computes the same layout
    from the same numbers."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    per = max(1, -(-numel // world))
    block = min(fmt.block, per)
    if fmt.bits == 4 and block % 2:
        block += 1
    shard = -(-per // block) * block
    return (fmt if block == fmt.block else fmt.with_block(block)), shard


def _pad_edge(flat: torch.Tensor, total: int) -> torch.Tensor:
    n = flat.numel()
    if total == n:
        return flat
    return torch.cat((flat, flat[-1:].expand(total - n)))


def _sum_rows_in_order(rows: torch.Tensor) -> torch.Tensor:
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        acc += rows[i]
    return acc


def _encode_sum(f: QuantFormat, total: torch.Tensor) -> torch.Tensor:
    """The owner's one quantization of its summed shard. If the fp32 sum overflowed, the payload
    carries NaN scales instead of raising here: every peer then decodes NaN for that shard and
    rejects the result alike, rather than this owner alone raising while the others wait in
    the all-gather."""
    row = total.reshape(1, -1)
    try:
        return f.encode(row).reshape(-1)  # encode checks finiteness through the block scales
    except NonFiniteError:
        pass
    payload = f.encode(torch.zeros_like(row))
    cb = row.shape[1] * f.bits // 8
    nan = torch.full(((payload.shape[1] - cb) // 4,), float("nan"), device=payload.device)
    payload[0, cb:] = nan.view(torch.uint8)
    return payload.reshape(-1)


def quantized_all_reduce(
    group: Group, x: torch.Tensor, fmt: QuantFormat, *, contribute: bool = True
) -> torch.Tensor:
    """Sum the flat fp32 ``x`` over ``group`` in quantized form (scheme in the module docstring).

    Returns a new flat fp32 tensor with identical bits on every peer. ``x`` must be finite and is
    not modified; with ``contribute=False`` this peer's shards are zeros. Raises
    :class:`NonFiniteError` before sending if ``x`` holds NaN/Inf, and
    :class:`~isthmus.comm.group.CollectiveError` if a peer fails mid-way. If a shard's sum
    overflows fp32, that shard comes back as NaN on every peer (see :func:`_encode_sum`).
    """
    return quantized_all_reduce_many(group, [x], fmt, contribute=contribute)[0]


#: values of one peer's row per pipeline chunk (see quantized_all_reduce_many)
CHUNK_VALUES = 1 << 16


@dataclass(frozen=True)
class _Segment:
    """Values ``lo:hi`` of every shard row of tensor ``pos`` (whole blocks of ``f``)."""

    pos: int
    f: QuantFormat
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.f.row_bytes(self.hi - self.lo)


def _plan_chunks(
    layouts: list[tuple[int, QuantFormat, int, int]], chunk_values: int
) -> list[list[_Segment]]:
    """Cut every tensor's shard rows into segments of whole blocks and pack consecutive segments
    into chunks of about ``chunk_values`` values per row. Small tensors share one chunk; a large
    one spans several. Every peer computes the same plan from the same sizes."""
    chunks: list[list[_Segment]] = []
    cur: list[_Segment] = []
    size = 0
    for pos, f, shard, _ in layouts:
        step = max(f.block, chunk_values // f.block * f.block)
        for lo in range(0, shard, step):
            hi = min(shard, lo + step)
            cur.append(_Segment(pos, f, lo, hi))
            size += hi - lo
            if size >= chunk_values:
                chunks.append(cur)
                cur, size = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def quantized_all_reduce_many(
    group: Group,
    xs: Sequence[torch.Tensor],
    fmt: QuantFormat,
    *,
    contribute: bool = True,
    chunk_values: int = CHUNK_VALUES,
) -> list[torch.Tensor]:
    """:func:`quantized_all_reduce` of several tensors, sharing collectives and pipelined.

    Each result (flat fp32) has exactly the bits ``quantized_all_reduce`` gives for that tensor
    alone: blocks are independent, so cutting the work differently changes no value. The shard
    rows of all tensors are cut into chunks of about ``chunk_values`` values per row (whole
    blocks); each chunk is one all-to-all and one all-gather, and while one chunk travels the
    next is quantized and the previous one summed or decoded, so on a slow link the compute
    hides behind the transfer. A model's worth of small tensors is a single chunk: two
    collectives in all. Every peer must pass tensors of the same sizes in the same order; the
    collectives are issued in an order that depends on those sizes only. Raises
    :class:`NonFiniteError` before anything is sent if a contributed tensor holds NaN/Inf; other
    errors as :func:`quantized_all_reduce`.
    """
    if chunk_values < 1:
        raise ValueError(f"chunk_values must be >= 1, got {chunk_values}")
    world = group.world
    flats = [x.reshape(-1).to(torch.float32) for x in xs]
    if contribute and not all(all_finite(f) for f in flats):
        raise NonFiniteError(f"{fmt.name}: cannot quantize NaN/Inf values; nothing was sent")
    layouts: list[tuple[int, QuantFormat, int, int]] = []  # (position, format, shard, n)
    rows: dict[int, torch.Tensor] = {}  # position -> (world, shard): row j goes to peer j
    outs: dict[int, torch.Tensor] = {}
    for pos, flat in enumerate(flats):
        n = flat.numel()
        if n == 0:
            continue
        f, shard = shard_layout(n, world, fmt)
        if contribute:
            rows[pos] = _pad_edge(flat, shard * world).reshape(world, shard)
        layouts.append((pos, f, shard, n))
        outs[pos] = torch.empty(world, shard, dtype=torch.float32, device=flat.device)

    def rows_of(seg: _Segment) -> torch.Tensor:
        if contribute:
            return rows[seg.pos][:, seg.lo : seg.hi]
        return torch.zeros(world, seg.hi - seg.lo, device=flats[seg.pos].device)

    sent: deque[tuple[list[_Segment], int, Any]] = deque()  # all-to-alls in flight
    gathering: deque[tuple[list[_Segment], int, Any]] = deque()  # all-gathers in flight

    def send(chunk: list[_Segment]) -> None:
        parts = [seg.f.encode(rows_of(seg)) for seg in chunk]
        payload = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        h = group.exchange(payload.reshape(-1), async_op=True)
        sent.append((chunk, payload.shape[1], h))

    def sum_owned() -> None:
        # this peer owns one shard row of every tensor: sum the world copies, quantize once
        chunk, width, h = sent.popleft()
        received = h.wait().reshape(world, width)
        summed = []
        off = 0
        for seg in chunk:
            total = _sum_rows_in_order(
                seg.f.decode(received[:, off : off + seg.nbytes], seg.hi - seg.lo)
            )
            summed.append(_encode_sum(seg.f, total))
            off += seg.nbytes
        payload = summed[0] if len(summed) == 1 else torch.cat(summed)
        gathering.append((chunk, width, group.all_gather_flat(payload, async_op=True)))

    def unpack() -> None:
        chunk, width, h = gathering.popleft()
        gathered = h.wait().reshape(world, width)
        off = 0
        for seg in chunk:
            dec = seg.f.decode(gathered[:, off : off + seg.nbytes], seg.hi - seg.lo)
            outs[seg.pos][:, seg.lo : seg.hi] = dec
            off += seg.nbytes

    # A two-deep software pipeline. The issue order (all-to-all c+1 before all-gather c) depends
    # on the plan only, so it is the same on every peer.
    for chunk in _plan_chunks(layouts, chunk_values):
        send(chunk)
        if len(sent) > 1:
            sum_owned()
        if len(gathering) > 1:
            unpack()
    while sent:
        sum_owned()
        if len(gathering) > 1:
            unpack()
    while gathering:
        unpack()

    # empty tensors come back as (cloned) empty tensors; the rest are views of the outputs
    results = [
        outs[pos].reshape(-1)[: flat.numel()] if pos in outs else flat.clone()
        for pos, flat in enumerate(flats)
    ]
    return results


def quantized_all_reduce_reference(
    inputs: Sequence[torch.Tensor], fmt: QuantFormat
) -> torch.Tensor:
    """Single-process simulation of :func:`quantized_all_reduce` over ``len(inputs)`` peers.

    Pure: no network. The distributed version must return exactly these bits."""
    world = len(inputs)
    flats = [t.reshape(-1).to(torch.float32) for t in inputs]
    n = flats[0].numel()
    if n == 0:
        return flats[0].clone()
    f, shard = shard_layout(n, world, fmt)
    # what each peer puts on the wire, shard by shard
    wire = [f.encode(_pad_edge(v, shard * world).reshape(world, shard)) for v in flats]
    out = []
    for owner in range(world):
        copies = torch.stack([wire[p][owner] for p in range(world)])
        total = _sum_rows_in_order(f.decode(copies, shard))
        out.append(f.decode(_encode_sum(f, total).reshape(1, -1), shard).reshape(-1))
    return torch.cat(out)[:n]


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Options of the quantized all-reduce (specs ``int8``, ``int4:block=64``, ...); the format
    itself is the spec's name. A 4-bit format also needs an even block, checked when it is
    built (:func:`~isthmus.reduce.compress.formats.make_format`)."""

    #: values per block; each block has its own scale(s). Smaller blocks: more accurate, more bytes
    block: int = 128

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block!r}")


class QuantizedAllReduce(Compressor):
    """Compressor running :func:`quantized_all_reduce` in a given format. Stateless."""

    def __init__(self, fmt: QuantFormat) -> None:
        super().__init__()
        self.fmt = fmt
        self.name = fmt.spec

    def _reduce_one(
        self, group: Group, key: str, x: torch.Tensor, contribute: bool
    ) -> torch.Tensor:
        return quantized_all_reduce(group, x, self.fmt, contribute=contribute)

    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        return quantized_all_reduce_many(
            group, [x for _, x in items], self.fmt, contribute=contribute
        )

    def predict_bytes(self, shape: int | Sequence[int], world: int) -> int:
        n = numel_of(shape)
        if n == 0 or world <= 1:
            return 0
        f, shard = shard_layout(n, world, self.fmt)
        rb = f.row_bytes(shard)
        return wire_bytes("all_to_all", world * rb, world) + wire_bytes("all_gather", rb, world)
