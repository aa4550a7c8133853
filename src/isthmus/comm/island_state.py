"""The state side of an island: its ranks (:class:`Island`), how a process finds its island
(:func:`find_island`), and the shards it holds (:class:`IslandState`). The session of a rank of
an island is :class:`isthmus.comm.island.IslandSession`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from isthmus.comm.layout import Placement, hash_hex, layout_hash, shard_placement
from isthmus.comm.state import SharedState
from isthmus.coordinator.protocol import TensorSpec

__all__ = ["NPROC_VAR", "Island", "IslandState", "find_island"]

NPROC_VAR = "ISTHMUS_NPROC_PER_PEER"
"""Set by ``isthmus run --nproc-per-peer N`` for every rank of a peer: how many ranks it has."""


class Island:
    """The local ranks of one peer: ``rank`` of ``size`` in ``group`` (None: the default
    group), with a Gloo group for the island's own decisions (the group itself when it is
    Gloo, else a new one over the same ranks)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if dist.get_backend(group) == "gloo":
            self.control = group
        else:  # decisions are Python objects: they travel over Gloo, beside NCCL
            self.control = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's ``obj`` on every rank (the followers' argument is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.control, group_src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The island's elementwise means of replicated floating tensors (fresh tensors, the
        same bits on every rank): what a rank's local copies of buffers contribute."""
        if self.size == 1 or not tensors:
            return tensors
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64).cpu() for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.control)
        flat /= self.size
        out, off = [], 0
        for t in tensors:
            part = flat[off : off + t.numel()].view(t.shape).to(t.dtype).to(t.device)
            out.append(part)
            off += t.numel()
        return out

    def gather_whole(
        self, shards: Sequence[torch.Tensor], placements: Sequence[Placement | None]
    ) -> list[torch.Tensor] | None:
        """The whole tensors of the island's shards, flat fp32 on the CPU, on the leader (None
        on the other ranks, which send their shards): ``shards[k]`` is this rank's part of
        tensor ``k`` as ``placements[k]`` says (FSDP2's ``Shard(0)`` split over the island's
        ranks; None: held whole by every rank, the leader's copy is taken). Every rank calls
        it at the same point with the same tensors. Raises ValueError for a placement other
        than this rank's ``Shard(0)`` part."""
        for k, p in enumerate(placements):
            if p is not None and p != shard_placement(p.full_shape, self.size, self.rank):
                raise ValueError(f"tensor {k}: {p} is not rank {self.rank}'s Shard(0) part")

        def part(r: int) -> list[tuple[int, int]]:
            return [
                (0, 0) if p is None else
                ((q := shard_placement(p.full_shape, self.size, r)).start, q.stop)
                for p in placements
            ]  # fmt: skip

        spans = [part(r) for r in range(self.size)]
        longest = max(sum(b - a for a, b in s) for s in spans)
        mine = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
                for t, p in zip(shards, placements, strict=True) if p is not None]  # fmt: skip
        buf = torch.zeros(longest, dtype=torch.float32)
        flat = torch.cat(mine) if mine else buf[:0]
        buf[: flat.numel()] = flat
        leader = self.rank == 0
        bufs = [torch.empty_like(buf) for _ in range(self.size)] if leader else None
        if self.size > 1 and longest:  # (nothing to gather when every tensor is held whole)
            dist.gather(buf, bufs, group=self.control, group_dst=0)
        elif leader:
            bufs = [buf] * self.size
        if not leader:
            return None
        assert bufs is not None
        out = []
        offsets = [0] * self.size
        for k, (t, p) in enumerate(zip(shards, placements, strict=True)):
            if p is None:
                out.append(t.detach().reshape(-1).to(device="cpu", dtype=torch.float32).clone())
                continue
            whole = torch.empty(p.numel_full, dtype=torch.float32)
            for r in range(self.size):
                a, b = spans[r][k]
                whole[a:b] = bufs[r][offsets[r] : offsets[r] + b - a]
                offsets[r] += b - a
            out.append(whole)
        return out

    def all_gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (a CPU tensor of the same size and dtype on every rank), in rank
        order, on every rank."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.control)
        return out

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a CPU tensor of the same size and dtype on every rank) overwritten in place
        with the leader's values, and returned."""
        if self.size > 1:
            dist.broadcast(t, group=self.control, group_src=0)
        return t

    def sum_int64(self, values: torch.Tensor) -> torch.Tensor:
        """The island's elementwise sum of an int64 tensor (wrapping mod 2**64)."""
        out = values.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.control)
        return out


def find_island(island: Any = None) -> Island | None:
    """The island of this process: ``island`` (a process group) or the default group when one
    is initialized; None for a plain peer (no group, or a group of one rank).

    Raises RuntimeError when the launcher started this process as one of several ranks of a
    peer (``isthmus run --nproc-per-peer N``) and no process group is initialized: the script
    must call ``torch.distributed.init_process_group()`` before building the session."""
    nproc = int(os.environ.get(NPROC_VAR, "1") or "1")
    if island is None and not (dist.is_available() and dist.is_initialized()):
        if nproc > 1:
            raise RuntimeError(
                f"this process is rank {os.environ.get('RANK', '?')} of a peer of {nproc} "
                f"ranks (isthmus run --nproc-per-peer {nproc}), but the script never called "
                "torch.distributed.init_process_group() before isthmus.Session(...): call "
                "it first (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set), or run "
                "with --nproc-per-peer 1"
            )
        return None
    size = dist.get_world_size(island)
    if nproc > 1 and size != nproc:
        raise RuntimeError(
            f"a rank of a peer of {nproc} ranks cannot register on its own: its island group "
            f"has {size} rank(s); pass the group of all {nproc} (or none: the default group)"
        )
    # an island of one is still an island when the launcher made it one (islands of 2 and 1)
    return Island(island) if size > 1 or island is not None or NPROC_VAR in os.environ else None


class IslandState(SharedState):
    """The shared state of one rank of an island: local shards with their placements.

    :meth:`schema` names full shapes; :meth:`prepare` (every rank together) computes the
    layout-independent hashes (:func:`~isthmus.comm.layout.layout_hash`, summed over the island)
    that :meth:`hashes` and :meth:`digest` then return. A replicated tensor (no placement)
    counts once, the leader's copy."""

    def __init__(self, island: Island) -> None:
        super().__init__()
        self.island = island
        self.placements: dict[str, Placement | None] = {}
        self._hashes: dict[str, str] | None = None

    def register(self, name: str, tensor: torch.Tensor, placement: Placement | None = None) -> None:
        """As :meth:`SharedState.register`; ``placement``: the part of the full tensor this rank
        holds (None: all of it, replicated on every rank). Raises ValueError when the placement
        does not match the tensor's size."""
        if placement is not None and placement.numel != tensor.numel():
            raise ValueError(
                f"shared tensor {name!r}: {tensor.numel()} elements, its placement says "
                f"{placement.numel}"
            )
        super().register(name, tensor)
        self.placements[name] = placement

    def unregister_prefix(self, prefix: str) -> None:
        super().unregister_prefix(prefix)
        self.placements = {n: p for n, p in self.placements.items() if n in self}

    def full_shape(self, name: str) -> tuple[int, ...]:
        p = self.placements.get(name)
        return tuple(self[name].shape) if p is None else p.full_shape

    def sharded_shapes(self) -> list[tuple[int, ...]]:
        """The full shapes of the tensors split over the island's ranks (with a placement)."""
        return [self.full_shape(n) for n, p in self.placements.items() if p]

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(n, self.full_shape(n), str(t.dtype)) for n, t in self.items()]

    def prepare(self) -> dict[str, str]:
        """Hash the island's state (every rank calls it at the same point); returns the hashes."""
        mine = []
        for n, t in self.items():
            p = self.placements[n]
            counts = p is not None or self.island.leader
            mine.append(layout_hash(t, p) if counts else 0)
        totals = self.island.sum_int64(torch.tensor(mine, dtype=torch.int64)).tolist()
        self._hashes = {
            n: hash_hex(h, self.full_shape(n), str(t.dtype))
            for (n, t), h in zip(self.items(), totals, strict=True)
        }
        return dict(self._hashes)

    def hashes(self) -> dict[str, str]:
        if self._hashes is None:
            raise RuntimeError("an island's hashes are computed by all its ranks: prepare() first")
        return dict(self._hashes)

    def digest(self) -> str:
        """One hash of the whole state as of the last :meth:`prepare` (names and hashes): the
        same on every rank of every island that holds the same full state."""
        h = xxhash.xxh3_64()
        for n, v in self.hashes().items():
            h.update(f"{n}={v};".encode())
        return h.hexdigest()

    def gathered(self) -> dict[str, torch.Tensor]:
        """The full tensors, assembled from every rank's shards (every rank calls it; meant for
        checks and exports of small states: each rank ends holding all of it). Raises
        ValueError naming a replicated tensor whose copies differ between ranks."""
        mine = {n: (t.detach().cpu(), self.placements[n]) for n, t in self.items()}
        ranks = self.island.gather(mine)
        out: dict[str, torch.Tensor] = {}
        for n, t in self.items():
            if self.placements[n] is None:
                copies = [r[n][0] for r in ranks]
                differ = [i for i, c in enumerate(copies) if not torch.equal(c, copies[0])]
                if differ:
                    raise ValueError(
                        f"replicated tensor {n!r} differs between the island's ranks 0 and "
                        f"{differ}: its ranks did not apply the same update"
                    )
                out[n] = copies[0].clone()
                continue
            full = torch.empty(self.full_shape(n), dtype=t.dtype).reshape(-1)
            for shard, p in (r[n] for r in ranks):
                full[p.start : p.stop] = shard.reshape(-1)
            out[n] = full.view(self.full_shape(n))
        return out
