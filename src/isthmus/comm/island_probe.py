"""Probes of an island's ranks: the paths its groups take, probed rank to rank.

Rank ``i`` of an island connects its cross-island groups with rank ``i`` of the other islands
(between islands of different sizes, with the owners of each tuple of owners,
:func:`~isthmus.comm.layout.piece_groups`), so a link cut between two followers leaves both
leaders' connections clean. What tells whether such a pair of islands can work together again
is therefore a probe of the followers' path, not of the leaders' (docs/PROTOCOL.md, "A link cut
after the data was handed over"):

* :func:`group_addresses`: the probe listeners of the ranks a group of this rank holds, from
  the round plan's ``reach`` (a follower's under ``<peer id>.<local rank>``), so that a group
  that does not connect, or a connection that goes silent, names the other island at the rank
  it could not reach.
* :func:`probe_paths`: which of the other island's ranks each of this island's ranks probes.
* :class:`RankProbes`: the leader's book of a probe the coordinator asked for
  (:class:`~isthmus.coordinator.protocol.ProbePush` with ``ranks``): each rank's answer is
  collected, and one outcome is made once every rank answered (``ok`` only when every path
  connected); a probe whose answers do not all come within its bound is dropped without an
  outcome (a rank that died mid-probe says nothing about the link).
* :class:`IslandProber`: runs them: the leader's own paths on a thread, each follower's over
  the island's watch (:mod:`isthmus.comm.island_watch`), and the outcome onto the next
  heartbeat (:meth:`~isthmus.comm.peer_reach.PeerReach.add_outcome`).

Nothing here raises on the network's account: a malformed address is a failed path.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from isthmus.comm.island_watch import IslandWatch
from isthmus.comm.layout import piece_groups
from isthmus.comm.peer_reach import PeerReach, named_unreached
from isthmus.comm.reach import probe_all
from isthmus.coordinator.protocol import ProbePush, RoundPlan

__all__ = [
    "IslandProber",
    "RankProbes",
    "group_addresses",
    "owner_pairs",
    "probe_paths",
    "rank_key",
    "rank_unreached",
]


def rank_key(peer: int, rank: int) -> str:
    """The key of local rank ``rank`` of member ``peer`` in a plan's ``reach`` (the leader's is
    the peer id alone)."""
    return str(peer) if rank == 0 else f"{peer}.{rank}"


def group_addresses(plan: RoundPlan, peer_id: int, owners: Sequence[int]) -> dict[int, str]:
    """The probe listeners of the other members' ranks in one group of ``plan``'s epoch, by
    member: ``owners[k]`` is the local rank of member ``k`` (plan order) that the group holds.
    A member whose rank sent no listener (an island of an earlier release) is left out."""
    reach = plan.reach or {}
    out: dict[int, str] = {}
    for k, m in enumerate(plan.members):
        if m != peer_id and k < len(owners) and (a := reach.get(rank_key(m, owners[k]))):
            out[m] = a
    return out


def rank_unreached(
    entries: Iterable[Any], plan: RoundPlan, addresses: Mapping[int, str]
) -> tuple[tuple[int, str, str], ...]:
    """A rank's ``CollectiveError.unreached`` entries as ``(peer id, address, how)``, each
    remote at the listener of the rank this rank's group holds (``addresses``, from
    :func:`group_addresses`); an entry that names no member, or one whose rank's listener is
    not known, is kept as it is (the leader names it at the member's own listener)."""
    out: list[Any] = []
    for e in entries:
        try:
            u = named_unreached(e, plan, dict(addresses))
        except (TypeError, ValueError):
            u = None
        known = u is not None and addresses.get(u.peer) == u.address
        out.append((u.peer, u.address, u.how) if u is not None and known else e)
    return tuple(out)


def probe_paths(
    mine: int, theirs: int, pairs: Iterable[tuple[int, int]] | None = None
) -> dict[int, list[int]]:
    """Which ranks of an island of ``theirs`` ranks each rank of this island (``mine`` ranks)
    probes: the paths their groups take. Equal sizes: rank ``i`` to rank ``i``. Different
    sizes: the pairs of owners ``pairs`` (this island's rank, theirs) of the groups of tuples of
    owners, or every pair when they are not known. A rank with no path is absent."""
    if mine == theirs:
        return {i: [i] for i in range(mine)}
    if pairs is None:
        pairs = itertools.product(range(mine), range(theirs))
    out: dict[int, set[int]] = {}
    for a, b in pairs:
        if 0 <= a < mine and 0 <= b < theirs:
            out.setdefault(a, set()).add(b)
    return {a: sorted(bs) for a, bs in sorted(out.items())}


@dataclass
class _Pending:
    peer: int
    ranks: frozenset[int]
    started: float
    answers: dict[int, list[str | None]] = field(default_factory=dict)


class RankProbes:
    """The leader's book of the rank-to-rank probes in flight (pure: times are passed in).
    ``limit_s``: how long a probe waits for every rank's answer before it is dropped."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._next = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.dropped = 0
        """Probes dropped for want of an answer (a rank that died, a lost datagram)."""

    def start(self, peer: int, ranks: Iterable[int], now: float) -> int:
        """A probe of member ``peer`` whose paths leave from local ``ranks``; its token. Probes
        older than the bound are dropped first."""
        self.expire(now)
        token = next(self._next)
        self._pending[token] = _Pending(peer, frozenset(ranks), now)
        return token

    def answer(
        self, token: int, rank: int, hows: Sequence[str | None], now: float
    ) -> dict[str, Any] | None:
        """Rank ``rank``'s answer to probe ``token`` (one ``how`` per path, None: connected);
        the probe's outcome once every rank answered (``{"peer", "ok", "how"?}``, ``ok`` only
        if every path connected, else the first failure's ``how``), else None. An answer to a
        probe unknown or dropped, or from a rank it did not ask, is ignored."""
        p = self._pending.get(token)
        if p is None or rank not in p.ranks:
            return None
        if now - p.started > self.limit_s:
            self.expire(now)
            return None
        p.answers[rank] = list(hows)
        if set(p.answers) != p.ranks:
            return None
        del self._pending[token]
        failed = [h for r in sorted(p.answers) for h in p.answers[r] if h is not None]
        out: dict[str, Any] = {"peer": p.peer, "ok": not failed}
        if failed:
            out["how"] = failed[0]
        return out

    def expire(self, now: float) -> list[int]:
        """Drop the probes still missing an answer after the bound; their tokens."""
        gone = [t for t, p in self._pending.items() if now - p.started > self.limit_s]
        for t in gone:
            del self._pending[t]
        self.dropped += len(gone)
        return gone

    def __len__(self) -> int:
        return len(self._pending)


def owner_pairs(
    shapes: Sequence[Sequence[int]], mine: int, theirs: int
) -> list[tuple[int, int]] | None:
    """The (this island's rank, theirs) pairs of the groups of tuples of owners between an
    island of ``mine`` ranks holding tensors of ``shapes`` and one of ``theirs``; None when no
    shape is known yet."""
    if not shapes:
        return None
    return sorted({(o[0], o[1]) for o in piece_groups(shapes, [mine, theirs])})


class IslandProber:
    """Runs rank-to-rank probes for one rank of an island. ``size``: the island's ranks.
    ``shapes()``: the full shapes of the tensors the island shards (for :func:`owner_pairs`).
    ``limit_s``: how long the leader waits for every answer. Set once they exist:
    :attr:`reach`, this rank's :class:`PeerReach` (its source address, its bound, the leader's
    heartbeat outcomes; without it nothing is probed), and :attr:`watch`, which carries the
    leader's word to a follower and its answer (without it a follower's paths get no answer and
    the probe is dropped)."""

    def __init__(
        self, *, size: int, shapes: Callable[[], Sequence[Sequence[int]]], limit_s: float
    ) -> None:
        self.size, self._shapes = size, shapes
        self.reach: PeerReach | None = None
        self.watch: IslandWatch | None = None
        self._lock = threading.Lock()
        self.book = RankProbes(limit_s)

    def start(self, msg: ProbePush) -> bool:
        """On the leader: probe the island ``msg`` names rank to rank (False: it carries no
        ``ranks``, the caller probes ``msg.address`` as a plain peer does)."""
        if not msg.ranks or self.reach is None:
            return False
        theirs = list(msg.ranks)
        pairs = owner_pairs(self._shapes(), self.size, len(theirs))
        paths = probe_paths(self.size, len(theirs), pairs)
        jobs = {r: [theirs[q] for q in qs] for r, qs in paths.items()}
        with self._lock:
            token = self.book.start(msg.peer, jobs, time.monotonic())
        for r, addresses in jobs.items():
            if r == 0:
                self._run(token, addresses, lambda t, h: self.answered(0, t, h))
            elif self.watch is not None:  # without one the probe is dropped, no outcome
                self.watch.tell_probe(r, token, addresses)
        return True

    def asked(self, token: int, addresses: list[str]) -> None:
        """On a follower: the leader asks for these paths; the answer goes back over the watch."""
        watch = self.watch
        if watch is not None:
            self._run(token, addresses, watch.tell_probed)

    def answered(self, rank: int, token: int, hows: list[str | None]) -> None:
        """On the leader: rank ``rank``'s answer; the outcome goes onto the next heartbeat."""
        with self._lock:
            out = self.book.answer(token, rank, hows, time.monotonic())
        if out is not None and self.reach is not None:
            self.reach.add_outcome(out)

    def _run(
        self, token: int, addresses: list[str], then: Callable[[int, list[str | None]], None]
    ) -> None:
        reach = self.reach
        if reach is None:
            return

        def go() -> None:
            indexed = dict(enumerate(addresses))
            failed = {
                i: how.value
                for i, _a, how in probe_all(
                    indexed, timeout_s=reach.probe_timeout, source=reach.source
                )
            }
            # a malformed address is skipped by probe_all: count it as a path that failed
            hows = [failed.get(i, _malformed(a)) for i, a in indexed.items()]
            then(token, hows)

        threading.Thread(target=go, daemon=True, name="isthmus-rank-probe").start()


def _malformed(address: str) -> str | None:
    host, sep, port = address.rpartition(":")
    return None if sep and host and port.isdigit() else "refused"
