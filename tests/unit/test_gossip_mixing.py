"""Metropolis-Hastings mixing: doubly stochastic, symmetric, connected spectral gap; checks fail."""

from __future__ import annotations

import numpy as np
import pytest

from isthmus.strategies.gossip.math.mixing import (
    check_mixing_matrix,
    is_doubly_stochastic,
    is_symmetric,
    metropolis_matrix,
    metropolis_row,
    second_largest_eigenvalue,
    spectral_gap,
)
from isthmus.strategies.gossip.math.sequence import OnePeerExponential
from isthmus.strategies.gossip.math.topology import STATIC_TOPOLOGIES, Topology, make_topology, ring


@pytest.mark.parametrize("name", sorted(STATIC_TOPOLOGIES))
@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 17])
def test_metropolis_is_doubly_stochastic_symmetric_and_connected(name, n):
    w = metropolis_matrix(make_topology(name, n, seed=1))
    check_mixing_matrix(w)
    assert is_symmetric(w) and is_doubly_stochastic(w)
    # connected graph + positive self weights: the consensus eigenvalue 1 is simple and isolated
    assert spectral_gap(w) > 1e-6
    # repeated mixing converges to the uniform average matrix
    assert np.allclose(np.linalg.matrix_power(w, 4000), np.full((n, n), 1.0 / n), atol=1e-8)


def test_known_weights():
    self_w, row = metropolis_row(ring(5), 0)
    assert row == {1: 1 / 3, 4: 1 / 3}
    assert self_w == pytest.approx(1 / 3)
    # star: centre degree 3, leaves degree 1 -> every edge weighs 1/4
    star = Topology.from_edges("star", 4, [(0, 1), (0, 2), (0, 3)])
    w = metropolis_matrix(star)
    assert w[0, 1] == 0.25 and w[1, 1] == 0.75 and w[0, 0] == pytest.approx(0.25)


def test_spectral_gap_orders_topologies_and_complete_mixes_in_one_step():
    gaps = {
        name: spectral_gap(metropolis_matrix(make_topology(name, 16)))
        for name in ("ring", "torus", "exponential", "complete")
    }
    assert gaps["ring"] < gaps["torus"] < gaps["exponential"] < gaps["complete"]
    assert gaps["complete"] == pytest.approx(1.0)
    w = metropolis_matrix(make_topology("complete", 6))
    assert np.allclose(w, np.full((6, 6), 1 / 6))


def test_disconnected_graph_has_zero_gap_and_one_peer_pairs_average():
    w = metropolis_matrix(Topology.from_edges("two", 4, [(0, 1), (2, 3)]))
    assert spectral_gap(w) == pytest.approx(0.0, abs=1e-12)
    seq = OnePeerExponential(8)
    prod = np.eye(8)
    for r in range(seq.period):
        m = metropolis_matrix(seq.at(r))
        assert set(np.unique(m)) <= {0.0, 0.5}
        prod = m @ prod
    assert np.allclose(prod, np.full((8, 8), 1 / 8), atol=1e-15)


def test_checks_reject_bad_matrices():
    with pytest.raises(ValueError, match="not symmetric"):
        check_mixing_matrix(np.array([[0.5, 0.5], [0.2, 0.8]]))
    with pytest.raises(ValueError, match="not doubly stochastic"):
        check_mixing_matrix(np.array([[0.6, 0.5], [0.5, 0.6]]))
    with pytest.raises(ValueError, match="NaN"):
        check_mixing_matrix(np.array([[np.nan, 0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="square"):
        check_mixing_matrix(np.ones((2, 3)))
    assert not is_doubly_stochastic(np.array([[1.5, -0.5], [-0.5, 1.5]]))
    with pytest.raises(ValueError, match="symmetric"):
        second_largest_eigenvalue(np.array([[0.5, 0.5], [0.0, 1.0]]))
