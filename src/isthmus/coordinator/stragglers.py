"""Stragglers and slow links found from the peers' own timings.

The collectives of a data-parallel job are periodic and homogeneous (the observation behind C4):
every member does the same work between two rounds, so a member whose timings stand out is the
one holding the run back. Here each peer reports, with its heartbeats, the timing of its latest step
(``timing = {"step": s, "work_s": w, "sync_s": c, "links": {peer: seconds}}``: seconds of its
own computation, seconds in the round's synchronization, and optionally the seconds of
transfers with named peers). The coordinator feeds every new step's timing to a
:class:`StragglerDetector`, which is pure (values in, events out; no clock, no network) so that
its rules are tested without processes.

**Rules** (defaults in :class:`StragglerConfig`):

* A peer's *current* time is the median of its last three ``work_s`` reports (one hiccup does
  not count). Its *reference* is the median of the other reporting peers' current times (the
  others only: with two peers, the other one). An observation is *slow* when the current time
  exceeds ``factor`` (k) times the reference.
* After ``rounds`` (m) slow observations in a row the peer is flagged (event ``straggler``);
  after ``rounds`` normal ones in a row it is cleared (event ``straggler_cleared``). Each peer
  also keeps a robust baseline per round type (``work`` and ``sync``): the median of its last
  ``window`` observations taken while it was not flagged, reported in :meth:`status`.
* **Links.** When every reporting peer's ``sync_s`` stays beyond k times its own baseline for m
  observations while no peer is flagged, the synchronization itself slowed down: event
  ``link_anomaly`` (an all-reduce's timings cannot say which link; ``pair`` is null). When peers
  report per-peer transfer times (``links``), a pair whose time stays beyond k times the median
  of all pairs for m observations is named: ``link_anomaly`` with ``pair = [a, b]``.

What the coordinator does with a flag is the run's ``straggler_policy``: ``warn`` (the event,
the ``/v1/status`` field and the summary's count), ``evict`` (the peer is also removed; it
registers again at once, joins as any joiner, and is removed again while it stays slow) or
``reweight`` (as ``warn``: with DiLoCo's time budget a slow peer already does fewer inner steps
and its outer gradient counts for less).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from isthmus.settings import setting

__all__ = ["POLICIES", "StragglerConfig", "StragglerDetector"]

POLICIES = ("warn", "evict", "reweight")
Event = tuple[str, dict[str, Any]]
"""(kind, fields) of an event for the coordinator's log."""


@dataclass(kw_only=True)
class StragglerConfig:
    """``[stragglers]``: when a peer counts as a straggler, and what happens then. Raises
    ValueError naming a bad value."""

    factor: float = setting(
        2.0,
        flat="straggler_factor",
        help="k: a time beyond k times the reference is slow.",
    )
    rounds: int = setting(
        3,
        flat="straggler_rounds",
        help="m: this many slow (or normal) observations in a row flag (or clear) a peer.",
    )
    window: int = setting(
        32, flat="straggler_window", help="Observations a per-peer baseline is the median of."
    )
    policy: Literal["warn", "evict", "reweight"] = setting(
        "warn",
        flat="straggler_policy",
        help="""What a flag does: warn (an event, a /v1/status field, the summary's count), evict
        (the peer is removed; it may rejoin) or reweight (as warn; for DiLoCo's time budget,
        which already gives a slow peer fewer steps and less weight).""",
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)):
            raise ValueError(f"stragglers.factor must be a number > 1, got {self.factor!r}")
        if self.factor <= 1:
            raise ValueError(f"stragglers.factor must be a number > 1, got {self.factor!r}")
        for name, low in (("rounds", 1), ("window", 3)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"stragglers.{name} must be an integer >= {low}, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"stragglers.policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass
class _Peer:
    name: str
    window: int
    step: int = -1
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=3))
    work: deque[float] = field(default_factory=deque)
    sync: deque[float] = field(default_factory=deque)
    sync_recent: deque[float] = field(default_factory=lambda: deque(maxlen=3))
    slow_run: int = 0
    fine_run: int = 0
    flagged_at: int | None = None  # the step at which it was flagged
    held: float | None = None  # its current time as held in the detector's sorted list
    sync_slow: bool = False  # its synchronization is beyond k times its own baseline

    def __post_init__(self) -> None:
        self.work = deque(maxlen=self.window)
        self.sync = deque(maxlen=self.window)

    @property
    def current(self) -> float:
        return _median(self.recent)


def _median(xs: Any) -> float:
    """``statistics.median`` of a few numbers, without its general machinery (once per
    report of every peer)."""
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return float(s[n // 2])
    return (s[n // 2 - 1] + s[n // 2]) / 2


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) and v >= 0 else None


class StragglerDetector:
    """Flags stragglers and slow links from reported timings (see the module docstring)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.peers: dict[int, _Peer] = {}
        self.flags = 0
        """Peers flagged so far (a peer flagged twice counts twice)."""
        self.link_anomalies = 0
        self._sync_run = 0
        self._link_runs: dict[tuple[str, str], int] = {}
        self._links_flagged: set[tuple[str, str]] = set()
        self._pair_times: dict[tuple[str, str], float] = {}
        # Kept as peers report, so that one report costs a search rather than a pass over every
        # peer: the current times of the peers that reported work (sorted), and how many peers
        # report synchronization, how many of those are slow at it, and how many are flagged.
        self._currents: list[float] = []
        self._reporting = 0
        self._sync_slow = 0
        self._flagged = 0

    def forget(self, peer: int) -> None:
        """The peer left or was removed: its timings no longer count."""
        p = self.peers.pop(peer, None)
        if p is None:
            return
        if p.held is not None:
            del self._currents[bisect.bisect_left(self._currents, p.held)]
        self._reporting -= bool(p.sync_recent)
        self._sync_slow -= p.sync_slow
        self._flagged -= p.flagged_at is not None

    def observe(self, peer: int, name: str, timing: Mapping[str, Any]) -> list[Event]:
        """One heartbeat's ``timing`` of ``peer``; returns the events it causes. A report of a
        step already seen, or without a usable ``work_s``, is ignored (malformed values are
        a peer's bug, not the coordinator's: nothing raises)."""
        step = timing.get("step")
        work = _number(timing.get("work_s"))
        if isinstance(step, bool) or not isinstance(step, int) or work is None:
            return []
        p = self.peers.get(peer)
        if p is None:
            p = self.peers[peer] = _Peer(name, self.config.window)
        if step <= p.step:
            return []
        p.step = step
        p.recent.append(work)
        self._hold_current(p)
        sync = _number(timing.get("sync_s"))
        if sync is not None:
            self._reporting += not p.sync_recent
            p.sync_recent.append(sync)
        flagged = p.flagged_at is not None
        events = self._judge(peer, p)
        self._flagged += (p.flagged_at is not None) - flagged
        if p.flagged_at is None:
            p.work.append(work)
            if sync is not None:
                p.sync.append(sync)
        self._judge_own_sync(p)
        events += self._judge_sync()
        links = timing.get("links")
        if isinstance(links, Mapping):
            events += self._judge_links(name, links)
        return events

    def _hold_current(self, p: _Peer) -> None:
        """Put ``p``'s new current time in the sorted list in place of its old one."""
        if p.held is not None:
            del self._currents[bisect.bisect_left(self._currents, p.held)]
        p.held = p.current
        bisect.insort(self._currents, p.held)

    def _reference(self, p: _Peer) -> float | None:
        """The median of the other reporting peers' current times (None: no other peer),
        read off the sorted list without ``p``'s own entry."""
        xs = self._currents
        n = len(xs) - 1
        if n < 1:
            return None
        skip = bisect.bisect_left(xs, p.held)  # p's entry (an equal value is the same)

        def at(i: int) -> float:
            return xs[i + 1] if i >= skip else xs[i]

        if n % 2:
            return at(n // 2)
        return (at(n // 2 - 1) + at(n // 2)) / 2

    def _judge(self, pid: int, p: _Peer) -> list[Event]:
        reference = self._reference(p)
        if reference is None:
            return []
        k, m = self.config.factor, self.config.rounds
        current = p.held if p.held is not None else p.current
        slow = reference > 0 and current > k * reference
        p.slow_run, p.fine_run = (p.slow_run + 1, 0) if slow else (0, p.fine_run + 1)
        if p.flagged_at is None and p.slow_run >= m:
            p.flagged_at = p.step
            self.flags += 1
            detail = self._detail(pid, p, current, reference)
            return [("straggler", {**detail, "policy": self.config.policy})]
        if p.flagged_at is not None and p.fine_run >= m:
            p.flagged_at = None
            return [("straggler_cleared", self._detail(pid, p, current, reference))]
        return []

    @staticmethod
    def _detail(pid: int, p: _Peer, current: float, reference: float) -> dict[str, Any]:
        """An event's fields (built only for an event: most reports cause none)."""
        return {
            "peer": pid,
            "name": p.name,
            "step": p.step,
            "work_s": round(current, 6),
            "reference_s": round(reference, 6),
            "ratio": round(current / reference, 3) if reference > 0 else None,
        }

    def _judge_sync(self) -> list[Event]:
        """Every reporting peer's synchronization beyond k times its own baseline, nobody
        flagged: the network (or the coordinator) slowed down, not a peer."""
        m = self.config.rounds
        if self._reporting < 2 or self._flagged:
            self._sync_run = 0
            return []
        slow = self._sync_slow == self._reporting
        self._sync_run = self._sync_run + 1 if slow else 0
        if self._sync_run == m:
            self.link_anomalies += 1
            reporting = [p for p in self.peers.values() if p.sync_recent]
            return [("link_anomaly", {"pair": None, "peers": sorted(p.name for p in reporting)})]
        return []

    def _judge_own_sync(self, p: _Peer) -> None:
        """Whether ``p``'s synchronization is beyond k times its own baseline (it changes only
        when ``p`` reports, so it is judged then and counted)."""
        k, m = self.config.factor, self.config.rounds
        slow = bool(
            p.sync_recent and len(p.sync) >= m and _median(p.sync_recent) > k * _median(p.sync)
        )
        self._sync_slow += slow - p.sync_slow
        p.sync_slow = slow

    def _judge_links(self, name: str, links: Mapping[str, Any]) -> list[Event]:
        for other, seconds in links.items():
            v = _number(seconds)
            if v is not None and isinstance(other, str):
                a, b = sorted((name, other))
                self._pair_times[(a, b)] = v
        if len(self._pair_times) < 3:
            return []  # a median of fewer pairs says nothing
        reference = statistics.median(self._pair_times.values())
        k, m = self.config.factor, self.config.rounds
        events: list[Event] = []
        for pair, t in self._pair_times.items():
            if name not in pair:
                continue  # judged when one of its ends reports
            slow = reference > 0 and t > k * reference
            run = self._link_runs.get(pair, 0) + 1 if slow else 0
            self._link_runs[pair] = run
            if run >= m and pair not in self._links_flagged:
                self._links_flagged.add(pair)
                self.link_anomalies += 1
                events.append(
                    ("link_anomaly", {"pair": list(pair), "seconds": t, "reference_s": reference})
                )
            elif run == 0:
                self._links_flagged.discard(pair)
        return events

    def status(self) -> dict[str, Any]:
        """For ``/v1/status``: the flagged peers, the counts, each peer's baselines and the
        rules in force."""
        c = self.config
        return {
            "flagged": sorted(p.name for p in self.peers.values() if p.flagged_at is not None),
            "flags": self.flags,
            "link_anomalies": self.link_anomalies,
            "slow_links": sorted(list(pair) for pair in self._links_flagged),
            "baselines": {
                p.name: {
                    "work_s": round(statistics.median(p.work), 6) if p.work else None,
                    "sync_s": round(statistics.median(p.sync), 6) if p.sync else None,
                }
                for p in self.peers.values()
            },
            "rules": {"factor": c.factor, "rounds": c.rounds, "policy": c.policy},
        }
