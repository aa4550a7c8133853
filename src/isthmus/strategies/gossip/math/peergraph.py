"""The gossip graph of a run over *peer ids*, rebuilt as membership changes.

A :class:`~.topology.Topology` is over ranks ``0..n-1``; a run's peers come and go, so the
strategy keeps the graph over peer ids (the coordinator's numbering, stable for a peer's life)
and derives the graph of each round from the round's member list. Every peer must get the same
graph without talking to anyone:

* ``mode="regenerate"`` (default): the graph is a pure function of ``(spec, member list)``:
  ``spec.build(n, epoch=derive_seed("members", *members))``. The same members always give the
  same graph, a change of membership gives a fresh graph of the family's intended shape, and a
  joiner needs no history.
* ``mode="repair"``: surviving edges are kept and the fewest edges are added to reconnect the
  graph and attach newcomers (:func:`~.topology.repair_topology`). That needs the previous graph,
  which a joiner does not have, so the graph lives in two fixed-size tensors (``ids``: the peer
  ids of the graph's nodes, ``adj``: a ``capacity x capacity`` 0/1 matrix) that the strategy
  registers as shared state: they are identical on every in-sync peer, hashed every round and
  sent to joiners with the rest of the shared state. They change only when a round commits
  (:meth:`PeerGraph.commit`).

Either way :meth:`PeerGraph.plan` reports what happened: who left, who arrived, and the
connected components of the surviving edges. A departure that splits the graph (the "disaster"
case of "Exploring the Impact of Disrupted Peer-to-Peer Communications on Fully Decentralized
Learning in Disaster Scenarios", 2023) shows up there as more than one component; repair mode
then names the edges it added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.strategies.gossip.math._rng import derive_seed
from isthmus.strategies.gossip.math.rebuild import TopologySpec, repair_topology
from isthmus.strategies.gossip.math.sequence import (
    TIME_VARYING_TOPOLOGIES,
    StaticSequence,
    TopologySequence,
)
from isthmus.strategies.gossip.math.topology import Topology, connected_components

__all__ = ["REBUILD_MODES", "GraphReport", "PeerGraph"]

REBUILD_MODES = ("regenerate", "repair")


@dataclass(frozen=True)
class GraphReport:
    """What a membership change did to the graph (peer ids throughout)."""

    members: tuple[int, ...]
    """The graph's nodes; node ``i`` of the topology is ``members[i]``."""
    previous: tuple[int, ...] | None
    """The nodes of the graph this one replaces (None: this peer knows no earlier graph)."""
    departed: tuple[int, ...]
    arrived: tuple[int, ...]
    components: tuple[tuple[int, ...], ...]
    """Connected components of the previous graph's edges among the peers still present (largest
    first); empty when no previous static graph is known."""
    added: tuple[tuple[int, int], ...]
    """Edges repair mode added (empty in regenerate mode)."""

    @property
    def changed(self) -> bool:
        return self.previous != self.members

    @property
    def split(self) -> bool:
        """The departures left the surviving edges disconnected."""
        return len(self.components) > 1

    def describe(self) -> str:
        parts = [f"{len(self.members)} peers"]
        if self.departed:
            parts.append(f"left {list(self.departed)}")
        if self.arrived:
            parts.append(f"arrived {list(self.arrived)}")
        if self.split:
            comps = "; ".join("{" + ", ".join(map(str, c)) + "}" for c in self.components)
            parts.append(f"surviving edges split into {len(self.components)} components: {comps}")
        if self.added:
            parts.append(f"added edges {[list(e) for e in self.added]}")
        return ", ".join(parts)


def _check_members(members: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(m) for m in members)
    if not out:
        raise ValueError("a gossip graph needs at least one member")
    if len(set(out)) != len(out) or any(m < 0 for m in out):
        raise ValueError(f"members must be distinct non-negative peer ids, got {list(out)}")
    return out


class PeerGraph:
    """The run's gossip graph over peer ids (see the module docstring).

    Raises ``ValueError`` for an unknown mode, repair mode with a time-varying family (its graph
    changes every round, so there is nothing to repair), or ``capacity < 1``.
    """

    def __init__(
        self,
        spec: TopologySpec,
        *,
        mode: str = "regenerate",
        capacity: int = 64,
        min_degree: int = 2,
    ) -> None:
        if mode not in REBUILD_MODES:
            raise ValueError(f"rebuild mode must be one of {REBUILD_MODES}, got {mode!r}")
        if mode == "repair" and spec.name in TIME_VARYING_TOPOLOGIES:
            raise ValueError(
                f"rebuild mode 'repair' needs a static topology; {spec.name!r} changes every "
                f"round (use mode 'regenerate')"
            )
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.spec = spec
        self.mode = mode
        self.capacity = capacity
        self.min_degree = min_degree
        self.ids = torch.full((capacity,), -1, dtype=torch.int64)
        self.adj = torch.zeros((capacity, capacity), dtype=torch.uint8)
        # this peer's last committed graph, for reports in regenerate mode (not shared)
        self._last: tuple[tuple[int, ...], TopologySequence] | None = None

    def shared_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to register as shared state: ``ids`` and ``adj`` in repair mode, none in
        regenerate mode (the graph follows from the member list alone)."""
        return {"ids": self.ids, "adj": self.adj} if self.mode == "repair" else {}

    def stored(self) -> tuple[tuple[int, ...], TopologySequence] | None:
        """The last committed graph and its members, or None before the first."""
        if self.mode == "regenerate":
            return self._last
        n = int((self.ids >= 0).sum())
        if n == 0:
            return None
        members = tuple(int(x) for x in self.ids[:n])
        a = self.adj[:n, :n]
        top = Topology.from_edges(
            self.spec.name, n, ((i, j) for i in range(n) for j in range(i + 1, n) if a[i, j])
        )
        return members, StaticSequence(top)

    def plan(self, members: Sequence[int]) -> tuple[TopologySequence, GraphReport]:
        """The graph for ``members`` (node ``i`` = ``members[i]``) and a report; changes nothing.

        Pure given the committed graph: every in-sync peer gets the same answer. Raises
        ``ValueError`` for a bad member list or, in repair mode, more members than
        ``capacity``.
        """
        mem = _check_members(members)
        if self.mode == "repair" and len(mem) > self.capacity:
            raise ValueError(
                f"{len(mem)} peers exceed the gossip graph's capacity of {self.capacity}; "
                f"raise the strategy's graph_capacity option"
            )
        prev = self.stored()
        components: tuple[tuple[int, ...], ...] = ()
        previous: tuple[int, ...] | None = None
        if prev is not None:
            previous = prev[0]
            components = _surviving_components(prev[0], prev[1], mem)
        added: tuple[tuple[int, int], ...] = ()
        if self.mode == "repair" and prev is not None:
            old_members, old_seq = prev
            old = old_seq.at(0)
            if old_members == mem:
                seq: TopologySequence = old_seq
            else:
                new = repair_topology(
                    old,
                    old_members,
                    mem,
                    seed=derive_seed(self.spec.seed, "repair", *mem),
                    min_degree=self.min_degree,
                )
                kept = {_edge(old_members[i], old_members[j]) for i, j in old.edges()} & {
                    _edge(mem[i], mem[j]) for i, j in new.edges()
                }
                added = tuple(
                    sorted(
                        e for e in (_edge(mem[i], mem[j]) for i, j in new.edges()) if e not in kept
                    )
                )
                seq = StaticSequence(new)
        else:
            seq = self.spec.build(len(mem), epoch=derive_seed("members", *mem))
        report = GraphReport(
            members=mem,
            previous=previous,
            departed=tuple(sorted(set(previous or ()) - set(mem))),
            arrived=tuple(sorted(set(mem) - set(previous or ()))),
            components=components,
            added=added,
        )
        return seq, report

    def commit(self, members: Sequence[int], seq: TopologySequence) -> None:
        """Make ``seq`` over ``members`` the committed graph (call once its round committed)."""
        mem = _check_members(members)
        if seq.n != len(mem):
            raise ValueError(f"graph over {seq.n} nodes for {len(mem)} members")
        self._last = (mem, seq)
        if self.mode != "repair":
            return
        top = seq.at(0)
        self.ids.fill_(-1)
        self.ids[: len(mem)] = torch.tensor(mem, dtype=torch.int64)
        self.adj.zero_()
        for i, j in top.edges():
            self.adj[i, j] = 1
            self.adj[j, i] = 1


def _edge(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def _surviving_components(
    old_members: tuple[int, ...], old_seq: TopologySequence, members: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    if old_seq.name in TIME_VARYING_TOPOLOGIES:
        return ()  # one round's graph of a time-varying family says nothing about connectivity
    present = set(members)
    keep = [i for i, m in enumerate(old_members) if m in present]
    if not keep:
        return ()
    pos = {old: new for new, old in enumerate(keep)}
    old = old_seq.at(0)
    sub = Topology.from_edges(
        old.name,
        len(keep),
        ((pos[i], pos[j]) for i, j in old.edges() if i in pos and j in pos),
    )
    return tuple(tuple(old_members[keep[r]] for r in comp) for comp in connected_components(sub))
