"""Time-varying gossip graphs: a graph per round, pure in the round number.

A :class:`TopologySequence` gives every peer the same graph for the same round. A static
topology is the constant sequence (:class:`StaticSequence`), so strategies treat both alike. Two
families change every round:

* one-peer exponential (Ying et al., "Exponential Graph is Provably Efficient for Decentralized
  Deep Training", NeurIPS 2021): in round ``t`` every rank talks to one partner. The paper uses
  the directed ``i -> i + 2^k``; this is the undirected hypercube matching ``i <-> i XOR 2^k``
  (``k = t mod ceil(log2 n)``) so that Metropolis weights apply. With ``n`` a power of two,
  ``log2 n`` consecutive rounds with weight 1/2 give the exact average.
* random matching: a fresh seeded perfect (or near-perfect) matching every round.

A single round's graph may be disconnected; what matters for consensus is that the union over a
few consecutive rounds (:func:`union_topology`) is connected. Unknown names or options raise like
:func:`~.topology.make_topology`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from isthmus.strategies.gossip.math._rng import Rng, derive_seed
from isthmus.strategies.gossip.math.topology import (
    STATIC_TOPOLOGIES,
    Topology,
    check_ranks,
    check_topology_options,
    make_topology,
)

__all__ = [
    "TIME_VARYING_TOPOLOGIES",
    "OnePeerExponential",
    "RandomMatching",
    "StaticSequence",
    "TopologySequence",
    "make_topology_sequence",
    "union_topology",
]


class TopologySequence(Protocol):
    """A graph per gossip round. ``at(round)`` is pure: every peer gets the same graph for the same
    round. A single round's graph may be disconnected (a matching); what matters for consensus is
    that the union over ``period`` consecutive rounds is connected."""

    name: str
    n: int

    @property
    def period(self) -> int: ...

    def at(self, round: int) -> Topology: ...


@dataclass(frozen=True)
class StaticSequence:
    """The same topology every round, so strategies can treat static and time-varying alike."""

    topology: Topology
    name: str = field(init=False)
    n: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.topology.name)
        object.__setattr__(self, "n", self.topology.n)

    @property
    def period(self) -> int:
        return 1

    def at(self, round: int) -> Topology:
        return self.topology


@dataclass(frozen=True)
class OnePeerExponential:
    """Round ``t`` pairs ``i`` with ``i XOR 2^k``, ``k = t mod ceil(log2 n)``; one partner per rank.

    When the partner index is ``>= n`` (``n`` not a power of two) the rank sits the round out. With
    Metropolis weights every pair averages exactly, so for ``n`` a power of two ``log2 n``
    consecutive rounds give the exact global average. ``period`` rounds always form a connected
    union (every rank reaches rank 0 by clearing its bits one at a time, high to low).
    """

    n: int
    name: str = "one_peer_exponential"

    def __post_init__(self) -> None:
        check_ranks(self.n)

    @property
    def period(self) -> int:
        return max(1, (self.n - 1).bit_length())

    def at(self, round: int) -> Topology:
        bit = 1 << (round % self.period)
        return Topology.from_edges(
            self.name, self.n, ((i, i ^ bit) for i in range(self.n) if (i ^ bit) < self.n)
        )


@dataclass(frozen=True)
class RandomMatching:
    """A fresh seeded random matching every round (with odd ``n``, one rank sits out).

    Any single round is disconnected for ``n > 2``; unions of a few rounds are connected with high
    probability. ``period`` (``2 ceil(log2 n)`` rounds) is a guide for how many rounds to take
    together, not a guarantee that their union is connected.
    """

    n: int
    seed: int = 0
    name: str = "random_matching"

    def __post_init__(self) -> None:
        check_ranks(self.n)

    @property
    def period(self) -> int:
        return max(1, 2 * (self.n - 1).bit_length())

    def at(self, round: int) -> Topology:
        order = list(range(self.n))
        Rng(derive_seed(self.seed, "random_matching", self.n, round)).shuffle(order)
        return Topology.from_edges(
            self.name, self.n, ((order[i], order[i + 1]) for i in range(0, self.n - 1, 2))
        )


TIME_VARYING_TOPOLOGIES: dict[str, Callable[..., TopologySequence]] = {
    "one_peer_exponential": lambda n, seed: OnePeerExponential(n),
    "random_matching": lambda n, seed: RandomMatching(n, seed),
}


def make_topology_sequence(name: str, n: int, *, seed: int = 0, **options: Any) -> TopologySequence:
    """A per-round topology: a time-varying family by name, or any static name (constant).

    Raises like :func:`make_topology` for unknown names or options.
    """
    if name in TIME_VARYING_TOPOLOGIES:
        check_topology_options(name, TIME_VARYING_TOPOLOGIES, options)
        return TIME_VARYING_TOPOLOGIES[name](n, seed)
    if name not in STATIC_TOPOLOGIES:
        known = sorted(STATIC_TOPOLOGIES) + sorted(TIME_VARYING_TOPOLOGIES)
        raise ValueError(f"unknown topology {name!r}; choose one of {known}")
    return StaticSequence(make_topology(name, n, seed=seed, **options))


def union_topology(seq: TopologySequence, rounds: Iterable[int]) -> Topology:
    """The union of the graphs of ``rounds``: the reach of that many rounds of gossip."""
    edges: set[tuple[int, int]] = set()
    for r in rounds:
        edges.update(seq.at(r).edges())
    return Topology.from_edges(f"union({seq.name})", seq.n, edges)
