"""Striping one collective over K process groups, each with TCP connections of its own.

Why: over a long fat pipe (a fast link with a long round trip) one TCP connection is held back by
its window and by slow start after every loss, so a ring all-reduce on one connection per peer
pair moves only a fraction of the link (docs/BENCHMARKS.md has the figures). Splitting each
transfer over many connections lifts that: an epoch builds ``K`` Gloo groups over the same
members (``SessionConfig.connections``), a buffer is cut into at most ``K`` contiguous spans, and
span ``i`` travels on group ``i``, all at once.

Parity: each span is reduced by Gloo as if it were a buffer of its own, so an element may be
summed in another order than with one group (the ring's segment boundaries move), but every
member still ends with the same bits, because every member cuts the same spans (they depend on
the length, the element size and ``K`` only) and Gloo gives all members one result per span.

Nothing here waits without a bound: the works are waited by
:class:`~isthmus.comm.group.Handle`, which bounds and aborts them; a failure in any span raises
from :meth:`Works.wait` and the group is aborted, which cuts every stripe's connections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from isthmus.coordinator.wire import PROTOCOL_VERSION, ProtocolMismatch, version_mismatch

__all__ = [
    "HANDSHAKE_WISHES",
    "MIN_STRIPE_BYTES",
    "Works",
    "all_gather_flat",
    "all_reduce",
    "connect_stripes",
    "reverse_sets",
    "spans",
]

#: A span is at least this long (bar the last when the buffer is short): a smaller one would
#: add a round of Gloo's latency for bytes that a single connection moves at once anyway.
MIN_STRIPE_BYTES = 16 * 1024

#: How many wishes the epoch handshake carries. Its tensor has a fixed layout, ``[protocol,
#: -protocol, k, -k, wish...]`` padded to this many wishes, so that a member of another protocol
#: version reduces a tensor of the same length and is refused by name instead of failing inside
#: Gloo; a version that changes the layout must keep the first two slots and the length.
HANDSHAKE_WISHES = 4


def spans(numel: int, element_size: int, k: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges cutting ``numel`` elements into at most ``k`` contiguous spans
    of near-equal length, each at least :data:`MIN_STRIPE_BYTES` long (so a short buffer gets
    fewer spans, down to one). Pure: every member computes the same spans for the same buffer.

    Raises ValueError for ``k < 1`` or a negative length."""
    if k < 1 or numel < 0 or element_size < 1:
        raise ValueError(f"spans needs k >= 1, numel >= 0, element_size >= 1: {k}, {numel}")
    n = max(1, min(k, numel * element_size // MIN_STRIPE_BYTES))
    base, extra = divmod(numel, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class Works:
    """Several torch works as one, for :class:`~isthmus.comm.group.Handle`: no future (so the
    handle waits on a thread of its own), :meth:`wait` waits each work, then runs ``then`` (a
    copy of the received spans into place). The first failure propagates; the handle then aborts
    the group, whose cut ends the other stripes' works too."""

    def __init__(self, works: Sequence[Any], then: Callable[[], None] | None = None) -> None:
        self.works = list(works)
        self._then = then

    def get_future(self) -> Any:
        raise RuntimeError("striped works have no single future; wait() waits them all")

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self._then is not None:
            self._then()


def all_reduce(pgs: Sequence[Any], t: torch.Tensor, opts: Any) -> Any:
    """Issue Gloo's all-reduce of ``t`` (in place) span by span over ``pgs``; returns the work
    (one group's own work when one span suffices or ``t`` is not contiguous, else a
    :class:`Works`). Raises what Gloo raises at issue time."""
    cuts = spans(t.numel(), t.element_size(), len(pgs))
    if len(cuts) == 1 or not t.is_contiguous():
        return pgs[0].allreduce([t], opts)
    flat = t.view(-1)
    return Works(
        [
            pg.allreduce([flat[lo:hi]], opts)
            for pg, (lo, hi) in zip(pgs[: len(cuts)], cuts, strict=True)
        ]
    )


def all_gather_flat(pgs: Sequence[Any], flat: torch.Tensor, out: torch.Tensor, world: int) -> Any:
    """Gather every member's 1-D ``flat`` into ``out`` (``world * len(flat)``, rank order),
    span ``i`` of every member on ``pgs[i]`` into a buffer of its own, copied into place when all
    arrived. Returns the work, as :func:`all_reduce` does."""
    n = flat.numel()
    cuts = spans(n, flat.element_size(), len(pgs))
    if len(cuts) == 1 or not flat.is_contiguous():
        return pgs[0]._allgather_base(out, flat)
    parts = [
        torch.empty(world * (hi - lo), dtype=flat.dtype, device=flat.device) for lo, hi in cuts
    ]
    works = [
        pg._allgather_base(p, flat[lo:hi])
        for pg, p, (lo, hi) in zip(pgs[: len(cuts)], parts, cuts, strict=True)
    ]
    rows = out.view(world, n)

    def place() -> None:
        for p, (lo, hi) in zip(parts, cuts, strict=True):
            rows[:, lo:hi].copy_(p.view(world, hi - lo))

    return Works(works, place)


def connect_stripes(
    connect: Callable[[dist.Store], Any],
    store: dist.Store,
    k: int,
    *,
    wishes: Sequence[int] = (),
    protocol: int = PROTOCOL_VERSION,
) -> tuple[Any, list[Any], list[int]]:
    """Build an epoch's first group on ``store`` and ``k - 1`` more under ``stripe<i>/``, one
    after the other (every member builds them in the same order); returns the first group, the
    others and the members' largest ``wishes``.

    The first group opens with a handshake, one tiny all-reduce: every member must speak the
    same isthmus ``protocol`` (raises :class:`~isthmus.coordinator.wire.ProtocolMismatch`
    naming both versions) and have the same ``k`` (raises ValueError naming the setting: a
    member waiting for a group nobody else builds would wait out its timeout, and the bits of a
    sum depend on the spans). Raises what ``connect`` raises too (torch's error, or the cut of
    the epoch's wires, which all of them share).

    ``wishes``: at most :data:`HANDSHAKE_WISHES` small non-negative integers every member
    contributes (as many on every member); each comes back as its maximum over the members. The
    session agrees there whether the epoch probes its links (:mod:`isthmus.comm.probe`), at no
    extra round trip."""
    if k < 1:
        raise ValueError(f"connections must be >= 1, got {k}")
    if len(wishes) > HANDSHAKE_WISHES:
        raise ValueError(f"the handshake carries {HANDSHAKE_WISHES} wishes, not {len(wishes)}")
    pg = connect(store)
    padded = [*wishes, *[0] * (HANDSHAKE_WISHES - len(wishes))]
    # max of x and of -x gives every member the largest and the smallest value in one reduction
    ks = torch.tensor([protocol, -protocol, k, -k, *padded], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([ks], opts).wait()
    highest, lowest = int(ks[0]), -int(ks[1])
    if highest != protocol or lowest != protocol:
        other = highest if highest != protocol else lowest
        raise ProtocolMismatch(
            version_mismatch(other, protocol, them="a member of this epoch", us="this peer")
        )
    if int(ks[2]) != k or int(-ks[3]) != k:
        raise ValueError(
            f"peers disagree on connections: this peer has {k}, others between {int(-ks[3])} and "
            f"{int(ks[2])}; give every peer the same SessionConfig.connections"
        )
    stripes = [connect(dist.PrefixStore(f"stripe{i}/", store)) for i in range(1, k)]
    return pg, stripes, [int(x) for x in ks[4 : 4 + len(wishes)]]


def reverse_sets(
    connect: Callable[[dist.Store], Any], store: dist.Store, k: int
) -> Callable[[], Any]:
    """The builder of :meth:`Group.exchange <isthmus.comm.group.Group.exchange>`'s reverse
    connections: one group (``k == 1``) or a list of ``k``, one per stripe."""
    rev = dist.PrefixStore("reverse/", store)
    if k == 1:
        return lambda: connect(rev)
    return lambda: [connect(dist.PrefixStore(f"stripe{i}/", rev)) for i in range(k)]
