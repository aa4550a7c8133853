"""Checkpoints written by islands: every rank writes its own shards, nothing is gathered.

:class:`IslandCheckpointer` is the :class:`~isthmus.checkpoint.save.Checkpointer` of a rank of
an island (:class:`~isthmus.comm.island.IslandSession`). The islands of the round that produced
the revision split the shared tensors by their full bytes, one group per island; every rank of
island ``k`` writes, as flat tensors, the elements it holds of island ``k``'s tensors (rank 0
also the replicated ones), as part ``shared-<p>`` (:mod:`isthmus.checkpoint.shards` numbers
them), and reports them itself, with each shard's range, xxh3 and share of the layout hash. The
rank whose report completes the set writes the manifest (format 2): the full schema, every
shard, and every full tensor's layout-independent hash. Its local state (inner optimizer
shards, local parameters, RNG) goes to ``local-<slot>.<rank>of<size>``: it only fits the same
rank of an island of the same size, which alone loads it; any other reader starts its local
state as a joiner does.

Loading is :func:`isthmus.checkpoint.load.load_latest`, which reads an island's checkpoint on
islands of any size and on single peers alike, and reads a single peers' checkpoint on islands.

DTensors (FSDP2's parameters and the inner optimizer's moments) are saved and loaded as their
local shards (:func:`local_tree`, :func:`merge_local`): each rank's local state is its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from isthmus.checkpoint.manifest import ISLAND_FORMAT, Manifest
from isthmus.checkpoint.save import Checkpointer, slot_of
from isthmus.checkpoint.shards import decode_reports, encode_shard, part_index
from isthmus.comm.layout import hash_hex, layout_hash, shard_placement
from isthmus.comm.state import tensor_hash
from isthmus.version import __version__

__all__ = ["IslandCheckpointer", "island_local_key", "local_tree", "merge_local"]


def island_local_key(slot: str, rank: int, size: int) -> str:
    """The name of rank ``rank``'s local state of an island of ``size`` in slot ``slot``."""
    return f"{slot}.{rank}of{size}"


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "_local_tensor")


def local_tree(obj: Any) -> Any:
    """``obj`` (nested dicts, lists and tuples) with every DTensor replaced by its local shard
    (sharing its storage: a load into the result writes the DTensor's values); new containers,
    the same leaves otherwise."""
    if _is_dtensor(obj):
        return obj.to_local()
    if isinstance(obj, Mapping):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def merge_local(template: Any, loaded: Any) -> Any:
    """What a load into ``local_tree(template)`` gave, with ``template``'s DTensors back in
    their places (their shards already hold the loaded values): the plain values come from
    ``loaded``, so a strategy's ``load_local_state`` takes the result as it takes its own."""
    if _is_dtensor(template):
        return template
    if isinstance(template, Mapping) and isinstance(loaded, Mapping):
        return {k: merge_local(template[k], v) if k in template else v for k, v in loaded.items()}
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)):
        return type(loaded)(merge_local(t, v) for t, v in zip(template, loaded, strict=False))
    return loaded


class IslandCheckpointer(Checkpointer):
    """The checkpointer of one rank of an island (see the module docstring); the same
    arguments as :class:`Checkpointer`, whose ``local_state`` may hold DTensors."""

    def __init__(self, session: Any, url: str, **kwargs: Any) -> None:
        local = kwargs.get("local_state")
        if local is not None:
            kwargs["local_state"] = lambda: local_tree(local())
        super().__init__(session, url, **kwargs)
        self._writers: list[int] = []  # the island sizes of the write in progress

    def _sizes(self) -> list[int]:
        """The island sizes of the round that produced the revision, in member order."""
        s = self.session
        sizes = list(getattr(s, "island_sizes", []) or [])
        return sizes if len(sizes) == s.world else [s.island.size] * s.world

    def _assignment(self) -> tuple[int, list[list[str]], list[str]]:
        s = self.session
        state = s.state
        full = {n: math.prod(state.full_shape(n)) * t.element_size() for n, t in state.items()}
        sizes = self._writers = self._sizes()
        by_island = self._parts(full, s.world)
        parts: list[list[str]] = []
        for k, n_ranks in enumerate(sizes):
            for i in range(n_ranks):
                parts.append([n for n in by_island[k] if self._holds(n, n_ranks, i)])
        me = part_index(sizes, s.rank, s.island.rank)
        return me, parts, parts[me]

    def _holds(self, name: str, size: int, rank: int) -> bool:
        """Whether rank ``rank`` of an island of ``size`` writes any element of ``name``: rank
        0 a replicated tensor; any rank a non-empty shard of a sharded one (FSDP2's rule, the
        same on every island of that size)."""
        p = self.session.state.placements[name]
        if p is None:
            return rank == 0
        return shard_placement(p.full_shape, size, rank).numel > 0

    def _stored(self, snapshot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.reshape(-1) for n, t in snapshot.items()}

    def _part_hashes(self, rank: int, snapshot: dict[str, torch.Tensor]) -> dict[str, str]:
        state = self.session.state
        out = {}
        for n, t in snapshot.items():
            p = state.placements[n]
            start, stop = (0, t.numel()) if p is None else (p.start, p.stop)
            flat = t.reshape(-1)
            key, value = encode_shard(rank, n, start, stop, tensor_hash(flat), layout_hash(flat, p))
            out[key] = value
        return out

    def _writer(self) -> str:
        return f"{self.session.name} rank {self.session.island.rank}"

    def _local_key(self) -> str:
        s = self.session
        return island_local_key(slot_of(s.name), s.island.rank, s.island.size)

    def _manifest(self, revision: int, parts: list[list[str]], answer: dict[str, Any]) -> Manifest:
        s = self.session
        schema = [sp.to_json() for sp in s.state.schema()]
        shards, sums = decode_reports(answer["hashes"], len(parts))
        hashes = {
            str(n): hash_hex(sums.get(str(n), 0), tuple(shape), str(dtype))
            for n, shape, dtype in schema
        }
        return Manifest(
            format=ISLAND_FORMAT,
            run_id=s.run_id,
            revision=revision,
            strategy=self.strategy,
            strategy_config=self.strategy_config,
            schema=schema,
            hashes=hashes,
            hash_kind="layout",
            parts=parts,
            shards=shards,
            islands=list(self._writers),
            writers=dict(answer.get("writers", {})),
            local=sorted(answer.get("local", [])),
            model_keys=self.model_keys,
            bytes=dict(answer.get("bytes", {})),
            isthmus_version=__version__,
        )
