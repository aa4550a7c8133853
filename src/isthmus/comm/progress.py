"""Whether a transfer still makes progress, from samples of its connections' byte counters: the
pure rule that replaces a fixed total timeout.

A collective of any size may take as long as it needs while its bytes move; what ends it is a
connection whose bytes stop moving. Each sample gives, per connection, its counters at one
instant (see :mod:`isthmus.comm.tcpstats`; a transport without sockets, or a collective run in
chunks, can feed the count of bytes done as ``acked``). :class:`ProgressWatch` keeps, per
connection, when its counters last advanced, and :meth:`ProgressWatch.verdict` classifies:

* **progressing**: some connection advanced (bytes acknowledged or received, or a data segment
  arrived, in order or not) within the last ``stall_s`` seconds, and none is silent. A slow
  link is never stuck, however long the whole transfer takes.
* **silent** (stuck, with a culprit): a connection holds data in flight that its remote has not
  acknowledged for ``stall_s``, and (where the source says) its kernel has retransmitted it on
  ``min_retransmits`` timeouts in a row: the path or the remote host is gone (a cut link, a
  one-way route, a firewall that drops). Or it holds data queued with nothing in flight whose
  probes went unanswered ``min_retransmits`` times in a row for ``stall_s`` (where the source
  counts them): a zero window that the cut froze, or a local firewall that drops the data
  before it leaves (the kernel then holds it unsent); a remote that does not read answers its
  window probes. A live path behind a deep queue on a slow link can go
  longer than ``stall_s`` without an acknowledgement, but one retransmission gets one. Per connection, so that one dead link is caught even while
  others still move data; the verdict names the remote, which is what a failure report needs.
* **not reading** (stuck after ``late_s``): data is queued but nothing is in flight and nothing
  advanced: the remote's kernel is there (it acknowledges window probes) but its process takes
  no data: it is stopped, busy, or not in the collective yet. Not a network fault; heartbeats
  catch a stopped process sooner, so this bound is the round's, not the link's.
* **idle** (stuck after ``late_s``): nothing queued, nothing in flight, nothing arriving: this
  member waits for data that some other member does not send. The members at the ends of the
  broken link (if one is) see it as silent and report it; the coordinator's abort then releases
  everybody, so an idle member does not need a short bound of its own.

Everything here is pure: times are what the caller gives (monotonic seconds), and the same
samples always give the same verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = ["ConnSample", "ProgressConfig", "ProgressWatch", "State", "Verdict"]


class State(str, Enum):
    PROGRESSING = "progressing"
    SILENT = "silent"
    NOT_READING = "not reading"
    IDLE = "idle"


@dataclass(frozen=True)
class ConnSample:
    """One connection at one instant: ``key`` names it (a socket inode, a chunk stream),
    ``remote`` says whom it leads to (``host:port``, or a member name), ``acked``/``received``
    are cumulative bytes, ``in_flight`` whether sent data awaits acknowledgement, ``queued``
    whether written data waits to be sent."""

    key: Hashable
    remote: str
    acked: int
    received: int
    in_flight: bool = False
    queued: bool = False
    retransmits: int | None = None
    """Consecutive retransmission timeouts of the data in flight (reset by an acknowledgement);
    None where the source does not say."""
    probes: int | None = None
    """Consecutive probes unanswered while data is queued and nothing is in flight (reset by
    any acknowledgement): zero-window probes, or the kernel's attempts to send queued data into
    an open window that fail before they leave the host (a local firewall drop); None where the
    source does not say. A remote that does not read still answers its window probes."""
    segs_in: int | None = None
    """Data segments that arrived so far, in order or not; None where the source does not say.
    A receiver that waits for one lost segment keeps getting the later ones, which do not
    advance ``received`` until the retransmission arrives (on a slow link's deep queue, for
    seconds): they still show that the remote sends."""
    rto_s: float | None = None
    """The connection's retransmission timeout (its measured round trip and variance, in
    seconds); None where the source does not say."""


@dataclass(frozen=True, kw_only=True)
class ProgressConfig:
    """``stall_s``: how long data in flight may go unacknowledged before its connection counts
    as silent. ``late_s``: how long a transfer may move no byte at all while no connection is
    silent (the remote is not reading, or this member waits for others). ``min_bytes``: how many
    bytes a connection must advance to count as moving (1: any byte). ``min_retransmits``: how
    many retransmission timeouts in a row a connection that says so must also have had to count
    as silent: on a slow link with a deep queue a live path can leave data unacknowledged for
    longer than ``stall_s`` (one timeout, then the acknowledgement), a dead one keeps timing out.
    """

    stall_s: float = 10.0
    late_s: float = 600.0
    min_bytes: int = 1
    min_retransmits: int = 3

    def __post_init__(self) -> None:
        for name in ("stall_s", "late_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"ProgressConfig.{name}: must be a finite number > 0, got {v!r}")
        if self.late_s < self.stall_s:
            raise ValueError("ProgressConfig.late_s: must be >= stall_s")
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool):
            raise ValueError(
                f"ProgressConfig.min_bytes: must be an integer, got {self.min_bytes!r}"
            )
        if self.min_bytes < 1:
            raise ValueError("ProgressConfig.min_bytes: must be >= 1")
        if not isinstance(self.min_retransmits, int) or self.min_retransmits < 0:
            raise ValueError(
                f"ProgressConfig.min_retransmits: must be an integer >= 0, "
                f"got {self.min_retransmits!r}"
            )


@dataclass(frozen=True)
class Verdict:
    """What the samples say: ``state``; ``stuck`` when the transfer should be given up;
    ``for_s``, how long the worst connection (or, when idle, the whole transfer) has not moved;
    ``remote``, whom the culprit connection leads to (silent and not reading); ``why``, one line
    for the failure report."""

    state: State
    stuck: bool
    for_s: float
    remote: str = ""
    why: str = ""


@dataclass
class _Conn:
    remote: str
    base: int  # acked + received when they last advanced by min_bytes
    moved_at: float  # when that was, or a data segment last arrived (or first seen)
    acked_base: int  # acked when it last advanced by min_bytes
    flight_from: float | None  # first sample with data in flight since acked last advanced
    in_flight: bool
    queued: bool
    retransmits: int | None = None
    segs: int | None = None  # segs_in at the last sample
    rto_s: float | None = None
    queued_from: float | None = None  # first sample queued, nothing in flight, since an ack
    probes: int | None = None


class ProgressWatch:
    """Per-connection progress of the transfers on a set of connections (a group's, a state
    transfer's).

    Feed it with :meth:`sample` (all connections at one instant; a connection missing from a
    sample is gone and forgotten) and ask :meth:`verdict`. ``started``: when watching began (the
    idle and not-reading bounds count from there at the latest, or from a verdict's ``since``).
    """

    def __init__(self, config: ProgressConfig | None = None, *, started: float = 0.0) -> None:
        self.config = config or ProgressConfig()
        self.started = started
        self.last_moved = started
        self.at = started
        self._conns: dict[Hashable, _Conn] = {}

    def sample(self, at: float, conns: Iterable[ConnSample]) -> None:
        """Record the connections' counters at ``at``. Samples older than the last one are
        ignored; a counter that went backwards is a new connection under an old key. A
        connection seen for the first time counts as movement. Data in flight counts as
        unacknowledged from the first sample that shows it after the last acknowledgement (so
        a connection that was idle for long and just sent is not taken for a silent one)."""
        if at < self.at:
            return
        self.at = at
        need = self.config.min_bytes
        seen: dict[Hashable, _Conn] = {}
        for s in conns:
            total = s.acked + s.received
            c = self._conns.get(s.key)
            if (
                c is None
                or total < c.base
                or s.acked < c.acked_base
                or s.remote != c.remote
                or (s.segs_in is not None and c.segs is not None and s.segs_in < c.segs)
            ):
                # a connection appearing (or made again) is movement too
                flight = at if s.in_flight else None
                c = _Conn(s.remote, total, at, s.acked, flight, s.in_flight, s.queued)
                c.queued_from = at if s.queued and not s.in_flight else None
                self.last_moved = max(self.last_moved, at)
            else:
                moved = total - c.base >= need
                if moved:
                    c.base = total
                # a data segment arriving out of order is the remote sending, too
                arrived = s.segs_in is not None and c.segs is not None and s.segs_in > c.segs
                if moved or arrived:
                    c.moved_at = at
                    self.last_moved = max(self.last_moved, at)
                blocked = s.queued and not s.in_flight
                if s.acked - c.acked_base >= need:
                    c.acked_base = s.acked
                    c.flight_from = at if s.in_flight else None
                    c.queued_from = at if blocked else None
                else:
                    if not s.in_flight:
                        c.flight_from = None
                    elif c.flight_from is None:
                        c.flight_from = at
                    if not blocked:
                        c.queued_from = None
                    elif c.queued_from is None:
                        c.queued_from = at
                c.in_flight, c.queued = s.in_flight, s.queued
            c.retransmits, c.segs, c.rto_s = s.retransmits, s.segs_in, s.rto_s
            c.probes = s.probes
            seen[s.key] = c
        self._conns = seen

    def in_flight(self) -> bool:
        """Whether some connection had sent data awaiting acknowledgement at the last sample (a
        live path in loss recovery on a slow link shows this for seconds without moving)."""
        return any(c.in_flight for c in self._conns.values())

    def moved_within(self, floor_s: float, now: float | None = None) -> bool:
        """Whether the transfer moved recently at ``now`` (default: the last sample's time):
        some connection advanced (bytes acknowledged or received, or a data segment arrived)
        within its own window, ``floor_s`` or, where longer, its retransmission timeout (at
        most ``late_s``), or watching began within ``floor_s``. Why the timeout: a path whose
        round trip is seconds (a slow link's deep queue) goes that long without a byte while
        both ends live, and after a loss nothing more arrives until the sender's timer fires
        (seconds to tens of seconds on such a path, doubling each time), so a pause shorter
        than that says nothing about the remote.
        """
        t = self.at if now is None else max(now, self.at)
        if t - self.started < floor_s:
            return True
        cap = self.config.late_s
        for c in self._conns.values():
            window = max(floor_s, min(c.rto_s or 0.0, cap))
            if t - c.moved_at < window:
                return True
        return False

    def describe(self, now: float | None = None) -> str:
        """One line on every connection at ``now`` (default: the last sample's time): whom it
        leads to, how long it has not moved, and what it holds; for logs."""
        t = self.at if now is None else max(now, self.at)
        if not self._conns:
            return "no connection watched"
        parts = []
        for c in sorted(self._conns.values(), key=lambda c: c.remote):
            flags = "".join(
                f for f, on in ((" in flight", c.in_flight), (" queued", c.queued)) if on
            )
            rto = f" rto {c.rto_s:.1f}s" if c.rto_s is not None else ""
            parts.append(f"{c.remote}: quiet {t - c.moved_at:.1f}s{flags}{rto}")
        return "; ".join(parts)

    def verdict(self, now: float | None = None, *, since: float | None = None) -> Verdict:
        """Classify at ``now`` (default: the last sample's time) the transfer that began at
        ``since`` (default: ``started``): a connection that moved nothing before the transfer
        began is not held against it."""
        cfg = self.config
        t = self.at if now is None else max(now, self.at)
        begin = self.started if since is None else since
        worst = self._worst(lambda c: self._unacked_for(c, t))
        if worst is not None and worst[0] >= cfg.stall_s:
            for_s, remote = worst
            held = "in flight" if any(c.in_flight for c in self._by(remote)) else "queued"
            why = f"no acknowledgement from {remote} for {for_s:.1f}s with data {held}"
            return Verdict(
                State.SILENT, True, for_s, remote, why + " (the path or the host is gone)"
            )
        quiet_for = t - max(self.last_moved, begin)
        stuck = quiet_for >= cfg.late_s
        if quiet_for < cfg.stall_s:
            return Verdict(State.PROGRESSING, False, quiet_for)
        if not self._conns:
            why = f"no connection to watch for {quiet_for:.1f}s"
            return Verdict(State.IDLE, stuck, quiet_for, "", why)
        worst = self._worst(
            lambda c: t - max(c.moved_at, begin) if c.queued and not c.in_flight else None
        )
        if worst is not None:
            for_s, remote = worst
            why = f"{remote} has taken no data for {for_s:.1f}s"
            why += " (its process is stopped, busy, or not in the collective)"
            return Verdict(State.NOT_READING, stuck, for_s, remote, why)
        why = f"no byte moved on any connection for {quiet_for:.1f}s (waiting for another member)"
        return Verdict(State.IDLE, stuck, quiet_for, "", why)

    def silent(self, now: float | None = None) -> list[tuple[str, float]]:
        """Every connection that is silent at ``now`` (default: the last sample's time), as
        :meth:`verdict` judges one: ``(remote, seconds its data in flight has gone
        unacknowledged)``, longest first. Unlike the verdict it does not depend on a transfer
        being waited for: a member whose collective completed once its last data was handed to
        its kernel still holds that data in flight, and this is how it can tell that the data
        never arrives (the heartbeat's ``transfer.silent``)."""
        t = self.at if now is None else max(now, self.at)
        found = [
            (a, c.remote)
            for c in self._conns.values()
            if (a := self._unacked_for(c, t)) is not None and a >= self.config.stall_s
        ]
        return [(remote, a) for a, remote in sorted(found, reverse=True)]

    def _unacked_for(self, c: _Conn, t: float) -> float | None:
        """How long ``c``'s data has waited at ``t`` for an acknowledgement that does not
        come: data in flight that its kernel also retransmitted ``min_retransmits`` times in a
        row (when it says), or data queued with nothing in flight whose probes went unanswered
        ``min_retransmits`` times in a row (only where the source counts them: a remote that
        does not read answers its window probes). Else None."""
        need = self.config.min_retransmits
        if (
            c.in_flight
            and c.flight_from is not None
            and (c.retransmits is None or c.retransmits >= need)
        ):
            return t - c.flight_from
        if (
            c.queued
            and not c.in_flight
            and c.queued_from is not None
            and c.probes is not None
            and c.probes >= max(need, 1)
        ):
            return t - c.queued_from
        return None

    def _by(self, remote: str) -> list[_Conn]:
        return [c for c in self._conns.values() if c.remote == remote]

    def _worst(self, age: Callable[[_Conn], float | None]) -> tuple[float, str] | None:
        """(age, remote) of the connection with the greatest ``age`` (None: not considered);
        ties to the greatest remote, so that the answer never depends on sample order."""
        found = [(a, c.remote) for c in self._conns.values() if (a := age(c)) is not None]
        return max(found) if found else None
