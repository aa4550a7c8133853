"""A model sharded inside an island (FSDP2's DTensor parameters) as the strategies see it.

Strategies work on plain tensors: for a DTensor parameter they take its local shard (a view
that shares the parameter's storage, so an update written into it is the parameter's) and its
:class:`~isthmus.comm.layout.Placement` in the full tensor, which the island's shared state
needs (:class:`~isthmus.comm.island.IslandState`). Everything the DiLoCo family and DDP do to a
parameter is elementwise, so doing it to every rank's shard equals doing it to the whole
tensor.

Reductions (:func:`start_reduction`, the one entry every strategy uses for a round's update):
on a rank of an island the ranks first agree whether the island contributes, then each rank
reduces its shards with the same shards of the other islands (by piece, :func:`start_by_piece`,
when the islands' sizes differ). What the reducer does to them (:func:`island_refusal`):

* plain mean: elementwise, so the same bits as an unsharded peer's reduction for two islands
  (a sum of two values does not depend on their order); with more, each element is one fp32 sum
  of the same values, whose order Gloo picks from the element's position in the buffer, so the
  result equals the unsharded one to fp32 rounding and is identical on every island.
* block quantizers (``int8``, ``int4``, ``e3m0``, ...): blockwise. A shard whose bounds fall on
  the full tensor's block grid, and that is at least ``world`` blocks long, is quantized in the
  same blocks as the whole tensor, so its bits are an unsharded peer's; elsewhere the blocks
  are cut from the shard's start instead (a block's scale is its absolute maximum, which would
  otherwise need the neighbouring rank's elements): the result is identical on every island,
  not to an unsharded peer's (:func:`quantized_span_exact` says which).
* coordinate-wise robust rules (mean, median, trimmed mean, meamed): every coordinate's value is
  the rule applied to the same column, so the bits are an unsharded peer's whenever every
  island's vector is finite (an honest island's always is: a non-finite shard makes the whole
  island contribute nothing). A forged vector non-finite in part of its coordinates is excluded
  only from the shards that hold them, where an unsharded peer excludes it everywhere.
* other compressors and rules are refused: top-k and rand-k pick over a whole tensor, PowerSGD
  factors the whole matrix, sign and sketch scale by whole-tensor norms, and the distance-based
  robust rules (Krum, geometric median, clipping, pre-aggregators) need each vector's norms and
  inner products, which would need every rank's partial sums combined across the island.
"""

from __future__ import annotations

from typing import Any

import torch

from isthmus.comm.layout import Placement, shard_placement, tensor_pieces
from isthmus.reduce.aggregate.aggregator import CoordinateRule
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.compress.quantize import QuantizedAllReduce, shard_layout
from isthmus.reduce.reducer import Reduced, Reducer

__all__ = [
    "is_dtensor",
    "island_agree",
    "island_refusal",
    "island_snapshot",
    "island_vote",
    "local_view",
    "quantized_span_exact",
    "register_shard",
    "start_by_piece",
    "start_reduction",
]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a torch DTensor (without importing DTensor where it is unavailable)."""
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, Placement | None]:
    """``t`` as a plain tensor and its placement: a DTensor's local shard (aliasing its
    storage) with the part of the full tensor it holds, or ``t`` itself and None.

    Raises ValueError for a DTensor laid out other than replicated or ``Shard(0)`` on a
    one-dimensional mesh (tensor parallelism, 2-D meshes): not built for islands yet."""
    if not is_dtensor(t):
        return t, None
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    local = t.detach().to_local()  # type: ignore[attr-defined]
    kinds = [type(p).__name__ for p in placements]
    if mesh.ndim == 1 and kinds == ["Replicate"]:
        return local, None
    if mesh.ndim == 1 and kinds == ["Shard"] and placements[0].dim == 0:
        return local, shard_placement(tuple(t.shape), mesh.size(), mesh.get_local_rank())
    raise ValueError(
        f"a DTensor laid out as {placements} on a {mesh.ndim}-D mesh is not supported by "
        "islands yet: they take FSDP2's Shard(0) on a 1-D mesh, or replicated tensors"
    )


def register_shard(
    session: Any, name: str, tensor: torch.Tensor, placement: Placement | None
) -> None:
    """Register ``tensor`` in ``session``'s shared state with its placement: an island's state
    keeps it (:class:`~isthmus.comm.island.IslandState`); a plain peer's state holds whole
    tensors, so a placement there must cover the whole tensor (a model sharded over one rank).
    Raises ValueError for a partial shard on a plain peer."""
    state = session.state
    if placement is None or not hasattr(state, "placements"):
        if placement is not None and placement.numel != placement.numel_full:
            raise ValueError(
                f"shared tensor {name!r} is a shard of a sharded model, but this session is not "
                "an island's: build the session after init_process_group() on every rank"
            )
        state.register(name, tensor)
    else:
        state.register(name, tensor, placement)


def island_snapshot(session: Any, snap: list[torch.Tensor]) -> list[torch.Tensor]:
    """A snapshot of replicated buffers as the island contributes it: on a rank of an island,
    the mean over its ranks (each rank's forward passes moved its own copy; every rank must
    send the same values, or ranks of one island would land different buffers); else ``snap``.
    Every rank of the island calls it at the same point."""
    island = getattr(session, "island", None)
    return snap if island is None else island.mean(snap)


def island_refusal(reducer: Reducer) -> str:
    """Why ``reducer`` cannot reduce an island's sharded state (see the module docstring), or
    ``""`` when it can: plain, a block quantizer, or a pipeline of coordinate-wise rules only."""
    comp = reducer.compressor
    if comp is not None and not isinstance(comp, QuantizedAllReduce):
        return (
            f"compression {comp.name!r} needs whole tensors (top-k and rand-k pick over a "
            "tensor, PowerSGD factors its matrix, sign and sketches scale by its norm) and an "
            "island's ranks hold shards: use a block quantizer (int8, int4, e3m0, ...)"
        )
    agg = reducer.aggregator
    if agg is not None:
        whole = [st.spec for st in agg.stages if not isinstance(st.rule, CoordinateRule)]
        if whole:
            return (
                f"robust aggregation {agg.spec!r}: {', '.join(whole)} need(s) the norms and "
                "inner products of whole update vectors, which an island's ranks would have "
                "to sum across the island: use a coordinate-wise rule (median, trimmed_mean, "
                "meamed)"
            )
    return ""


def quantized_span_exact(start: int, stop: int, numel: int, world: int, fmt: Any) -> bool:
    """Whether the block quantizer ``fmt`` over ``world`` islands quantizes the elements
    ``[start, stop)`` of a tensor of ``numel`` elements, reduced as one item, in the blocks an
    unsharded peer uses for the whole tensor (so that their result has its bits): the span
    starts on the full tensor's block grid, ends on it or at the tensor's end, and is long
    enough that its own layout keeps the block whole (about ``world`` blocks or more)."""
    if stop <= start or (start == 0 and stop == numel):
        return True
    whole, _ = shard_layout(numel, world, fmt)
    mine, _ = shard_layout(stop - start, world, fmt)
    b = whole.block
    return mine.block == b and start % b == 0 and (stop % b == 0 or stop == numel)


def island_agree(session: Any, ok: bool) -> bool:
    """True only if ``ok`` on every rank of ``session``'s island (``ok`` itself on a plain
    peer): whether an island contributes to a round is one decision, or its ranks' pieces would
    be averaged over different contributors. Every rank calls it at the same point."""
    island = getattr(session, "island", None)
    return ok if island is None else all(island.gather(ok))


class _PieceRound:
    """A round seen through one of its piece groups (what the reducer reads of a round)."""

    def __init__(self, rnd: Any, group: Any) -> None:
        self._rnd = rnd
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rnd, name)

    @property
    def world(self) -> int:
        return int(self.group.world)

    @property
    def rank(self) -> int:
        return int(self.group.rank)


class _PiecesPending:
    """The reductions of every piece group of a round, reassembled into local shards."""

    def __init__(
        self, parts: list[tuple[list[tuple[int, int, int]], Any]], like: list[torch.Tensor]
    ):
        self.parts = parts
        self.like = like

    def wait(self) -> Reduced | None:
        results = [(segs, pending.wait()) for segs, pending in self.parts]
        if any(r is None for _, r in results):
            return None  # nobody contributed: the same in every group (one decision per island)
        outs = [torch.empty_like(t, dtype=torch.float32) for t in self.like]
        exact, count = None, 0
        for segs, r in results:
            assert r is not None
            for (i, a, b), part in zip(segs, r.tensors, strict=False):
                outs[i].view(-1)[a:b] = part.reshape(-1)
            exact, count = r.exact, r.contributors
        return Reduced(outs, exact, count)


def start_by_piece(
    reducer: Reducer,
    rnd: Any,
    items: list[tuple[str, torch.Tensor]],
    placements: list[Placement | None],
    **options: Any,
) -> Any:
    """Start reducing ``items`` (local shards, ``placements`` in their full tensors) on a round
    of islands of different sizes: for every piece group of this rank (``rnd.pieces``), the
    elements of the shards that group's owners hold, one reduction each, every tensor's part
    an item of its own (so that a block quantizer cuts each where an unsharded peer would, see
    :func:`quantized_span_exact`; ``options`` are :meth:`Reducer.start`'s: every group carries
    the exact values, identical on every rank of an island). Returns an object whose ``wait()``
    gives the :class:`Reduced` in the shape of ``items``. Raises ValueError for a tensor held
    whole on every rank (not sharded): not built for islands of different sizes."""
    sizes = rnd.session.island_sizes
    parts = []
    for owners, group in rnd.pieces.items():
        segs: list[tuple[int, int, int]] = []
        for i, ((name, _t), p) in enumerate(zip(items, placements, strict=True)):
            if p is None:
                raise ValueError(
                    f"{name!r} is not sharded: islands of different sizes exchange sharded "
                    "tensors only (shard every parameter with fully_shard)"
                )
            segs += [(i, a - p.start, b - p.start)
                     for (a, b), own in tensor_pieces(p.full_shape, sizes) if own == owners]  # fmt: skip
        pieces = [(f"{items[i][0]}[{a}:{b}]", items[i][1].reshape(-1)[a:b]) for i, a, b in segs]
        if not pieces:  # a group this rank meets for nothing of these tensors: still one call
            like = items[0][1]
            pieces = [("piece", torch.zeros(0, dtype=like.dtype, device=like.device))]
        parts.append((segs, reducer.start(_PieceRound(rnd, group), pieces, **options)))
    return _PiecesPending(parts, [t for _, t in items])


def island_vote(
    rnd: Any, items: list[tuple[str, torch.Tensor]], contribute: bool, weight: float = 1.0
) -> tuple[bool, float]:
    """Whether the island of this rank contributes to ``rnd`` and with which weight, the same
    on every rank of it: every rank's ``contribute``, with its shards of ``items`` finite; the
    mean of the ranks' ``weight`` (an island counts as one peer, as its ranks' gradients are
    averaged inside it). A plain peer's arguments come back as they are. Every rank of an
    island calls it at the same point."""
    island = getattr(getattr(rnd, "session", None), "island", None)
    if island is None:
        return contribute, weight
    finite = all(all_finite(t.float() if t.dtype == torch.float64 else t) for _, t in items)
    votes = island.gather((bool(contribute and finite and weight > 0), float(weight)))
    weights = {w for _, w in votes}
    mean = weights.pop() if len(weights) == 1 else sum(w for _, w in votes) / len(votes)
    return all(ok for ok, _ in votes), mean


def start_reduction(
    reducer: Reducer,
    rnd: Any,
    items: list[tuple[str, torch.Tensor]],
    placements: list[Placement | None],
    *,
    contribute: bool,
    exact: torch.Tensor | None = None,
    weight: float = 1.0,
    agreed: bool = False,
) -> Any:
    """Start reducing a round's update ``items`` (:meth:`Reducer.start`'s arguments) on any
    peer: a plain one's goes to the reducer as it is; on a rank of an island, the ranks first
    agree whether the island contributes (every rank's ``contribute`` and its shards finite:
    one decision, or the ranks' pieces would be averaged over different contributors) and with
    which weight (the mean of its ranks' ``weight``: an island counts as one peer, as its
    ranks' gradients are averaged inside it), then
    each rank reduces its own shards across islands, by piece (:func:`start_by_piece`) when the
    islands' sizes differ. Every rank of an island calls it at the same point. ``agreed``: the
    caller already took ``contribute`` and ``weight`` from :func:`island_vote`. Returns what
    :meth:`Reducer.start` returns (an object with ``wait()``); raises what it raises."""
    if not agreed:
        contribute, weight = island_vote(rnd, items, contribute, weight)
    if getattr(rnd, "pieces", None):
        return start_by_piece(
            reducer, rnd, items, placements, contribute=contribute, exact=exact, weight=weight
        )
    return reducer.start(rnd, items, contribute=contribute, exact=exact, weight=weight)
