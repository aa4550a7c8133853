"""What a checkpoint holds, in one JSON file written last: :class:`Manifest`."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMAT", "ISLAND_FORMAT", "PLAIN_FORMAT", "Manifest", "assign_parts"]

PLAIN_FORMAT = 1
"""The layout single peers write: each part holds whole tensors (:attr:`Manifest.parts`)."""
ISLAND_FORMAT = 2
"""The layout islands write: each part holds flat shards (:attr:`Manifest.shards`), and the
hashes are layout hashes (:mod:`isthmus.checkpoint.shards`). A reader of format 1 cannot read
it, so it is refused there by its number."""
FORMAT = ISLAND_FORMAT
"""The newest checkpoint layout this isthmus reads; a reader refuses a newer one by name."""


def assign_parts(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Split the shared tensors (name -> bytes) into ``parts`` disjoint groups of nearly equal
    bytes: largest first, each to the lightest group so far (ties to the lower part). Every peer
    computes the same split from the same schema; within a group, names keep schema order."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0] * parts
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        k = min(range(parts), key=lambda i: (load[i], i))
        owner[name] = k
        load[k] += sizes[name]
    return [[n for n in sizes if owner[n] == k] for k in range(parts)]


@dataclass(kw_only=True)
class Manifest:
    """The index of one complete checkpoint (``manifest.json``)."""

    format: int = PLAIN_FORMAT
    run_id: str
    revision: int
    """Committed rounds in the saved state (the round that produced it is ``revision - 1``)."""
    strategy: str = ""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    schema: list[list[Any]] = field(default_factory=list)
    """``[name, shape, dtype]`` of every shared tensor, in registration order."""
    hashes: dict[str, str] = field(default_factory=dict)
    """Every shared tensor's hash: xxh3-64 of its bytes (``hash_kind`` ``"xxh3"``), or its
    layout-independent hash (``"layout"``, :func:`isthmus.comm.layout.layout_hash`)."""
    hash_kind: str = "xxh3"
    parts: list[list[str]] = field(default_factory=list)
    """Which shared tensors part ``k`` (directory ``shared-<k>``) holds (whole, or a shard of
    each when ``shards`` is set)."""
    shards: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    """Islands' checkpoints: part ``k`` (as text) -> tensor -> ``[start, stop, xxh3]``, the flat
    elements of the full tensor that part holds (saved flat) and the hash of their bytes.
    Empty for single peers' checkpoints."""
    islands: list[int] = field(default_factory=list)
    """The sizes of the islands that wrote it (parts are numbered island by island)."""
    writers: dict[str, str] = field(default_factory=dict)
    """Part number -> the peer that wrote it."""
    local: list[str] = field(default_factory=list)
    """Peer slots whose local state is saved (directories ``local-<slot>``)."""
    model_keys: dict[str, str] = field(default_factory=dict)
    """The model's state_dict keys -> the shared tensor holding each (for export)."""
    bytes: dict[str, int] = field(default_factory=dict)
    isthmus_version: str = ""
    created: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1).encode()

    @staticmethod
    def from_bytes(data: bytes, *, where: str = "manifest.json") -> Manifest:
        """Parse a manifest; ValueError naming ``where`` if it is not one this version reads."""
        try:
            d = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where} is not valid JSON ({e})") from None
        if not isinstance(d, dict) or "revision" not in d:
            raise ValueError(f"{where} is not an isthmus checkpoint manifest")
        if int(d.get("format", 0)) > FORMAT:
            raise ValueError(
                f"{where} has checkpoint format {d['format']}; this isthmus reads up to {FORMAT} "
                "(upgrade isthmus)"
            )
        names = {f.name for f in dataclasses.fields(Manifest)}
        return Manifest(**{k: v for k, v in d.items() if k in names})

    def part_of(self, name: str) -> int:
        for k, names in enumerate(self.parts):
            if name in names:
                return k
        raise KeyError(name)
