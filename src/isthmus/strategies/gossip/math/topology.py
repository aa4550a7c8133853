"""Communication graphs for gossip: the static topologies, built by name.

A :class:`Topology` is an undirected simple graph over the ranks ``0..n-1`` of one membership
epoch, stored as adjacency sets. Everything here is pure and deterministic: the same name, ``n``
and seed give the same graph on every peer (the random builders use :mod:`._rng`, which does not
depend on the Python version), so peers never have to exchange their view of the graph.

Families and where they come from:

* ring, 2-D torus, complete: the classic gossip graphs (Boyd, Ghosh, Prabhakar and Shah,
  "Randomized gossip algorithms", IEEE Trans. Inf. Theory 2006).
* exponential graph: neighbours at distances ``2^k`` (Ying, Yuan, Chen, Hu, Pan and Yin,
  "Exponential Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021,
  arXiv 2110.13363). Mixing needs symmetric weights, so we use the undirected version: ``i`` is
  joined to ``i + 2^k`` and ``i - 2^k`` (mod n).
* random d-regular and Barabasi-Albert (preferential attachment, Barabasi and Albert, Science
  1999), the graph used by "Exploring the Impact of Disrupted Peer-to-Peer Communications on Fully
  Decentralized Learning in Disaster Scenarios" to study peers dropping out.

The time-varying families (a graph per round) are :mod:`.sequence`; how a run names its graph
(:class:`~.rebuild.TopologySpec`) and carries it across membership changes is :mod:`.rebuild`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from isthmus.spec import option_names
from isthmus.strategies.gossip.math._rng import Rng, derive_seed

__all__ = [
    "STATIC_TOPOLOGIES",
    "TOPOLOGY_OPTIONS",
    "BarabasiAlbertOptions",
    "DisconnectedGraphError",
    "RandomRegularOptions",
    "Topology",
    "barabasi_albert",
    "check_ranks",
    "check_topology_options",
    "complete",
    "connected_components",
    "exponential",
    "is_connected",
    "make_topology",
    "random_regular",
    "ring",
    "torus",
    "torus_shape",
]


class DisconnectedGraphError(ValueError):
    """A graph that must be connected is not. ``components`` lists its connected components
    (each a sorted list of ranks, largest first); the message names them."""

    def __init__(self, components: Sequence[Sequence[int]], what: str = "graph") -> None:
        self.components = [list(c) for c in components]
        shown = "; ".join(_short_list(c) for c in self.components[:6])
        more = f"; and {len(self.components) - 6} more" if len(self.components) > 6 else ""
        super().__init__(
            f"{what} is disconnected: {len(self.components)} components: {shown}{more}. "
            f"Gossip cannot reach consensus across components; use a connected topology or "
            f"rebuild_topology(..., mode='repair') to add the missing edges"
        )


def _short_list(c: Sequence[int], limit: int = 12) -> str:
    if len(c) <= limit:
        return "{" + ", ".join(map(str, c)) + "}"
    return "{" + ", ".join(map(str, c[:limit])) + f", ... ({len(c)} ranks)" + "}"


@dataclass(frozen=True)
class Topology:
    """An undirected simple graph over ranks ``0..n-1`` (adjacency sets, no self loops).

    Construction raises ``ValueError`` if a neighbour is out of range, a rank lists itself, or an
    edge is listed on one side only.
    """

    name: str
    adjacency: tuple[frozenset[int], ...]

    def __post_init__(self) -> None:
        n = len(self.adjacency)
        for i, nbrs in enumerate(self.adjacency):
            for j in nbrs:
                if not 0 <= j < n:
                    raise ValueError(
                        f"topology {self.name!r}: rank {i} lists neighbour {j}, outside 0..{n - 1}"
                    )
                if j == i:
                    raise ValueError(
                        f"topology {self.name!r}: rank {i} lists itself; self loops are implicit in mixing"
                    )
                if i not in self.adjacency[j]:
                    raise ValueError(
                        f"topology {self.name!r}: edge {i}-{j} is listed by {i} but not by {j}; "
                        f"gossip graphs must be undirected"
                    )

    @classmethod
    def from_edges(cls, name: str, n: int, edges: Iterable[tuple[int, int]]) -> Topology:
        """Build from an edge list; duplicate edges collapse, ``(i, i)`` raises ``ValueError``."""
        adj: list[set[int]] = [set() for _ in range(n)]
        for i, j in edges:
            if not (0 <= i < n and 0 <= j < n):
                raise ValueError(f"edge ({i}, {j}) is outside ranks 0..{n - 1}")
            if i == j:
                raise ValueError(
                    f"edge ({i}, {i}) is a self loop; self loops are implicit in mixing"
                )
            adj[i].add(j)
            adj[j].add(i)
        return cls(name, tuple(frozenset(a) for a in adj))

    @property
    def n(self) -> int:
        return len(self.adjacency)

    def neighbors(self, i: int) -> tuple[int, ...]:
        """Neighbours of rank ``i`` in increasing order (the order every peer iterates in)."""
        return tuple(sorted(self.adjacency[i]))

    def degree(self, i: int) -> int:
        return len(self.adjacency[i])

    def edges(self) -> list[tuple[int, int]]:
        """Every edge once, as ``(i, j)`` with ``i < j``, sorted."""
        return [(i, j) for i in range(self.n) for j in sorted(self.adjacency[i]) if i < j]

    @property
    def num_edges(self) -> int:
        return sum(len(a) for a in self.adjacency) // 2

    def components(self) -> list[list[int]]:
        return connected_components(self)

    def is_connected(self) -> bool:
        return is_connected(self)

    def require_connected(self) -> Topology:
        """Return ``self``; raise :class:`DisconnectedGraphError` naming the components if not
        connected."""
        comps = connected_components(self)
        if len(comps) > 1:
            raise DisconnectedGraphError(comps, f"topology {self.name!r} over {self.n} ranks")
        return self


def connected_components(top: Topology) -> list[list[int]]:
    """Connected components as sorted rank lists, largest first (ties: smallest rank first)."""
    seen = [False] * top.n
    comps: list[list[int]] = []
    for start in range(top.n):
        if seen[start]:
            continue
        seen[start] = True
        stack = [start]
        comp = []
        while stack:
            u = stack.pop()
            comp.append(u)
            for v in top.adjacency[u]:
                if not seen[v]:
                    seen[v] = True
                    stack.append(v)
        comps.append(sorted(comp))
    comps.sort(key=lambda c: (-len(c), c[0]))
    return comps


def is_connected(top: Topology) -> bool:
    """True when every rank can reach every other (a graph of 0 or 1 ranks is connected)."""
    return len(connected_components(top)) <= 1


def check_ranks(n: int) -> None:
    """Raise ``ValueError`` unless ``n`` (a rank count) is an int >= 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a topology needs n >= 1 ranks, got {n!r}")


# -- static builders -------------------------------------------------------------------------------


def ring(n: int) -> Topology:
    """Cycle ``i <-> i+1 (mod n)``. Two ranks share one edge; one rank has none."""
    check_ranks(n)
    return Topology.from_edges("ring", n, ((i, (i + 1) % n) for i in range(n) if n > 1))


def complete(n: int) -> Topology:
    """Every pair of ranks joined: one gossip step with Metropolis weights is the exact average."""
    check_ranks(n)
    return Topology.from_edges("complete", n, ((i, j) for i in range(n) for j in range(i + 1, n)))


def torus_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n`` and ``rows <= cols`` as close to square as the
    divisors of ``n`` allow. For prime ``n`` this is ``(1, n)``: the torus is then a ring."""
    check_ranks(n)
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows


def torus(n: int) -> Topology:
    """2-D wrap-around grid over :func:`torus_shape` ``(rows, cols)``; rank ``i`` sits at
    ``(i // cols, i % cols)``.

    Degenerate shapes are kept rather than rejected, so membership changes never fail here: for
    prime ``n`` (rows == 1) the torus is exactly a ring; with two rows the up and down neighbours
    coincide (degree 3); a 2x2 torus is a 4-ring.
    """
    rows, cols = torus_shape(n)
    edges: list[tuple[int, int]] = []
    for i in range(n):
        r, c = divmod(i, cols)
        for rr, cc in ((r, (c + 1) % cols), ((r + 1) % rows, c)):
            j = rr * cols + cc
            if j != i:
                edges.append((i, j))
    return Topology.from_edges("torus", n, edges)


def exponential(n: int) -> Topology:
    """Undirected exponential graph: ``i <-> i ± 2^k (mod n)`` for every ``2^k < n``.

    Degree is about ``2 log2 n`` (less when offsets coincide, e.g. ``2^k == n/2``).
    """
    check_ranks(n)
    edges = []
    k = 1
    while k < n:
        edges.extend((i, (i + k) % n) for i in range(n))
        k *= 2
    return Topology.from_edges("exponential", n, edges)


def _pair_stubs(stubs: list[int], n: int, rng: Rng) -> list[set[int]] | None:
    """Join random pairs of stubs into a simple graph, or ``None`` when the draw got stuck."""
    adj: list[set[int]] = [set() for _ in range(n)]
    stubs = list(stubs)
    misses = 0
    while stubs:
        a = rng.below(len(stubs))
        b = rng.below(len(stubs))
        u, v = stubs[a], stubs[b]
        if a != b and u != v and v not in adj[u]:
            adj[u].add(v)
            adj[v].add(u)
            for idx in sorted((a, b), reverse=True):  # swap-remove, larger index first
                stubs[idx] = stubs[-1]
                stubs.pop()
            misses = 0
            continue
        misses += 1
        if misses > 64:
            # Only a handful of stubs can remain when random picks keep failing; a full scan
            # tells whether any valid pair is left at all, otherwise this draw is a dead end.
            if not any(
                stubs[x] != stubs[y] and stubs[y] not in adj[stubs[x]]
                for x in range(len(stubs))
                for y in range(x + 1, len(stubs))
            ):
                return None
            misses = 0
    return adj


def random_regular(n: int, degree: int, seed: int = 0, *, strict: bool = False) -> Topology:
    """Seeded random ``degree``-regular simple graph, connected.

    Draws by random stub pairing with restarts (Steger and Wormald 1999), keeping the first
    connected draw; ``degree == 2`` draws a random Hamiltonian cycle directly (a random 2-regular
    graph is usually several cycles). For ``degree > (n-1)/2`` the complement of a random
    ``(n-1-degree)``-regular graph is drawn instead, which is much faster.

    Infeasible parameters (they appear when membership shrinks mid-run):

    * ``degree >= n``: ``strict`` raises ``ValueError``; otherwise the complete graph is returned.
    * ``n * degree`` odd: ``strict`` raises ``ValueError``; otherwise one seeded rank gets degree
      ``degree + 1`` (the nearest simple graph).

    ``degree < 2`` with ``n > 2`` can never be connected and always raises ``ValueError``.
    Raises :class:`DisconnectedGraphError` if no connected draw appears in 200 attempts.
    """
    check_ranks(n)
    if degree < 1 and n > 1:
        raise ValueError(f"random_regular needs degree >= 1, got {degree}")
    if degree >= n:
        if strict:
            raise ValueError(
                f"random_regular: degree {degree} needs at least {degree + 1} ranks, got {n}; "
                f"lower the degree or pass strict=False to fall back to the complete graph"
            )
        return _renamed(complete(n), "random_regular")
    if degree == 1 and n > 2:
        raise ValueError(
            f"random_regular: degree 1 cannot connect {n} ranks (it is a matching); use degree >= 2"
        )
    odd = (n * degree) % 2 == 1
    if odd and strict:
        raise ValueError(
            f"random_regular: n * degree = {n} * {degree} is odd, so no {degree}-regular graph exists; "
            f"use an even degree or pass strict=False to give one rank degree {degree + 1}"
        )
    rng = Rng(derive_seed(seed, "random_regular", n, degree))
    if degree == 2:
        order = list(range(n))
        rng.shuffle(order)
        return Topology.from_edges(
            "random_regular", n, ((order[i], order[(i + 1) % n]) for i in range(n))
        )
    complement = not odd and degree > (n - 1) // 2
    draw_degree = n - 1 - degree if complement else degree
    stubs = [i for i in range(n) for _ in range(draw_degree)]
    if odd:
        stubs.append(rng.below(n))
    last_components: list[list[int]] = [[i] for i in range(n)]
    for _ in range(200):
        adj = _pair_stubs(stubs, n, rng)
        if adj is None:
            continue
        if complement:
            adj = [set(range(n)) - a - {i} for i, a in enumerate(adj)]
        top = Topology("random_regular", tuple(frozenset(a) for a in adj))
        last_components = top.components()
        if len(last_components) == 1:
            return top
    raise DisconnectedGraphError(
        last_components, f"random_regular(n={n}, degree={degree}) after 200 draws"
    )


def barabasi_albert(n: int, m: int = 2, seed: int = 0) -> Topology:
    """Seeded Barabasi-Albert graph: start from the complete graph on ``m + 1`` ranks, then each
    further rank attaches to ``m`` distinct earlier ranks chosen with probability proportional to
    their degree. Connected by construction; ``n <= m + 1`` gives the complete graph.

    Raises ``ValueError`` for ``m < 1``.
    """
    check_ranks(n)
    if m < 1:
        raise ValueError(f"barabasi_albert needs m >= 1 edges per new rank, got {m}")
    core = min(n, m + 1)
    edges = [(i, j) for i in range(core) for j in range(i + 1, core)]
    # one entry per edge endpoint: a uniform pick from it is a degree-proportional pick of a rank
    endpoints = [r for e in edges for r in e]
    rng = Rng(derive_seed(seed, "barabasi_albert", n, m))
    for v in range(core, n):
        targets: set[int] = set()
        while len(targets) < m:
            targets.add(endpoints[rng.below(len(endpoints))])
        for t in sorted(targets):
            edges.append((v, t))
            endpoints.extend((v, t))
    return Topology.from_edges("barabasi_albert", n, edges)


def _renamed(top: Topology, name: str) -> Topology:
    return Topology(name, top.adjacency)


@dataclass(frozen=True, kw_only=True)
class RandomRegularOptions:
    """Options of ``random_regular`` (``random_regular:degree=3``); see :func:`random_regular`."""

    degree: int = 4
    """Neighbours of every rank."""
    strict: bool = False
    """Raise for an infeasible degree instead of taking the nearest graph (membership can make
    any degree infeasible mid-run)."""


@dataclass(frozen=True, kw_only=True)
class BarabasiAlbertOptions:
    """Options of ``barabasi_albert`` (``barabasi_albert:m=3``); see :func:`barabasi_albert`."""

    m: int = 2
    """Edges from every new rank to earlier ranks."""


TOPOLOGY_OPTIONS: dict[str, type] = {
    "random_regular": RandomRegularOptions,
    "barabasi_albert": BarabasiAlbertOptions,
}
"""The families that take options, with their options dataclass; the others take none."""


def _random_regular(n: int, seed: int, **options: Any) -> Topology:
    o = RandomRegularOptions(**options)
    return random_regular(n, o.degree, seed, strict=o.strict)


def _barabasi_albert(n: int, seed: int, **options: Any) -> Topology:
    return barabasi_albert(n, BarabasiAlbertOptions(**options).m, seed)


STATIC_TOPOLOGIES: dict[str, Callable[..., Topology]] = {
    "ring": lambda n, seed: ring(n),
    "torus": lambda n, seed: torus(n),
    "exponential": lambda n, seed: exponential(n),
    "complete": lambda n, seed: complete(n),
    "random_regular": _random_regular,
    "barabasi_albert": _barabasi_albert,
}
"""Name -> builder(n, seed, **options); the options are those of :data:`TOPOLOGY_OPTIONS`."""


def check_topology_options(name: str, known: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``name`` is not in ``known``, ``TypeError`` if ``options`` holds a
    name the family's :data:`TOPOLOGY_OPTIONS` dataclass does not have."""
    if name not in known:
        raise ValueError(f"unknown topology {name!r}; choose one of {sorted(known)}")
    allowed = option_names(TOPOLOGY_OPTIONS[name]) if name in TOPOLOGY_OPTIONS else []
    extra = set(options) - set(allowed)
    if extra:
        raise TypeError(
            f"topology {name!r} takes options {sorted(allowed) or 'none'}, got {sorted(extra)}"
        )


def make_topology(name: str, n: int, *, seed: int = 0, **options: Any) -> Topology:
    """Build the static topology ``name`` over ``n`` ranks (see :data:`STATIC_TOPOLOGIES`).

    The result is always connected: raises ``ValueError`` for an unknown name, ``TypeError`` for
    an option the family does not take, and :class:`DisconnectedGraphError` if a builder could
    not produce a connected graph.
    """
    check_topology_options(name, STATIC_TOPOLOGIES, options)
    return STATIC_TOPOLOGIES[name](n, seed, **options).require_connected()
