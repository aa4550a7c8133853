"""Ordering an epoch's members around the ring by the bandwidth between them (PCCL's idea).

A ring all-reduce moves every byte over every edge of the ring (rank ``i`` to ``i + 1``), so it
runs at the pace of its slowest edge. With peers in two regions joined by a thin link, ordering
by name can cross between the regions four times where twice would do; the bottleneck is the
same thin link, but four crossings share it among four flows instead of two. So the order chosen
here maximizes the bandwidths of the ring's edges lexicographically from the slowest up: first
the bottleneck, then the next slowest edge, and so on (two crossings leave two fast edges where
four crossings leave none).

Pure functions, no network: :func:`order_ring` takes the measured (or, in the lab, configured)
bandwidth between pairs. It is exact for up to :data:`EXACT_MAX` members (every ring is tried)
and a heuristic beyond (the widest-edge-first tour from every start, then 2-opt moves while they
improve the ring). :func:`ring_members` is the coordinator's hook: it reads what the peers
reported (``session.report(links={name: mbit_per_s, ...})``, or what their probes measured,
``info["probed"]``: :mod:`isthmus.comm.probe`) and orders by it only when every pair is known
and the best ring is materially better than name order, else keeps name order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "EXACT_MAX",
    "MATERIAL",
    "ORDERED_FROM",
    "crossings",
    "materially_better",
    "order_ring",
    "ring_key",
    "ring_members",
]

_orders: dict[Any, list[int]] = {}  # the last orders computed, by members and bandwidths

#: Rings of fewer members are all the same ring: the order only matters from this many.
ORDERED_FROM = 4

#: The ring leaves name order only for a ring whose edges are this many times faster, compared
#: from the slowest up (:func:`materially_better`): links alike stay in name order whatever a
#: probe's noise says, while regions joined by thin links (10x and more) are ordered.
MATERIAL = 2.0

#: Up to this many members every ring is tried ((n-1)!/2 of them: 2,520 for 8).
EXACT_MAX = 8


def _bw(bandwidth: Mapping[tuple[int, int], float], a: int, b: int) -> float:
    """The pair's bandwidth, the slower direction when both are given. Raises KeyError naming
    the pair when neither is."""
    vals = [bandwidth[k] for k in ((a, b), (b, a)) if k in bandwidth]
    if not vals:
        raise KeyError(f"no bandwidth between {a} and {b}")
    return min(vals)


def ring_key(order: Sequence[int], bandwidth: Mapping[tuple[int, int], float]) -> list[float]:
    """The ring's edge bandwidths, slowest first: a ring is better when this list is
    lexicographically larger."""
    n = len(order)
    return sorted(_bw(bandwidth, order[i], order[(i + 1) % n]) for i in range(n))


def _canonical(order: Sequence[int]) -> tuple[int, ...]:
    """The same ring started at its smallest member, in the direction of the smaller neighbor:
    rotations and reflections of one ring compare equal, so ties break the same everywhere."""
    n = len(order)
    i = order.index(min(order))
    fwd = tuple(order[(i + k) % n] for k in range(n))
    back = tuple(order[(i - k) % n] for k in range(n))
    return min(fwd, back)


def _better(
    a: Sequence[int], b: Sequence[int], key: Callable[[Sequence[int]], list[float]]
) -> bool:
    ka, kb = key(a), key(b)
    return ka > kb or (ka == kb and _canonical(a) < _canonical(b))


def order_ring(members: Sequence[int], bandwidth: Mapping[tuple[int, int], float]) -> list[int]:
    """``members`` in the ring order that maximizes :func:`ring_key` (exact up to
    :data:`EXACT_MAX` members, heuristic beyond), rotated to start at the smallest member; among
    equal rings the lexicographically smallest. ``bandwidth`` maps ``(a, b)`` pairs (either
    direction) to a rate; raises KeyError naming a pair that has none and ValueError for repeated
    members. Deterministic: every caller gets the same order for the same input."""
    ids = list(members)
    if len(set(ids)) != len(ids):
        raise ValueError(f"members repeat: {ids}")
    if len(ids) <= 3:  # every ring of three or fewer is the same ring
        return list(_canonical(sorted(ids))) if ids else []

    def key(o: Sequence[int]) -> list[float]:
        return ring_key(o, bandwidth)

    first = min(ids)
    rest = sorted(x for x in ids if x != first)
    best: list[int] | None = None
    if len(ids) <= EXACT_MAX:
        for perm in itertools.permutations(rest):
            if perm[0] > perm[-1]:
                continue  # the reflection of a ring already tried
            cand = [first, *perm]
            if best is None or _better(cand, best, key):
                best = cand
    else:
        for start in sorted(ids):
            cand = _improve(_widest_first(start, ids, bandwidth), key)
            if best is None or _better(cand, best, key):
                best = cand
    assert best is not None
    return list(_canonical(best))


def _widest_first(
    start: int, ids: Sequence[int], bandwidth: Mapping[tuple[int, int], float]
) -> list[int]:
    """A tour from ``start`` that always steps to the unvisited member on the widest link
    (ties: the smallest id)."""
    tour, left = [start], sorted(x for x in ids if x != start)
    while left:
        here = tour[-1]
        nxt = max(left, key=lambda x: (_bw(bandwidth, here, x), -x))
        tour.append(nxt)
        left.remove(nxt)
    return tour


def _improve(
    tour: list[int], key: Callable[[Sequence[int]], list[float]], passes: int = 20
) -> list[int]:
    """2-opt: reverse a stretch of the tour while that makes it better; at most ``passes``
    sweeps, so the time stays bounded (n^2 moves a sweep)."""
    n = len(tour)
    for _ in range(passes):
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                cand = tour[:i] + tour[i : j + 1][::-1] + tour[j + 1 :]
                if _better(cand, tour, key):
                    tour, improved = cand, True
        if not improved:
            break
    return tour


def crossings(order: Sequence[int], region: Mapping[int, Any]) -> int:
    """How many edges of the ring join members of different regions."""
    n = len(order)
    return sum(region[order[i]] != region[order[(i + 1) % n]] for i in range(n))


def _rate(value: Any) -> float | None:
    """A reported rate, rounded to two significant digits (a measurement's noise must not flip
    the order, and so open a new epoch, from one round to the next); None when malformed."""
    if isinstance(value, Mapping):  # a probe's {"mbit": ..., "rtt_ms": ...}
        value = value.get("mbit")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(f"{float(value):.2g}")


def _reported(
    ids: Sequence[int], names: Mapping[int, str], infos: Mapping[int, Any]
) -> dict[tuple[int, int], float]:
    """Every pair's rate the members reported: ``info["links"]`` (handed in: the lab's scenario
    or the user's ``session.report(links=...)``, by peer name or address) and ``info["probed"]``
    (measured by the peers, :mod:`isthmus.comm.probe`, by peer id). A pair that either end
    reported in ``links`` takes no probed rate: a table someone handed in states the network as
    they know it (the lab's, exactly as configured), where a probe is a short estimate. Probed
    rates are used only when every member's table names every other member (a malformed value
    in it is skipped, and the other end's report of that pair suffices)."""
    # ``links`` names the others by peer name or by the address they report (``info["addr"]``:
    # stable across a slot's restarts, where names are not)
    by_name = {str(a): p for p in ids if (a := infos[p].get("addr"))} | {names[p]: p for p in ids}
    by_id = {str(p): p for p in ids}
    given: dict[tuple[int, int], float] = {}
    probed: dict[tuple[int, int], float] = {}
    # Probes count only once every member has reported one naming every other member: the
    # reports arrive with heartbeats, one member at a time, and ordering on the first ones
    # (each pair known from one end) could reorder the ring twice, each time a new epoch
    tables = [infos[p].get("probed") for p in ids]
    complete = all(
        isinstance(t, Mapping) and by_id.keys() - {str(p)} <= {str(k) for k in t}
        for p, t in zip(ids, tables, strict=True)
    )
    for p in ids:
        fields = (("links", by_name, given), ("probed", by_id, probed))
        for field, lookup, out in fields if complete else fields[:1]:
            table = infos[p].get(field)
            if not isinstance(table, Mapping):
                continue
            for other, value in table.items():
                q, rate = lookup.get(str(other)), _rate(value)
                if q is not None and q != p and rate is not None:
                    # a probe measures what p receives from q; a table states p's rate to q
                    out[(q, p) if field == "probed" else (p, q)] = rate
    stated = {frozenset(pair) for pair in given}
    return given | {pair: rate for pair, rate in probed.items() if frozenset(pair) not in stated}


def materially_better(a: Sequence[float], b: Sequence[float], factor: float = MATERIAL) -> bool:
    """Whether ring key ``a`` beats ``b`` (:func:`ring_key`) when edges within ``factor`` of each
    other count as equal: from the slowest edge up, the first pair of edges that differ by more
    than ``factor`` decides."""
    for x, y in zip(a, b, strict=True):
        if x > y * factor:
            return True
        if y > x * factor:
            return False
    return False


def ring_members(ready: Iterable[int], peers: Mapping[int, Any]) -> tuple[int, ...]:
    """The coordinator's hook: the ``ready`` peer ids in name order (then id; ``peers[id]`` has
    ``name`` and ``info``), reordered around the ring when every pair's bandwidth is known from
    the peers' reports (:func:`_reported`: ``info["links"]``, peer name -> Mbit/s, or
    ``info["probed"]``, peer id -> a probe's link; from either end) and the best ring is
    :func:`materially_better` than name order, else left in name order. Ring order is then also
    rank order, so it decides a peer's data shard and local-state slot, as name order does
    otherwise. A malformed report is ignored (the order stays by name) rather than failing the
    round."""
    members = sorted(ready, key=lambda pid: (peers[pid].name, pid))
    names = {p: peers[p].name for p in members}
    infos = {p: peers[p].info for p in members}
    ids = list(members)
    if len(ids) < ORDERED_FROM:
        return tuple(ids)  # three or fewer: every order is the same ring
    bandwidth = _reported(ids, names, infos)
    key = (tuple(ids), tuple(sorted(bandwidth.items())))
    ring = _orders.get(key)
    if ring is None:
        try:
            ring = order_ring(ids, bandwidth)
        except KeyError:
            return tuple(ids)  # a pair not measured yet
        if not materially_better(ring_key(ring, bandwidth), ring_key(ids, bandwidth)):
            # links alike (within MATERIAL): a probe's noise must not reshuffle the ranks
            ring = ids
        if len(_orders) >= 64:  # rounds form often; memberships change rarely
            _orders.clear()
        _orders[key] = ring
    # keep the first member (in name order) at rank 0, so rank 0 moves only when it must
    i = ring.index(ids[0])
    return tuple(ring[i:] + ring[:i])
