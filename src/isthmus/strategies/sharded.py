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

from isthmus.comm.layout import Placement, shard_placement

__all__ = ["is_dtensor", "island_snapshot", "local_view", "register_shard"]


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
