"""The link probe over real Gloo groups (comm/probe.py, isthmus.testing.local_groups): every
pair measured from both ends along the pure schedule, bytes counted as ``probe``, a failure
raising like a collective's."""

from __future__ import annotations

import pytest

from isthmus.comm.group import CollectiveError
from isthmus.comm.probe import LinkProber, probe_links
from isthmus.comm.probe_math import RESOLUTION_S, tournament
from isthmus.coordinator.protocol import RoundPlan
from isthmus.testing import local_groups, run_parallel

IDS = [10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def five():
    groups = local_groups(5, timeout_s=20.0)
    yield groups
    for g in groups:
        g.abort("test over")


def test_every_member_measures_every_other_and_the_bytes_count_as_probe(five):
    before = [dict(g.stats.by_op) for g in five]
    caps = [1 << 20, 1 << 20, 64 << 10, 1 << 20, 1 << 20]  # one peer with another probe_bytes

    def probe(g):
        return probe_links(g, IDS, cap=caps[g.rank], pings=2)

    out = run_parallel(five, probe)
    for rank, links in enumerate(out):
        assert sorted(links) == sorted(x for x in IDS if x != IDS[rank])
        for link in links.values():
            # at most the ceiling the probe can tell apart, per its last transfer size
            assert 0 < link.mbit <= caps[rank] * 8 / RESOLUTION_S / 1e6 + 1e-6
            assert link.rtt_ms >= 0
    for g, b in zip(five, before, strict=True):
        new = {k: v - b.get(k, 0) for k, v in g.stats.by_op.items() if v != b.get(k, 0)}
        assert set(new) == {"probe"} and new["probe"] > 4 * (16 << 10)
    # the pure schedule's rounds: odd world, so each member sits exactly one round out
    assert sum(1 for r in tournament(5) for p in r if 0 in p) == 4


def test_a_member_that_fails_mid_probe_makes_the_others_raise_not_hang():
    groups = local_groups(4, timeout_s=20.0)

    def probe(g):
        def between(i: int) -> None:
            if g.rank == 2 and i == 0:
                g.abort("rank 2 died")
                raise CollectiveError("rank 2 died")

        return probe_links(g, IDS[:4], cap=64 << 10, between=between)

    with pytest.raises(CollectiveError):
        run_parallel(groups, probe, timeout_s=60.0)
    assert all(g.aborted for g in groups)


def test_an_error_inside_a_probe_fails_the_round_not_the_run():
    groups = local_groups(4, timeout_s=20.0)
    plan = _plan(1, (10, 11, 12, 13))

    def probe(g):
        prober = LinkProber(enabled=True, cap=64 << 10)
        prober.agree(plan, [1, 0])

        def between(i: int) -> None:
            if g.rank == 1:
                raise ValueError("a bug")

        return prober.run(g, plan, between)

    # a collective's error: the session reports the round failed and retries it
    with pytest.raises(CollectiveError, match="probe failed: ValueError: a bug"):
        run_parallel(groups, probe, timeout_s=60.0)
    assert groups[1].aborted


def _plan(epoch: int, members: tuple[int, ...]) -> RoundPlan:
    return RoundPlan(
        round=0, epoch=epoch, members=members, transfers=(), expected={}, new_epoch=True
    )
