"""The run's gossip graph over peer ids: the same on every peer for the same members, repaired
from shared tensors a joiner can receive, departures that split it reported, and embedding of a
graph over a subset of ranks."""

from __future__ import annotations

import pytest

from isthmus.strategies.gossip.math import (
    EmbeddedSequence,
    OnePeerExponential,
    PeerGraph,
    TopologySpec,
    embed_topology,
    is_connected,
    make_topology,
    metropolis_matrix,
)
from isthmus.strategies.gossip.math.mixing import check_mixing_matrix


def _edges(seq, members):
    top = seq.at(0)
    return {(members[i], members[j]) for i, j in top.edges()}


def test_regenerate_is_a_pure_function_of_the_member_list():
    spec = TopologySpec(name="barabasi_albert", seed=3, options={"m": 2})
    members = (4, 9, 10, 11, 15, 20, 21, 30)
    a, ra = PeerGraph(spec).plan(members)
    b, _ = PeerGraph(spec).plan(list(members))  # a fresh peer (a joiner) gets the same graph
    assert _edges(a, members) == _edges(b, members)
    assert ra.previous is None and ra.arrived == members and not ra.split
    c, _ = PeerGraph(spec).plan(members[:-1])
    assert c.n == 7 and is_connected(c.at(0))
    other, _ = PeerGraph(TopologySpec(name="barabasi_albert", seed=4)).plan(members)
    assert _edges(other, members) != _edges(a, members)


def test_repair_keeps_surviving_edges_reports_a_split_and_lives_in_shared_tensors():
    spec = TopologySpec(name="ring")
    members = tuple(range(0, 16, 2))  # peer ids 0, 2, ..., 14 on a ring
    g = PeerGraph(spec, mode="repair", capacity=16, min_degree=2)
    seq, _ = g.plan(members)
    g.commit(members, seq)
    # a joiner holds only the shared tensors (as the session transfers them) and gets the same
    fresh = PeerGraph(spec, mode="repair", capacity=16, min_degree=2)
    for name, t in g.shared_tensors().items():
        fresh.shared_tensors()[name].copy_(t)
    survivors = (0, 2, 6, 8, 10, 14)  # peers 4 and 12 died: the ring falls into two arcs
    new, report = g.plan(survivors)
    new2, report2 = fresh.plan(survivors)
    assert _edges(new, survivors) == _edges(new2, survivors) and report == report2
    assert report.departed == (4, 12) and report.arrived == ()
    assert report.split and sorted(map(sorted, report.components)) == [[0, 2, 14], [6, 8, 10]]
    kept = {(a, b) for a, b in _edges(seq, members) if a in survivors and b in survivors}
    assert kept <= _edges(new, survivors)
    assert set(report.added) == _edges(new, survivors) - kept and report.added
    assert is_connected(new.at(0)) and min(new.at(0).degree(i) for i in range(6)) >= 2
    check_mixing_matrix(metropolis_matrix(new.at(0)))
    assert "split into 2 components" in report.describe()
    # the same members again: nothing changes
    g.commit(survivors, new)
    same, rep = g.plan(survivors)
    assert _edges(same, survivors) == _edges(new, survivors) and not rep.changed


def test_repair_attaches_a_joiner():
    spec = TopologySpec(name="complete")
    g = PeerGraph(spec, mode="repair", capacity=8, min_degree=2)
    seq, _ = g.plan((1, 2, 3))
    g.commit((1, 2, 3), seq)
    new, report = g.plan((1, 2, 3, 7))
    assert report.arrived == (7,) and not report.split
    assert new.at(0).degree(3) == 2 and len(report.added) == 2


def test_peer_graph_errors():
    with pytest.raises(ValueError, match="static"):
        PeerGraph(TopologySpec(name="one_peer_exponential"), mode="repair")
    with pytest.raises(ValueError, match="rebuild mode"):
        PeerGraph(TopologySpec(name="ring"), mode="rewire")
    g = PeerGraph(TopologySpec(name="ring"), mode="repair", capacity=3)
    with pytest.raises(ValueError, match="capacity"):
        g.plan((1, 2, 3, 4))
    with pytest.raises(ValueError, match="distinct"):
        g.plan((1, 1))
    with pytest.raises(ValueError, match="at least one"):
        g.plan(())


def test_embedding_isolates_the_ranks_left_out():
    top = make_topology("ring", 3)
    placed = embed_topology(top, [0, 2, 4], 5)
    assert placed.n == 5 and placed.degree(1) == 0 and placed.degree(3) == 0
    assert {tuple(e) for e in placed.edges()} == {(0, 2), (0, 4), (2, 4)}
    w = metropolis_matrix(placed)
    check_mixing_matrix(w)
    assert w[1, 1] == 1.0 and w[3, 3] == 1.0
    assert embed_topology(top, [0, 1, 2], 3) is top
    seq = EmbeddedSequence(OnePeerExponential(4), (1, 2, 3, 5), 6)
    assert seq.n == 6 and seq.period == 2
    assert {tuple(e) for e in seq.at(0).edges()} == {(1, 2), (3, 5)}
    with pytest.raises(ValueError, match="distinct ranks"):
        embed_topology(top, [0, 0, 1], 5)
    with pytest.raises(ValueError, match="inside"):
        embed_topology(top, [0, 1, 9], 5)
