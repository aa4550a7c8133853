"""Group byte accounting in one process: the broadcast tree's volume, a world of one."""

import torch

from isthmus.comm.group import wire_bytes
from isthmus.testing import local_groups


def test_broadcast_tree_volume_matches_gloo_measurement():
    # measured with /proc/self/io for 4 ranks, root 0: rank 0 sends 2 copies, rank 1 one, others 0
    assert [wire_bytes("broadcast", 10, 4, r, 0) for r in range(4)] == [20, 10, 0, 0]
    assert sum(wire_bytes("broadcast", 10, 7, r, 3) for r in range(7)) == 60


def test_world_of_one_sends_nothing():
    (g,) = local_groups(1)
    t = torch.ones(3)
    assert g.all_reduce(t, "avg") is t
    assert g.stats.bytes_sent == 0
