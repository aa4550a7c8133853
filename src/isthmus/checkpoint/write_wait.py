"""How long to wait for a checkpoint write that is still running: as long as it progresses,
briefly once it stops. The pure rule behind :meth:`isthmus.checkpoint.save.Checkpointer.
wait_progressing`.

A write is watched through a *progress mark* the caller samples (anything comparable for
equality: the writer's stage and the bytes its files hold on the store). :class:`WriteWait`
gives up when the mark has not changed for ``idle_s`` and at least ``min_s`` have passed since
the wait began (``min_s`` is for stores whose bytes only show once a whole file is uploaded:
there the mark cannot move while a large file is sent), or in any case once ``limit_s`` have
passed. Times are what the caller gives (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["WriteWait"]


@dataclass
class WriteWait:
    """One wait for one write, begun at ``started``: ``idle_s`` without a change of the mark
    ends it once ``min_s`` have passed; ``limit_s`` ends it regardless. ValueError names a
    bound that is not a finite number > 0 (``min_s`` may be 0), or a ``limit_s`` below
    ``idle_s`` or ``min_s``."""

    started: float
    idle_s: float
    limit_s: float
    min_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("idle_s", "limit_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"WriteWait.{name}: must be a finite number > 0, got {v!r}")
        if not (math.isfinite(self.min_s) and self.min_s >= 0):
            raise ValueError(f"WriteWait.min_s: must be a finite number >= 0, got {self.min_s!r}")
        if self.limit_s < max(self.idle_s, self.min_s):
            raise ValueError("WriteWait.limit_s: must be >= idle_s and >= min_s")
        self._mark: Hashable | None = None
        self._moved_at = self.started
        self.changes = 0
        """How many times the mark changed after the first observation."""

    def observe(self, now: float, mark: Hashable) -> None:
        """Record the progress mark seen at ``now``; a change counts as progress then (the
        first mark only sets the reference)."""
        if self._mark is None:
            self._mark = mark
            return
        if mark != self._mark:
            self._mark = mark
            self._moved_at = max(self._moved_at, now)
            self.changes += 1

    def idle_for(self, now: float) -> float:
        """Seconds since the mark last changed (or since the wait began)."""
        return max(0.0, now - self._moved_at)

    def give_up(self, now: float) -> str | None:
        """None while the wait should go on; else why it ends (one line for the log)."""
        elapsed = now - self.started
        if elapsed >= self.limit_s:
            return f"still running after {elapsed:.0f}s, the limit for its size"
        idle = self.idle_for(now)
        if idle >= self.idle_s and elapsed >= self.min_s:
            return f"no progress for {idle:.0f}s"
        return None
