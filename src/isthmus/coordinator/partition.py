"""Who takes part when live members cannot all reach each other: the pure partition rule.

Every member of an epoch must connect to every other one (a Gloo group is a full mesh), so one
pair that cannot connect fails the whole epoch, however well both ends reach the coordinator.
This module turns what peers report into a decision, without any network or clock of its own:

* **Reachability.** A pair is *down* from the first report that one of its ends could not reach
  the other (refused, timed out, reset, or a stalled transfer), in either direction: a one-way
  route fails a Gloo pair as surely as a cut cable. It stays down until probes (cheap connection
  attempts between the two, made by the peers) succeed again, and the more often a pair has
  failed, the longer its probes must keep succeeding before it is trusted again (flapping links
  are held out instead of failing an epoch every time they come back). A pair that just failed
  is therefore never put into an epoch again unless something changed: a probe succeeded, the
  caller forgot the pair because one of its members is a new process, or its trial is due.
* **Who sits out.** :meth:`Reachability.decide` keeps the largest set of members whose pairs are
  all up (a maximum clique of the "not known to fail" graph). It searches the complement, the
  few failed pairs, for a smallest set of members covering every one of them (a vertex cover),
  which is cheap when few pairs fail, whatever the number of members. Ties go to the set that
  keeps the most senior members (lowest ``seniority`` position first): they most likely hold the
  run's state, and the choice stays the same from one round to the next. With ``holders`` (the
  members that hold the run's state) a set that keeps one of them beats any set that keeps none.
  The search is bounded by ``PartitionConfig.max_steps`` search nodes (a count, not a time, so the
  decision is the same on every machine); past it, members are left out greedily (the one with
  the most failed pairs first, the most junior on ties), which still yields a set whose pairs are
  all up, possibly not the largest (the decision says so: ``exact`` is False).
* **Re-admission.** A member left out comes back in the first decision after its pairs with the
  kept members are up again.
* **Trials.** A pair whose probes keep failing is tried in an epoch again after
  ``PartitionConfig.trial_after_s``: a probe can fail where the group would connect.

Decisions depend only on the events given, never on the order they were given in: events are
kept per pair and replayed sorted by time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "Decision",
    "FailureReport",
    "How",
    "PairState",
    "PartitionConfig",
    "ProbeResult",
    "Reachability",
]


class How(str, Enum):
    """How a connection between two members failed."""

    REFUSED = "refused"
    TIMED_OUT = "timed out"
    RESET = "reset"
    STALLED = "stalled"


@dataclass(frozen=True)
class FailureReport:
    """``reporter`` could not reach ``remote`` (at ``address``, ``host:port``) at time ``at``."""

    reporter: str
    remote: str
    address: str
    how: How
    at: float


@dataclass(frozen=True)
class ProbeResult:
    """A probe between ``a`` and ``b`` (either direction) at time ``at``: ``ok`` if it connected."""

    a: str
    b: str
    ok: bool
    at: float


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """Bounds of the partition rule.

    ``settle_s``: how long probes of a pair must keep succeeding before a pair that failed
    ``k`` times (episodes) is up again: ``settle_s * 2**(k-2)`` for ``k >= 2``, capped at
    ``settle_max_s``; after its first failure one successful probe is enough.
    ``forget_after_s``: a pair that stayed up this long after its last failure starts counting
    episodes from zero again. ``probe_every_s``: how often a down pair is probed.
    ``max_steps``: search nodes of the exact search before the greedy rule takes over.
    ``history``: events kept per pair (the oldest are dropped; episodes already counted stay).
    ``trial_after_s``: a pair still down this long after its last failure report (its probes
    kept failing) is tried in an epoch again: a probe uses another port than the group and can
    fail where the group would connect, which must not isolate a member forever. A trial that
    fails is a new report, so a pair costs at most one failed epoch per ``trial_after_s``.
    None: never.
    """

    settle_s: float = 10.0
    settle_max_s: float = 300.0
    forget_after_s: float = 600.0
    probe_every_s: float = 5.0
    max_steps: int = 20_000
    history: int = 64
    trial_after_s: float | None = 900.0

    def __post_init__(self) -> None:
        names = ["settle_s", "settle_max_s", "forget_after_s", "probe_every_s"]
        if self.trial_after_s is not None:
            names.append("trial_after_s")
        for name in names:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"PartitionConfig.{name}: must be a finite number >= 0, got {v!r}")
        if self.probe_every_s <= 0:
            raise ValueError("PartitionConfig.probe_every_s: must be > 0")
        if self.settle_max_s < self.settle_s:
            raise ValueError("PartitionConfig.settle_max_s: must be >= settle_s")
        for name in ("max_steps", "history"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PartitionConfig.{name}: must be an integer >= 1, got {v!r}")

    def settle_for(self, episodes: int) -> float:
        """Seconds of successful probes a pair with ``episodes`` failures needs to be up again."""
        if episodes <= 1:
            return 0.0
        return min(self.settle_s * 2.0 ** (episodes - 2), self.settle_max_s)


@dataclass(frozen=True)
class PairState:
    """What the events of one pair say at a time: ``down``, how many failure ``episodes``,
    the last failure (``failed_at``, a report or a failed probe), the last report (who could
    not reach whom where, how) and when it was last probed."""

    down: bool
    episodes: int
    failed_at: float | None
    last_report: FailureReport | None
    last_probe_at: float | None


@dataclass(frozen=True)
class Decision:
    """Who takes part: ``keep`` (in the order given), ``out`` (member -> reason), ``back``
    (members out in the previous decision and kept now), ``exact`` (False when the search hit
    its bound and the greedy rule chose), ``why``, one line on how the choice was made, and
    ``trials``, the down pairs tried again (``PartitionConfig.trial_after_s``)."""

    keep: tuple[str, ...]
    out: Mapping[str, str]
    back: tuple[str, ...] = ()
    exact: bool = True
    why: str = ""
    trials: tuple[tuple[str, str], ...] = ()


# Replay order of events at the same instant: probes before failures, so that a probe taken at
# the same time as a failure never heals it.
_PROBE, _FAIL = 0, 1


@dataclass(order=True, frozen=True)
class _Event:
    at: float
    kind: int
    ok: bool = field(compare=True)
    tie: tuple[str, ...] = field(compare=True, default=())
    report: FailureReport | None = field(compare=False, default=None)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class Reachability:
    """The reachability picture of a run, built from failure reports and probe results.

    Pure and single-threaded: the caller (the coordinator) feeds it events with their times and
    asks it for decisions; it never reads a clock. Members are named by strings the caller
    chooses (a slot name, or a peer id as text).
    """

    def __init__(self, config: PartitionConfig | None = None) -> None:
        self.config = config or PartitionConfig()
        self._events: dict[tuple[str, str], list[_Event]] = {}
        # episodes counted, and the last report held, by events dropped from the bounded history
        self._carried: dict[tuple[str, str], int] = {}
        self._carried_report: dict[tuple[str, str], FailureReport] = {}

    # -- events ---------------------------------------------------------------------------------
    def report(self, r: FailureReport) -> None:
        """Record that ``r.reporter`` could not reach ``r.remote``; the pair is down from
        ``r.at`` (a report naming the reporter itself is ignored)."""
        if r.reporter == r.remote:
            return
        tie = (r.reporter, r.remote, r.address, r.how.value)
        self._add(_pair(r.reporter, r.remote), _Event(r.at, _FAIL, False, tie, r))

    def probe(self, p: ProbeResult) -> None:
        """Record a probe between ``p.a`` and ``p.b``. A failed probe counts as a failure."""
        if p.a == p.b:
            return
        self._add(_pair(p.a, p.b), _Event(p.at, _PROBE, p.ok, _pair(p.a, p.b)))

    def forget(self, member: str) -> None:
        """Drop everything known about ``member``'s pairs (it is a new process now, or gone)."""
        for key in [k for k in self._events if member in k]:
            del self._events[key]
            self._carried.pop(key, None)
            self._carried_report.pop(key, None)

    def _add(self, key: tuple[str, str], ev: _Event) -> None:
        evs = self._events.setdefault(key, [])
        evs.append(ev)
        if len(evs) > self.config.history:
            evs.sort()
            # Dropping the oldest events must not make a flapping pair look fresh: the episodes
            # they held are carried over.
            before = self._replay(key, evs).episodes
            if evs[0].report is not None:  # the newest report dropped so far stays known
                self._carried_report[key] = evs[0].report
            del evs[0]
            after = self._replay(key, evs).episodes
            self._carried[key] = self._carried.get(key, 0) + max(0, before - after)

    # -- state ------------------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        """Nothing is known about any pair (no failure, no probe): every decision keeps every
        member, and no pair is down, due a probe or a trial."""
        return not self._events

    def pair_state(self, a: str, b: str) -> PairState:
        """What is known about the pair ``a``-``b`` after every event given so far."""
        key = _pair(a, b)
        return self._replay(key, sorted(self._events.get(key, ())))

    def _replay(self, key: tuple[str, str], evs: Sequence[_Event]) -> PairState:
        cfg = self.config
        episodes = self._carried.get(key, 0)
        down = False
        failed_at: float | None = None
        last: FailureReport | None = self._carried_report.get(key)
        first_ok: float | None = None
        probed: float | None = None
        for ev in evs:
            if ev.kind == _PROBE:
                probed = ev.at
            if ev.kind == _FAIL or not ev.ok:
                if not down:
                    if failed_at is not None and ev.at - failed_at > cfg.forget_after_s:
                        episodes = 0
                    episodes += 1
                    down = True
                failed_at = ev.at
                if ev.report is not None:
                    last = ev.report
                first_ok = None
            elif down:
                first_ok = ev.at if first_ok is None else first_ok
                if ev.at - first_ok >= cfg.settle_for(episodes):
                    down, first_ok = False, None
        return PairState(down, episodes, failed_at, last, probed)

    def down_pairs(self, members: Iterable[str]) -> list[tuple[str, str]]:
        """The pairs among ``members`` that are down, sorted."""
        ms = set(members)
        return sorted(
            k for k in self._events if k[0] in ms and k[1] in ms and self.pair_state(*k).down
        )

    def on_trial(self, a: str, b: str, now: float) -> bool:
        """Whether the down pair ``a``-``b`` is due a trial at ``now``: its last report is
        ``trial_after_s`` old (see :class:`PartitionConfig`)."""
        limit = self.config.trial_after_s
        st = self.pair_state(a, b)
        if limit is None or not st.down or st.last_report is None:
            return False
        return now - st.last_report.at >= limit

    def probes_due(self, members: Iterable[str], now: float) -> list[tuple[str, str]]:
        """The down pairs among ``members`` that should be probed at ``now``: not probed (nor
        failed) within ``probe_every_s``. The caller asks one end of each to try to connect."""
        out = []
        for a, b in self.down_pairs(members):
            st = self.pair_state(a, b)
            last = max(x for x in (st.failed_at, st.last_probe_at) if x is not None)
            if now - last >= self.config.probe_every_s:
                out.append((a, b))
        return out

    # -- the decision -----------------------------------------------------------------------------
    def decide(
        self,
        members: Sequence[str],
        *,
        seniority: Sequence[str] | None = None,
        holders: Iterable[str] = (),
        previous: Decision | None = None,
        now: float | None = None,
    ) -> Decision:
        """The largest subset of ``members`` whose pairs are all up, and why the rest sit out.

        ``seniority``: members from the longest-serving down (default: ``members`` sorted by
        name); members missing from it rank after it, by name. ``holders``: members that hold the
        run's state; a subset keeping one of them is preferred to any that keeps none.
        ``previous``: the last decision, to tell which members are ``back``. ``now``: the
        time, to give pairs due a trial their trial (without it, no trials).
        Never raises for any input: with no down pair every member is kept.
        """
        ms = list(dict.fromkeys(members))
        rank = _ranks(ms, seniority)
        edges = self.down_pairs(ms)
        trials: tuple[tuple[str, str], ...] = ()
        if now is not None:
            trials = tuple(e for e in edges if self.on_trial(*e, now))
            edges = [e for e in edges if e not in trials]
        holder_set = {h for h in holders if h in rank}
        out_set, exact, why = _choose(ms, edges, rank, holder_set, self.config.max_steps)
        keep = tuple(m for m in ms if m not in out_set)
        reasons = {m: self._reason(m, keep, rank) for m in sorted(out_set, key=rank.__getitem__)}
        back: tuple[str, ...] = ()
        if previous is not None:
            back = tuple(m for m in keep if m in previous.out)
        return Decision(keep, reasons, back, exact, why, trials)

    def _reason(self, m: str, keep: Sequence[str], rank: Mapping[str, int]) -> str:
        """``isolated: cannot reach X at ADDR`` naming the most senior kept member ``m`` cannot
        reach (or that cannot reach ``m``)."""
        for k in sorted(keep, key=rank.__getitem__):
            st = self.pair_state(m, k)
            if not st.down:
                continue
            r = st.last_report
            if r is None:
                return f"isolated: probes to {k} fail"
            if r.reporter == m:
                return f"isolated: cannot reach {k} at {r.address} ({r.how.value})"
            return f"isolated: {k} cannot reach it at {r.address} ({r.how.value})"
        return "isolated: left out to keep a larger group whose members all reach each other"


def _ranks(members: Sequence[str], seniority: Sequence[str] | None) -> dict[str, int]:
    order = list(seniority) if seniority is not None else sorted(members)
    pos = {m: i for i, m in enumerate(dict.fromkeys(order))}
    rest = sorted(m for m in members if m not in pos)
    base = len(pos)
    return {m: pos[m] if m in pos else base + rest.index(m) for m in members}


class _Budget(Exception):
    """The exact search used up its steps."""


class _Search:
    """Smallest vertex covers of the failed-pair graph, by branching, with a step budget."""

    def __init__(self, rank: Mapping[str, int], max_steps: int) -> None:
        self.rank = rank
        self.steps = 0
        self.max_steps = max_steps

    def min_cover(self, adj: Mapping[str, frozenset[str]], limit: int) -> int | None:
        """Size of a smallest cover of ``adj``'s edges if it is <= ``limit``, else None."""
        self.steps += 1
        if self.steps > self.max_steps:
            raise _Budget
        live = {v: ns for v, ns in adj.items() if ns}
        if not live:
            return 0
        if limit <= 0:
            return None
        if _matching(live) > limit:  # each matched edge needs its own cover member
            return None
        # branch on the member with the most failed pairs (the most junior on ties)
        v = max(live, key=lambda x: (len(live[x]), self.rank[x]))
        ns = live[v]
        best: int | None = None
        if len(ns) <= limit:  # v stays: all its neighbours sit out
            sub = self.min_cover(_without(live, ns), limit - len(ns))
            if sub is not None:
                best = sub + len(ns)
        cap = limit if best is None else best - 1
        sub = self.min_cover(_without(live, {v}), cap - 1)  # v sits out
        if sub is not None and (best is None or sub + 1 < best):
            best = sub + 1
        return best


def _without(adj: Mapping[str, frozenset[str]], gone: Iterable[str]) -> dict[str, frozenset[str]]:
    g = set(gone)
    return {v: ns - g for v, ns in adj.items() if v not in g}


def _matching(adj: Mapping[str, frozenset[str]]) -> int:
    used: set[str] = set()
    n = 0
    for v in sorted(adj):
        if v in used:
            continue
        for w in sorted(adj[v]):
            if w not in used:
                used |= {v, w}
                n += 1
                break
    return n


def _choose(
    members: Sequence[str],
    edges: Sequence[tuple[str, str]],
    rank: Mapping[str, int],
    holders: set[str],
    max_steps: int,
) -> tuple[set[str], bool, str]:
    """Who sits out: (members left out, exact, why)."""
    if not edges:
        return set(), True, "every pair is up"
    adj: dict[str, set[str]] = {m: set() for m in members}
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    frozen = {v: frozenset(ns) for v, ns in adj.items()}
    search = _Search(rank, max_steps)
    try:
        return _exact(frozen, rank, holders, search)
    except _Budget:
        out = _greedy(frozen, rank, holders)
        return (
            out,
            False,
            (
                f"the exact search stopped at its bound of {max_steps} steps; members "
                f"with the most failed pairs were left out first"
            ),
        )


def _exact(
    adj: dict[str, frozenset[str]], rank: Mapping[str, int], holders: set[str], search: _Search
) -> tuple[set[str], bool, str]:
    n = len(adj)
    size = search.min_cover(adj, n)
    assert size is not None
    why = "the largest group whose members all reach each other"
    out = _lexicographic(adj, size, rank, search)
    if not holders or holders - out:
        return out, True, why + "; ties keep the longest-serving members"
    # No largest group keeps a member holding the run's state: keep the holder that costs the
    # fewest members (the most senior on ties), then the largest group around it.
    best: tuple[int, int, str] | None = None
    for h in sorted(holders, key=rank.__getitem__):
        sub = search.min_cover(_without(adj, {h} | adj[h]), n)
        assert sub is not None
        cost = sub + len(adj[h])
        if best is None or (cost, rank[h]) < best[:2]:
            best = (cost, rank[h], h)
    assert best is not None
    cost, _, h = best
    rest = _without(adj, {h} | adj[h])
    out = set(adj[h]) | _lexicographic(rest, cost - len(adj[h]), rank, search)
    return (
        out,
        True,
        (
            f"{why} that keeps {h}, which holds the run's state; "
            f"ties keep the longest-serving members"
        ),
    )


def _lexicographic(
    adj: Mapping[str, frozenset[str]], size: int, rank: Mapping[str, int], search: _Search
) -> set[str]:
    """A smallest cover (of ``size``) of ``adj`` that keeps the most senior members: each
    member, most senior first, stays when a cover of the same size still exists without it."""
    rest = dict(adj)
    out: set[str] = set()
    for v in sorted(adj, key=rank.__getitem__):
        if v not in rest or not rest[v]:
            continue
        ns = rest[v]
        if len(ns) <= size:
            sub = search.min_cover(_without(rest, {v} | ns), size - len(ns))
            if sub is not None and sub + len(ns) == size:
                out |= ns
                rest = _without(rest, {v} | ns)
                size -= len(ns)
                continue
        # every smallest cover holds v: keeping it would need all its neighbours out
        out.add(v)
        rest = _without(rest, {v})
        size -= 1
    return out


def _greedy(adj: dict[str, frozenset[str]], rank: Mapping[str, int], holders: set[str]) -> set[str]:
    rest = dict(adj)
    out: set[str] = set()
    keep_first = min(holders, key=rank.__getitem__) if holders else None
    if keep_first is not None:
        out |= adj[keep_first]
        rest = _without(rest, {keep_first} | adj[keep_first])
    while any(rest.values()):
        v = max((x for x in rest if rest[x]), key=lambda x: (len(rest[x]), rank[x]))
        out.add(v)
        rest = _without(rest, {v})
    return out
