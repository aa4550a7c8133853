"""Measuring the links between an epoch's members, the pure part: who measures whom when, how
much to send, how timings become a rate, and how probes are smoothed. No network, no clock:
:mod:`isthmus.comm.probe` runs it over an epoch's group and times it.

* :func:`tournament` pairs every two members exactly once in rounds of disjoint pairs (the circle
  method of a round-robin tournament), so ``n`` members measure all ``n(n-1)/2`` pairs in
  ``n - 1`` rounds (``n`` when odd), the pairs of a round at once.
* A pair's round trip is the fastest of a few ping-pongs of one byte (the minimum filters a busy
  scheduler; a round trip is never shorter than the link's).
* Its rate, each way, is measured by the receiver with a :class:`Ladder` of transfers it asks the
  sender for and times from posting the receive to its end: 16 KiB, then four times more each
  time, until a transfer takes :data:`TARGET_S` and :data:`ROUND_TRIPS` round trips beyond the
  first or reaches the cap (``SessionConfig.probe_bytes``); that size is sent again and the
  faster of the two counts. A thin link stops the ladder early (10 Mbit/s on a short link: at
  64 KiB), so probing costs about the same time on every link, not the same bytes; the smaller
  transfers open the connection's congestion window for the one that counts. A link faster than
  the last transfer can tell (:data:`RESOLUTION_S`) reports that ceiling.
* :func:`rate_mbit` takes one round trip off the transfer's time (the request's way there and the
  data's way back), so a long link is not taken for a thin one by that round trip. What it does
  not undo is the window: on a long fat link the cap ends the ladder while TCP is still opening
  its window, and a link reads thinner than it is, the more so the longer its round trip (in
  the lab, identical long fat links read anywhere from a few Mbit/s to their full rate:
  docs/BENCHMARKS.md, "Issue 19: the default K from measurement, and what a link probe
  costs"). This is one reason probing is off by default (``SessionConfig.probe_links``). A probe also measures one connection, where
  the data may be striped over ``connections``.
* :class:`LinkTable` keeps the last probe's links by peer id, each averaged with the probe
  before it when the same peer was measured then (:func:`smooth`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FIRST_BYTES",
    "GROWTH",
    "RESOLUTION_S",
    "ROUND_TRIPS",
    "TARGET_S",
    "Ladder",
    "Link",
    "LinkTable",
    "rate_mbit",
    "smooth",
    "tournament",
]

FIRST_BYTES = 16 * 1024
"""The ladder's first transfer: a few TCP segments, over in one round trip on most links."""
GROWTH = 4
"""Each transfer of the ladder is this many times the one before."""
TARGET_S = 0.05
"""A transfer this long beyond the round trip ends the ladder: tbf's bucket (10 ms of traffic in
the lab) and the scheduler's hiccups are then a small part of it."""
ROUND_TRIPS = 2
"""...and at least this many round trips beyond the first: on a long link the first transfers
spend their time opening TCP's window (slow start: a round trip per doubling), not moving bytes
at the link's rate, and stopping there would take a long link for a thin one."""
RESOLUTION_S = 0.005
"""A transfer of ``B`` bytes tells rates apart up to ``B`` per this long (a thread switch, a busy
core cost about a millisecond): a faster link reports that ceiling (1 MiB: 1,678 Mbit/s). So
links too fast to tell apart (loopback, one machine) report the same rate, and the ring keeps
name order among them instead of following noise."""
_FLOOR = 0.1
"""A transfer's time less its round trip counts as at least this share of its time (a transfer
far shorter than the round trip measures the round trip, not the rate)."""


def tournament(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs ``(first, second)`` of positions ``0..n-1``: every pair exactly
    once, ``n - 1`` rounds for an even ``n`` and ``n`` for an odd one (each member sits one
    out). ``first`` measures the rate it receives at first. Deterministic: every member computes the
    same rounds. Raises ValueError for ``n < 0``."""
    if n < 0:
        raise ValueError(f"tournament needs n >= 0, got {n}")
    if n < 2:
        return []
    m = n + n % 2  # an odd n gets a phantom member: its partner sits the round out
    fixed = m - 1
    rounds = []
    for r in range(m - 1):
        pairs = [(r, fixed) if r % 2 == 0 else (fixed, r)]
        for i in range(1, m // 2):
            pairs.append(((r + i) % (m - 1), (r - i) % (m - 1)))
        rounds.append([p for p in pairs if max(p) < n])
    return rounds


def rate_mbit(nbytes: int, seconds: float, rtt_s: float) -> float:
    """The rate, Mbit/s, of a transfer of ``nbytes`` that took ``seconds`` from its request (the
    receive posted) to its last byte received, on a link of round trip ``rtt_s``: the bytes over
    the time less one round trip (at least :data:`_FLOOR` of the time). Raises ValueError for a
    non-positive size or time."""
    if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"rate_mbit needs bytes > 0 and seconds > 0, got {nbytes}, {seconds}")
    busy = max(seconds - max(rtt_s, 0.0), _FLOOR * seconds)
    return nbytes * 8 / busy / 1e6


class Ladder:
    """The measuring (receiving) side of one pair's rate: :meth:`next` gives the size of the next
    transfer (0: done), :meth:`record` takes its time, :meth:`rate` gives the result.

    Sizes grow from :data:`FIRST_BYTES` by :data:`GROWTH` while a transfer takes less than
    ``target_s`` (and :data:`ROUND_TRIPS` round trips) beyond ``rtt_s`` and the next one fits
    under ``cap``; the last size is then sent
    ``repeats`` more times, and the rate is the best of the transfers at that size."""

    def __init__(
        self, *, cap: int, rtt_s: float, target_s: float = TARGET_S, repeats: int = 1
    ) -> None:
        if cap < 1 or repeats < 0 or not target_s > 0:
            raise ValueError(f"Ladder needs cap >= 1, repeats >= 0, target_s > 0: {cap}, {repeats}")
        self.cap = cap
        self.rtt_s = max(rtt_s, 0.0)
        self.target_s = target_s
        self.repeats = repeats
        self._size = min(FIRST_BYTES, cap)
        self._climbing = True
        self._left = repeats
        self.times: list[tuple[int, float]] = []
        """Every transfer so far: (bytes, seconds)."""

    def next(self) -> int:
        """The size of the next transfer, bytes; 0 when the measurement is complete."""
        if not self.times:
            return self._size
        if self._climbing:
            size, seconds = self.times[-1]
            long_enough = max(self.target_s, ROUND_TRIPS * self.rtt_s)
            if seconds - self.rtt_s < long_enough and size * GROWTH <= self.cap:
                self._size = size * GROWTH
                return self._size
            self._climbing = False
        if self._left > 0:
            self._left -= 1
            return self._size
        return 0

    def record(self, nbytes: int, seconds: float) -> None:
        """The transfer of ``nbytes`` took ``seconds`` (request to last byte)."""
        self.times.append((nbytes, seconds))

    def rate(self) -> float:
        """Mbit/s: the best of the transfers at the last size, at most that size per
        :data:`RESOLUTION_S`. Raises ValueError before any transfer."""
        if not self.times:
            raise ValueError("no transfer recorded")
        size = self.times[-1][0]
        best = max(rate_mbit(b, s, self.rtt_s) for b, s in self.times if b == size)
        return min(best, size * 8 / RESOLUTION_S / 1e6)

    def sent(self) -> int:
        """Bytes sent so far."""
        return sum(b for b, _ in self.times)


@dataclass(frozen=True)
class Link:
    """What a probe measured between this peer and another: the rate at which the other sends to
    this one, Mbit/s, and their round trip, ms."""

    mbit: float
    rtt_ms: float

    def to_json(self) -> dict[str, float]:
        return {"mbit": round(self.mbit, 3), "rtt_ms": round(self.rtt_ms, 3)}


def smooth(old: Link | None, new: Link, weight: float = 0.5) -> Link:
    """``new`` averaged with ``old`` (``weight`` on ``new``): one probe's noise moves a link half
    as far. ``old`` None: ``new``."""
    if old is None:
        return new
    w = weight
    return Link(
        mbit=w * new.mbit + (1 - w) * old.mbit, rtt_ms=w * new.rtt_ms + (1 - w) * old.rtt_ms
    )


class LinkTable:
    """The links this peer last measured, by peer id (an id names one registration of a peer, so
    a restarted peer starts afresh)."""

    def __init__(self) -> None:
        self.links: dict[int, Link] = {}
        self.probes = 0
        """Probes completed."""

    def update(self, measured: Mapping[int, Link]) -> None:
        """A complete probe measured ``measured``: keep those peers only (the others are no
        longer members), each smoothed with its previous value."""
        self.links = {pid: smooth(self.links.get(pid), link) for pid, link in measured.items()}
        self.probes += 1

    def report(self) -> dict[str, dict[str, float]]:
        """The links as a heartbeat carries them: ``{"<peer id>": {"mbit", "rtt_ms"}}`` (the
        coordinator's ring order reads ``mbit``; :func:`isthmus.coordinator.ring.ring_members`)."""
        return {str(pid): link.to_json() for pid, link in sorted(self.links.items())}
