"""Byte accounting of collectives: what each rank puts on the wire, and the per-session totals.

:class:`~isthmus.comm.group.Group` records every call here; nothing else counts bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommStats", "wire_bytes"]


def _broadcast_sends(vrank: int, world: int) -> int:
    """How many copies a rank sends in Gloo's binomial-tree broadcast (vrank relative to root)."""
    sends = 0
    k = vrank.bit_length()
    while vrank + (1 << k) < world:
        sends += 1
        k += 1
    return sends


def wire_bytes(op: str, nbytes: int, world: int, rank: int = 0, root: int = 0) -> int:
    """Bytes this rank sends for one collective over ``nbytes`` of payload per rank.

    The volumes are those of Gloo's algorithms, as the kernel counts a Gloo process's writes
    (``/proc/self/io``): ring all-reduce sends 2(n-1)/n of the buffer, ring all-gather (n-1)
    times the input, all-to-all (n-1)/n of the input, broadcast is a binomial tree rooted at
    ``root``. TCP/IP headers are not included (a few percent on the wire).
    """
    if world <= 1:
        return 0
    if op == "all_reduce":
        return (2 * (world - 1) * nbytes) // world
    if op == "all_gather":
        return (world - 1) * nbytes
    if op == "all_to_all":
        return ((world - 1) * nbytes) // world
    if op == "broadcast":
        return _broadcast_sends((rank - root) % world, world) * nbytes
    if op in ("send",):
        return nbytes
    if op in ("recv", "barrier"):
        return 0
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class CommStats:
    """Bytes and time this peer spent on collectives. Shared by all epochs of one session."""

    bytes_sent: int = 0
    calls: int = 0
    wait_s: float = 0.0
    by_op: dict[str, int] = field(default_factory=dict)

    def record(self, op: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes

    def snapshot(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "calls": self.calls,
            "wait_s": round(self.wait_s, 6),
            "by_op": dict(self.by_op),
        }
