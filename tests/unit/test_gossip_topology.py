"""Gossip topologies: shapes, determinism, connectivity, time-varying unions, membership repair."""

from __future__ import annotations

import pytest

from isthmus.strategies.gossip.math._rng import Rng, derive_seed
from isthmus.strategies.gossip.math.rebuild import TopologySpec, rebuild_topology, repair_topology
from isthmus.strategies.gossip.math.sequence import (
    OnePeerExponential,
    RandomMatching,
    make_topology_sequence,
    union_topology,
)
from isthmus.strategies.gossip.math.topology import (
    STATIC_TOPOLOGIES,
    DisconnectedGraphError,
    Topology,
    barabasi_albert,
    connected_components,
    exponential,
    is_connected,
    make_topology,
    random_regular,
    ring,
    torus,
    torus_shape,
)

SIZES = [1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 33]


@pytest.mark.parametrize("name", sorted(STATIC_TOPOLOGIES))
@pytest.mark.parametrize("n", SIZES)
def test_every_static_topology_is_connected_simple_and_deterministic(name, n):
    a = make_topology(name, n, seed=5)
    b = make_topology(name, n, seed=5)
    assert a == b
    assert a.n == n
    assert is_connected(a)
    for i in range(n):
        assert i not in a.adjacency[i]
        for j in a.adjacency[i]:
            assert i in a.adjacency[j]


def test_shapes_of_deterministic_families():
    assert ring(5).edges() == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    assert ring(2).edges() == [(0, 1)]
    assert ring(1).edges() == []
    assert torus_shape(12) == (3, 4)
    assert torus_shape(16) == (4, 4)
    assert torus_shape(13) == (1, 13)  # prime: a ring
    assert torus(13).adjacency == ring(13).adjacency
    t = torus(12)  # 3 x 4: every rank has 4 distinct neighbours
    assert all(t.degree(i) == 4 for i in range(12))
    assert t.neighbors(5) == (1, 4, 6, 9)  # (1,1): left (1,0)=4, right (1,2)=6, up 1, down 9
    assert all(torus(8).degree(i) == 3 for i in range(8))  # 2 x 4: up and down coincide
    e = exponential(16)  # offsets ±1, ±2, ±4, ±8 (8 coincides with -8)
    assert e.neighbors(0) == (1, 2, 4, 8, 12, 14, 15)
    assert make_topology("complete", 6).num_edges == 15


def test_random_regular_degrees_seeds_and_fallbacks():
    for n, d in [(10, 3), (16, 4), (20, 17), (50, 6), (9, 2)]:
        t = random_regular(n, d, seed=3)
        assert all(t.degree(i) == d for i in range(n))
        assert is_connected(t)
    assert random_regular(16, 4, seed=1) != random_regular(16, 4, seed=2)
    # odd n * d: one rank gets degree d + 1 unless strict
    t = random_regular(11, 3, seed=0)
    degs = sorted(t.degree(i) for i in range(11))
    assert degs == [3] * 10 + [4]
    with pytest.raises(ValueError, match="odd"):
        random_regular(11, 3, strict=True)
    # degree >= n: complete graph unless strict
    assert random_regular(4, 6).num_edges == 6
    with pytest.raises(ValueError, match="needs at least 7 ranks"):
        random_regular(4, 6, strict=True)
    with pytest.raises(ValueError, match="degree 1 cannot connect"):
        random_regular(6, 1)


def test_barabasi_albert_grows_from_a_complete_core():
    t = barabasi_albert(30, m=2, seed=4)
    assert t.num_edges == 3 + 2 * 27  # the K_3 core, then 2 edges for each of ranks 3..29
    assert t == barabasi_albert(30, m=2, seed=4)
    assert t != barabasi_albert(30, m=2, seed=5)
    assert all(t.degree(i) >= 2 for i in range(30))
    assert barabasi_albert(3, m=3).num_edges == 3  # n <= m + 1: complete
    with pytest.raises(ValueError, match="m >= 1"):
        barabasi_albert(5, m=0)


def test_make_topology_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        make_topology("star", 4)
    with pytest.raises(TypeError, match="takes options"):
        make_topology("ring", 4, degree=3)
    assert make_topology("random_regular", 10, degree=3).degree(0) == 3
    assert make_topology("barabasi_albert", 10, m=3).num_edges == 6 + 3 * 6


def test_disconnected_graph_error_names_components():
    top = Topology.from_edges("pieces", 7, [(0, 1), (1, 2), (3, 4), (5, 6)])
    assert connected_components(top) == [[0, 1, 2], [3, 4], [5, 6]]
    assert not is_connected(top)
    with pytest.raises(DisconnectedGraphError) as err:
        top.require_connected()
    assert err.value.components == [[0, 1, 2], [3, 4], [5, 6]]
    assert "{0, 1, 2}" in str(err.value) and "{5, 6}" in str(err.value)


def test_topology_validation():
    with pytest.raises(ValueError, match="undirected"):
        Topology("bad", (frozenset({1}), frozenset()))
    with pytest.raises(ValueError, match="self loop"):
        Topology.from_edges("bad", 3, [(1, 1)])
    with pytest.raises(ValueError, match="outside"):
        Topology.from_edges("bad", 3, [(0, 3)])
    with pytest.raises(ValueError, match="n >= 1"):
        ring(0)


@pytest.mark.parametrize("n", [2, 5, 8, 12, 16])
def test_one_peer_exponential_is_a_matching_whose_period_union_is_connected(n):
    seq = OnePeerExponential(n)
    for r in range(seq.period):
        g = seq.at(r)
        assert all(g.degree(i) <= 1 for i in range(n))
    assert is_connected(union_topology(seq, range(seq.period)))
    assert seq.at(0) == seq.at(seq.period)


def test_random_matching_changes_per_round_and_unions_connect():
    seq = RandomMatching(10, seed=3)
    assert seq.at(4) == RandomMatching(10, seed=3).at(4)
    assert seq.at(4) != seq.at(5)
    assert all(seq.at(0).degree(i) == 1 for i in range(10))
    assert not is_connected(seq.at(0))
    assert is_connected(union_topology(seq, range(seq.period)))
    assert sorted(RandomMatching(7).at(1).degree(i) for i in range(7)) == [0] + [1] * 6


def test_make_topology_sequence_wraps_static_names():
    s = make_topology_sequence("ring", 6)
    assert s.at(0) == s.at(99) == ring(6)
    assert isinstance(make_topology_sequence("one_peer_exponential", 8), OnePeerExponential)
    with pytest.raises(ValueError, match="unknown topology"):
        make_topology_sequence("mesh", 4)


def test_regenerate_on_membership_change_is_per_epoch_deterministic():
    spec = TopologySpec(name="random_regular", seed=11, options={"degree": 3})
    members = [f"peer{i:02d}" for i in range(12)]
    a = rebuild_topology(spec, members, epoch=3).at(0)
    assert a == rebuild_topology(spec, list(members), epoch=3).at(0)
    assert a != rebuild_topology(spec, members, epoch=4).at(0)
    assert a.n == 12 and is_connected(a)
    with pytest.raises(ValueError, match="takes options"):
        TopologySpec(name="ring", options={"degree": 3})


@pytest.mark.parametrize("name", ["ring", "barabasi_albert", "torus", "random_regular"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repair_after_dropping_a_quarter_keeps_surviving_edges_and_connects(name, seed):
    old_members = [f"p{i:02d}" for i in range(16)]
    old = make_topology(name, 16, seed=seed)
    rng = Rng(derive_seed(seed, "test-drop"))
    dropped = list(range(16))
    rng.shuffle(dropped)
    gone = {old_members[i] for i in dropped[:4]}
    new_members = [p for p in old_members if p not in gone]
    fixed = repair_topology(old, old_members, new_members, seed=seed)
    assert fixed.n == 12 and is_connected(fixed)
    rank = {p: i for i, p in enumerate(new_members)}
    survivors = {
        tuple(sorted((rank[old_members[i]], rank[old_members[j]])))
        for i, j in old.edges()
        if old_members[i] not in gone and old_members[j] not in gone
    }
    added = set(fixed.edges()) - survivors
    assert survivors <= set(fixed.edges())
    # minimal: exactly one added edge per extra component of the surviving graph
    surviving = Topology.from_edges("s", 12, survivors)
    assert len(added) == len(connected_components(surviving)) - 1
    assert fixed == repair_topology(old, old_members, new_members, seed=seed)


def test_repair_connects_joiners_and_tops_up_min_degree():
    old_members = ["a", "b", "c", "d"]
    old = ring(4)
    new_members = ["a", "b", "c", "d", "e", "f"]
    fixed = repair_topology(old, old_members, new_members)
    assert is_connected(fixed) and fixed.num_edges == 4 + 2
    fixed2 = repair_topology(old, old_members, new_members, min_degree=2)
    assert is_connected(fixed2) and all(fixed2.degree(i) >= 2 for i in range(6))
    spec = TopologySpec(name="ring")
    seq = rebuild_topology(
        spec, new_members, epoch=1, mode="repair", old=old, old_members=old_members
    )
    assert is_connected(seq.at(0))
    with pytest.raises(ValueError, match="needs the previous topology"):
        rebuild_topology(spec, new_members, epoch=1, mode="repair")
    with pytest.raises(ValueError, match="lists a peer twice"):
        repair_topology(old, old_members, ["a", "a"])


def test_repair_splits_by_removal_of_a_cut_vertex():
    # a path 0-1-2-3-4: removing rank 2 leaves {0,1} and {3,4}; one edge reconnects them
    old = Topology.from_edges("path", 5, [(0, 1), (1, 2), (2, 3), (3, 4)])
    fixed = repair_topology(old, [0, 1, 2, 3, 4], [0, 1, 3, 4])
    assert is_connected(fixed) and fixed.num_edges == 3
