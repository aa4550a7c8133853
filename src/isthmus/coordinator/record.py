"""What the membership reports outward: its event log, its counters, and the pushes it queued
for peers. Pure: the membership writes here, the server reads and drains.

The log keeps the last :data:`KEEP` events in memory and counts every event ever recorded, so a
reader that asks :meth:`RunRecord.since` with the count it last saw, often enough, misses none
of a run longer than the log.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["COUNTERS", "KEEP", "RunRecord"]

KEEP = 10_000
"""Events held in memory; beyond it the oldest thousand are dropped at once."""

COUNTERS = (
    "registrations",
    "rounds_committed",
    "rounds_aborted",
    "parity_checks",
    "parity_failures",
    "resyncs",
    "evictions",
    "leaves",
    "refusals",
    "isolations",
    "readmissions",
)
"""The coordinator's counters (``/v1/status``, ``/metrics``)."""

Notice = tuple[tuple[int, ...], dict[str, Any]]
"""A push: the peers it goes to and the websocket message."""


class RunRecord:
    """One run's events, counters and queued pushes (see the module doc)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        """The events still held, oldest first."""
        self.total = 0
        """Events ever recorded."""
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.notices: list[Notice] = []
        """Pushes waiting to be sent (:meth:`take_notices` drains them)."""

    def add(self, event: dict[str, Any]) -> None:
        """Append ``event``; drops the oldest thousand beyond :data:`KEEP` (bounded memory)."""
        self.events.append(event)
        self.total += 1
        if len(self.events) > KEEP:
            del self.events[:1000]

    def since(self, n: int) -> list[dict[str, Any]]:
        """Events number ``n`` and later (counting from the first) that are still held."""
        if n >= self.total:
            return []
        return self.events[max(0, len(self.events) - (self.total - n)) :]

    def push(self, members: tuple[int, ...], msg: dict[str, Any]) -> None:
        """Queue ``msg`` for the heartbeat sockets of ``members``."""
        self.notices.append((members, msg))

    def take_notices(self) -> list[Notice]:
        """The queued pushes, oldest first; the queue is empty afterwards."""
        out = list(self.notices)
        self.notices.clear()
        return out
