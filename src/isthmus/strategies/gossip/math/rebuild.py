"""How a run names its gossip graph, and how the graph follows membership changes.

A :class:`TopologySpec` (a family from :data:`TOPOLOGIES`, its options and a seed) is what every
peer holds; it is parsed from the one spec grammar of :mod:`isthmus.spec` (``ring``,
``random_regular:degree=3``, ``one_peer_exponential``). When membership changes,
:func:`rebuild_topology` either regenerates the graph for the new member count
(``mode="regenerate"``) or keeps every surviving edge and adds the fewest edges that make the
graph connected again (``mode="repair"``, :func:`repair_topology`); within one epoch,
:func:`embed_topology` places a graph on the ranks that hold a usable model, so that joiners and
stale peers sit a round out. Everything here is pure and deterministic, like the graphs of
:mod:`.topology`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from isthmus.spec import Registry
from isthmus.strategies.gossip.math._rng import Rng, derive_seed
from isthmus.strategies.gossip.math.sequence import (
    TIME_VARYING_TOPOLOGIES,
    StaticSequence,
    TopologySequence,
    make_topology_sequence,
)
from isthmus.strategies.gossip.math.topology import (
    STATIC_TOPOLOGIES,
    TOPOLOGY_OPTIONS,
    Topology,
    check_ranks,
    check_topology_options,
    connected_components,
)

__all__ = [
    "TOPOLOGIES",
    "EmbeddedSequence",
    "TopologySpec",
    "embed_topology",
    "rebuild_topology",
    "repair_topology",
]


@dataclass(frozen=True, kw_only=True)
class TopologySpec:
    """How a run builds its gossip graph; every peer holds the same spec."""

    name: str = "ring"
    """A static name from :data:`~.topology.STATIC_TOPOLOGIES` or a time-varying one from
    :data:`~.topology.TIME_VARYING_TOPOLOGIES`."""
    seed: int = 0
    """Base seed; regeneration mixes in the epoch so each epoch gets a fresh random graph."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Family options, e.g. ``{"degree": 4}`` for random_regular or ``{"m": 2}`` for
    barabasi_albert."""

    def __post_init__(self) -> None:
        known = {**STATIC_TOPOLOGIES, **TIME_VARYING_TOPOLOGIES}
        try:
            check_topology_options(self.name, known, self.options)
        except TypeError as e:  # a config error, reported like every other config error
            raise ValueError(f"TopologySpec: {e}") from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"TopologySpec.seed must be an int, got {self.seed!r}")

    @staticmethod
    def parse(spec: str, *, seed: int = 0) -> TopologySpec:
        """The spec of a topology string such as ``ring`` or ``random_regular:degree=3`` (the
        grammar of :mod:`isthmus.spec`; ``-`` works for ``_``). Raises
        :class:`~isthmus.spec.SpecError` (a ValueError) naming an unknown family or option with
        the closest valid one, or a value of the wrong type."""
        return TOPOLOGIES.build(spec, seed=seed)

    def build(self, n: int, epoch: int = 0) -> TopologySequence:
        """The per-round topology for ``n`` ranks in ``epoch`` (pure; same on every peer)."""
        return make_topology_sequence(
            self.name, n, seed=derive_seed(self.seed, "epoch", epoch), **self.options
        )


def repair_topology(
    old: Topology,
    old_members: Sequence[Any],
    new_members: Sequence[Any],
    *,
    seed: int = 0,
    min_degree: int = 1,
) -> Topology:
    """Carry ``old`` (over the ranks of ``old_members``) to ``new_members`` with few changes.

    Rank ``i`` is ``members[i]`` in both lists (members are any hashable, sortable peer ids).
    Every edge whose two peers survive is kept. Then the fewest possible edges are added to
    make the graph connected: one edge from each smaller component (joiners are singleton
    components) to the largest, between the lowest-degree rank of each side, so attachments
    spread over the surviving body instead of piling up on one rank. Finally any rank below
    ``min_degree`` is joined to the lowest-degree ranks it is not yet adjacent to (use 2 to stop
    joiners from hanging off a single edge). Ties are broken by a seeded order, identical on
    every peer.

    Raises ``ValueError`` if a member list has duplicates or ``old`` does not match
    ``old_members``.
    """
    if len(old_members) != old.n:
        raise ValueError(
            f"old topology has {old.n} ranks but {len(old_members)} old members were given"
        )
    for label, members in (("old_members", old_members), ("new_members", new_members)):
        if len(set(members)) != len(members):
            raise ValueError(f"{label} lists a peer twice: {list(members)!r}")
    if min_degree < 0:
        raise ValueError(f"min_degree must be >= 0, got {min_degree}")
    n = len(new_members)
    check_ranks(n)
    new_rank = {p: i for i, p in enumerate(new_members)}
    adj: list[set[int]] = [set() for _ in range(n)]
    for i, j in old.edges():
        a, b = new_rank.get(old_members[i]), new_rank.get(old_members[j])
        if a is not None and b is not None:
            adj[a].add(b)
            adj[b].add(a)
    # seeded tie-break: the same on every peer, different across seeds so repeated repairs do not
    # always load the same low ranks
    tiebreak = list(range(n))
    Rng(derive_seed(seed, "repair", n)).shuffle(tiebreak)
    position = {r: k for k, r in enumerate(tiebreak)}

    def lowest(candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda r: (len(adj[r]), position[r]))

    comps = connected_components(Topology(old.name, tuple(frozenset(a) for a in adj)))
    main = comps[0]
    for comp in comps[1:]:
        u, v = lowest(main), lowest(comp)
        adj[u].add(v)
        adj[v].add(u)
    for r in sorted(range(n), key=lambda r: position[r]):
        while len(adj[r]) < min_degree:
            free = [x for x in range(n) if x != r and x not in adj[r]]
            if not free:
                break
            x = lowest(free)
            adj[r].add(x)
            adj[x].add(r)
    return Topology(old.name, tuple(frozenset(a) for a in adj))


def rebuild_topology(
    spec: TopologySpec,
    new_members: Sequence[Any],
    *,
    epoch: int,
    mode: str = "regenerate",
    old: Topology | None = None,
    old_members: Sequence[Any] | None = None,
    min_degree: int = 1,
) -> TopologySequence:
    """The topology for a new membership epoch.

    ``mode="regenerate"`` builds ``spec`` afresh for ``len(new_members)`` ranks, seeded by
    ``(spec.seed, epoch)``: simplest, and always the family's intended shape. ``mode="repair"``
    calls :func:`repair_topology` on ``old`` (the previous epoch's static graph over
    ``old_members``): surviving edges stay, so neighbours keep talking to the same peers.
    Repair needs ``old`` and ``old_members`` and a static family; a time-varying family is always
    regenerated.

    Raises ``ValueError`` for an unknown mode or missing ``old``/``old_members`` in repair mode.
    """
    n = len(new_members)
    if mode == "regenerate" or spec.name in TIME_VARYING_TOPOLOGIES:
        if mode not in ("regenerate", "repair"):
            raise ValueError(f"unknown rebuild mode {mode!r}; use 'regenerate' or 'repair'")
        return spec.build(n, epoch)
    if mode != "repair":
        raise ValueError(f"unknown rebuild mode {mode!r}; use 'regenerate' or 'repair'")
    if old is None or old_members is None:
        raise ValueError("mode='repair' needs the previous topology (old=) and its old_members=")
    return StaticSequence(
        repair_topology(
            old,
            old_members,
            new_members,
            seed=derive_seed(spec.seed, "epoch", epoch),
            min_degree=min_degree,
        )
    )


def embed_topology(top: Topology, ranks: Sequence[int], world: int) -> Topology:
    """Place ``top`` (over ``0..top.n-1``) on ranks ``ranks[i]`` of a group of ``world`` ranks;
    every other rank is isolated (no edges: it keeps its own vector when mixing).

    Gossip mixes only among the peers that hold a usable model; joiners and stale peers sit a
    round out this way. Raises ``ValueError`` if ``ranks`` does not list ``top.n`` distinct ranks
    inside ``0..world-1``.
    """
    if len(ranks) != top.n or len(set(ranks)) != len(ranks):
        raise ValueError(f"need {top.n} distinct ranks to embed the topology, got {list(ranks)}")
    if any(not 0 <= r < world for r in ranks):
        raise ValueError(f"ranks {list(ranks)} are not all inside 0..{world - 1}")
    if top.n == world and list(ranks) == list(range(world)):
        return top
    return Topology.from_edges(top.name, world, ((ranks[i], ranks[j]) for i, j in top.edges()))


@dataclass(frozen=True)
class EmbeddedSequence:
    """A topology sequence over a subset of ranks (see :func:`embed_topology`), round by round."""

    inner: TopologySequence
    ranks: tuple[int, ...]
    world: int
    name: str = field(init=False)
    n: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.ranks) != self.inner.n:
            raise ValueError(f"{len(self.ranks)} ranks for a sequence over {self.inner.n}")
        object.__setattr__(self, "name", self.inner.name)
        object.__setattr__(self, "n", self.world)

    @property
    def period(self) -> int:
        return self.inner.period

    def at(self, round: int) -> Topology:
        return embed_topology(self.inner.at(round), self.ranks, self.world)


def _topology_spec(name: str, options: Any = None, *, seed: int = 0) -> TopologySpec:
    return TopologySpec(
        name=name, seed=seed, options=dataclasses.asdict(options) if options is not None else {}
    )


TOPOLOGIES: Registry[TopologySpec] = Registry("topology")
"""Every topology family by spec name (static ones first); an entry's config is the family's
options dataclass from :data:`~.topology.TOPOLOGY_OPTIONS` (None: no options), and building it
with ``seed=`` gives the :class:`TopologySpec`."""

for _name in (*STATIC_TOPOLOGIES, *TIME_VARYING_TOPOLOGIES):
    TOPOLOGIES.add(
        _name,
        config=TOPOLOGY_OPTIONS.get(_name),
        build=functools.partial(_topology_spec, _name),
    )
