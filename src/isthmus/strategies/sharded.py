"""A model sharded inside an island (FSDP2's DTensor parameters) as the strategies see it.

Strategies work on plain tensors: for a DTensor parameter they take its local shard (a view
that shares the parameter's storage, so an update written into it is the parameter's) and its
:class:`~isthmus.comm.layout.Placement` in the full tensor, which the island's shared state
needs (:class:`~isthmus.comm.island.IslandState`). Everything the DiLoCo family and DDP do to a
parameter is elementwise, so doing it to every rank's shard equals doing it to the whole
tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from isthmus.comm.layout import Placement, shard_placement, tensor_pieces
from isthmus.reduce.reducer import Reduced, Reducer

__all__ = [
    "is_dtensor",
    "island_agree",
    "island_snapshot",
    "local_view",
    "register_shard",
    "start_by_piece",
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
        outs = [torch.empty_like(t) for t in self.like]
        exact, count = None, 0
        for segs, r in results:
            assert r is not None
            flat, off = r.tensors[0], 0
            for i, a, b in segs:
                outs[i].view(-1)[a:b] = flat[off : off + b - a]
                off += b - a
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
    elements of the shards that group's owners hold, one reduction each (``options`` are
    :meth:`Reducer.start`'s: every group carries the exact values, identical on every rank of
    an island). Returns an object whose ``wait()`` gives the :class:`Reduced` in the shape of
    ``items``. Raises ValueError for a tensor held whole on every rank (not sharded): not built
    for islands of different sizes yet."""
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
        pieces = [items[i][1].reshape(-1)[a:b] for i, a, b in segs]
        flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=items[0][1].dtype)
        parts.append((segs, reducer.start(_PieceRound(rnd, group), [("piece", flat)], **options)))
    return _PiecesPending(parts, [t for _, t in items])
