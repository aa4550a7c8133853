"""Checkpoints of islands as flat shards of the full state: pure bookkeeping, no I/O.

An island (a peer of N local ranks, FSDP2 inside) holds each sharded tensor as one contiguous
range of the full tensor's flat elements on each rank, and each replicated tensor whole on
every rank. Its checkpoint is written by every rank, with no gather: the islands of the round
split the tensors by bytes (:func:`~isthmus.checkpoint.manifest.assign_parts`, one group per
island), and each rank of island ``k`` writes the elements it holds of island ``k``'s tensors
(a replicated tensor: rank 0 alone) as a flat shard. Part ``p`` (directory ``shared-<p>``) is
rank ``i`` of island ``k``, ``p = sizes[0] + ... + sizes[k-1] + i``.

The manifest says, for every part, which flat range ``[start, stop)`` of which tensor it holds
and the xxh3-64 of that shard's bytes (:attr:`Manifest.shards
<isthmus.checkpoint.manifest.Manifest.shards>`), and the layout-independent hash of every full
tensor (:func:`~isthmus.comm.layout.layout_hash`, summed over the shards: what the islands
compare at parity checks). Nothing in it depends on the writers' island sizes, so a reader of
any shape (islands of other sizes, single peers) finds the shards that overlap what it holds
(:func:`reads`) and verifies both hashes.

Each rank's report to the coordinator carries its shards in the report's ``hashes`` map
(:func:`encode_shard`): the coordinator merges the maps of all parts unread, and the rank that
completes the set builds the manifest from them (:func:`decode_reports`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ShardRead",
    "decode_reports",
    "encode_shard",
    "part_index",
    "reads",
    "whole_shards",
]

ShardRead = tuple[int, int, int]
"""``(part, start, stop)``: part ``part`` holds flat elements ``[start, stop)`` of a tensor."""


def part_index(sizes: Sequence[int], island: int, rank: int) -> int:
    """The part number of rank ``rank`` of island ``island`` among islands of ``sizes`` ranks.
    Raises ValueError for a rank or island that is not there."""
    if not 0 <= island < len(sizes) or not 0 <= rank < sizes[island]:
        raise ValueError(f"rank {rank} of island {island}: not in islands of sizes {list(sizes)}")
    return sum(sizes[:island]) + rank


def encode_shard(
    part: int, name: str, start: int, stop: int, xxh3: str, partial: int
) -> tuple[str, str]:
    """One shard as a ``(key, value)`` of a part report's ``hashes``: key ``"<part>:<name>"``,
    value ``"<start> <stop> <xxh3> <partial layout hash>"``."""
    return f"{part}:{name}", f"{start} {stop} {xxh3} {partial}"


def decode_reports(
    hashes: Mapping[str, str], parts: int
) -> tuple[dict[str, dict[str, list[Any]]], dict[str, int]]:
    """The merged ``hashes`` of every part's report -> (``shards``: part (as text) -> tensor ->
    ``[start, stop, xxh3]``, every part present even when empty; ``sums``: tensor -> its layout
    hash summed over the shards, mod 2**64). Raises ValueError naming a malformed entry or a
    part number outside ``[0, parts)``."""
    shards: dict[str, dict[str, list[Any]]] = {str(p): {} for p in range(parts)}
    sums: dict[str, int] = {}
    for key, value in hashes.items():
        head, sep, name = key.partition(":")
        fields = value.split()
        if not sep or not head.isdigit() or len(fields) != 4 or int(head) >= parts:
            raise ValueError(f"checkpoint part report: malformed shard {key!r} = {value!r}")
        start, stop, xxh3, partial = int(fields[0]), int(fields[1]), fields[2], int(fields[3])
        shards[head][name] = [start, stop, xxh3]
        sums[name] = (sums.get(name, 0) + partial) % (1 << 64)
    return shards, sums


def whole_shards(
    parts: Sequence[Sequence[str]], hashes: Mapping[str, str], numels: Mapping[str, int]
) -> dict[str, dict[str, list[Any]]]:
    """The shards of a checkpoint of single peers (each part holds whole tensors, each hashed
    whole): part -> tensor -> ``[0, numel, xxh3]``, so one reader serves both kinds."""
    return {
        str(k): {n: [0, int(numels[n]), hashes.get(n, "")] for n in names}
        for k, names in enumerate(parts)
    }


def reads(
    shards: Mapping[str, Mapping[str, Sequence[Any]]], name: str, start: int, stop: int
) -> list[ShardRead]:
    """The shards to read for flat elements ``[start, stop)`` of tensor ``name``: every
    ``(part, shard start, shard stop)`` that overlaps the range, in element order, covering it
    exactly once. Raises ValueError naming the tensor and the first elements that no shard
    holds, or that two shards hold (a checkpoint whose manifest does not add up)."""
    found = sorted(
        (int(held[0]), int(held[1]), int(p))
        for p, tensors in shards.items()
        if (held := tensors.get(name)) is not None and int(held[1]) > int(held[0])
    )
    out: list[ShardRead] = []
    at = start
    for s, e, p in found:
        if e <= start or s >= stop:
            continue
        if s > at:
            raise ValueError(f"tensor {name!r}: elements [{at}, {min(s, stop)}) are in no part")
        if out and s < at:
            raise ValueError(f"tensor {name!r}: elements [{s}, {min(at, e)}) are in two parts")
        out.append((p, s, e))
        at = e
    if at < stop:
        raise ValueError(f"tensor {name!r}: elements [{at}, {stop}) are in no part")
    return out
