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
reported (``session.report(links={name: mbit_per_s, ...})``) and orders by it only when every
pair is known, else keeps the given order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["EXACT_MAX", "crossings", "order_ring", "ring_key", "ring_members"]

_orders: dict[Any, list[int]] = {}  # the last orders computed, by members and bandwidths

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

    first, rest = min(ids), sorted(x for x in ids if x != min(ids))
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


def ring_members(ready: Iterable[int], peers: Mapping[int, Any]) -> tuple[int, ...]:
    """The coordinator's hook: the ``ready`` peer ids in name order (then id; ``peers[id]`` has
    ``name`` and ``info``), reordered around the ring when every pair's bandwidth is known from
    the peers' reports (``info["links"]``: peer name -> Mbit/s, from either end), else left in
    name order. Ring order is then also rank order, so it decides a peer's data shard and
    local-state slot, as name order does otherwise. A malformed report is ignored (the order
    stays by name) rather than failing the round."""
    members = sorted(ready, key=lambda pid: (peers[pid].name, pid))
    names = {p: peers[p].name for p in members}
    infos = {p: peers[p].info for p in members}
    ids = list(members)
    if len(ids) < 4:
        return tuple(ids)  # three or fewer: every order is the same ring
    # a report names the others by peer name or by the address they report (``info["addr"]``:
    # stable across a slot's restarts, where names are not)
    by_name = {str(a): p for p in ids if (a := infos[p].get("addr"))} | {names[p]: p for p in ids}
    bandwidth: dict[tuple[int, int], float] = {}
    for p in ids:
        links = infos.get(p, {}).get("links")
        if not isinstance(links, Mapping):
            continue
        for other, rate in links.items():
            q = by_name.get(str(other))
            if q is not None and q != p and isinstance(rate, (int, float)) and rate > 0:
                # two significant digits: a measurement's noise must not flip the order (and so
                # open a new epoch) from one round to the next
                bandwidth[(p, q)] = float(f"{float(rate):.2g}")
    key = (tuple(ids), tuple(sorted(bandwidth.items())))
    ring = _orders.get(key)
    if ring is None:
        try:
            ring = order_ring(ids, bandwidth)
        except KeyError:
            return tuple(ids)  # a pair not measured yet
        if len(_orders) >= 64:  # rounds form often; memberships change rarely
            _orders.clear()
        _orders[key] = ring
    # keep the first member (in name order) at rank 0, so rank 0 moves only when it must
    i = ring.index(ids[0])
    return tuple(ring[i:] + ring[:i])
