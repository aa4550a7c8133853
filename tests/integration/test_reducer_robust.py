"""The reducer's robust mode and its byzantine hook over real in-process Gloo groups: attacked
rounds equal the reference aggregate on every peer, the attacker learns only committed aggregates,
centered clipping starts from the last committed aggregate of the epoch, and rounds whose rule
cannot run (or whose plain sum is not finite) are skipped by every peer alike."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from isthmus.comm.group import CollectiveError, Group
from isthmus.reduce.aggregate import make_aggregator
from isthmus.reduce.aggregate.attacks import PeerAttack
from isthmus.reduce.reducer import Reducer
from isthmus.testing import local_groups, run_parallel
from support.sessions import FakeRound

D = 23


@pytest.fixture(scope="module")
def groups() -> list[Group]:
    return local_groups(4)


def honest(rnd: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return torch.randn(D, generator=g) + 1.0


def reduce_round(groups, reducers, rnd, epoch=1, contribute=None, commit=True):
    """One round on every rank: item 'w' (shape 23) plus the exact count; returns the results."""

    def run(g: Group):
        items = [("w", honest(rnd, g.rank))]
        ok = True if contribute is None else contribute[g.rank]
        out = reducers[g.rank].mean(
            FakeRound(g, number=rnd, epoch=epoch), items, contribute=ok, exact=torch.tensor([1.0])
        )
        if commit:
            reducers[g.rank].commit()
        return out

    return run_parallel(groups, run)


def same_everywhere(results) -> torch.Tensor:
    first = results[0].tensors[0]
    for r in results[1:]:
        assert torch.equal(r.tensors[0], first)
    return first


def test_attacked_round_equals_the_reference_and_the_attacker_learns_the_aggregate(groups):
    reducers = [Reducer(aggregator="median", byzantine_f=1) for _ in range(4)]
    attacker = PeerAttack("sign_flip:scale=5")
    reducers[3].attack = attacker
    for rnd in range(2):
        results = reduce_round(groups, reducers, rnd)
        got = same_everywhere(results)
        vs = [honest(rnd, r) for r in range(3)] + [-5 * honest(rnd, 3)]
        ref = make_aggregator("median").aggregate(vs, 1).vector
        assert torch.allclose(got, ref)
        # the attacker knows exactly what was committed, and its own honest update
        assert torch.equal(attacker.last_aggregate, got)
        assert attacker.observed == rnd + 1
        assert results[0].contributors == 4


def test_centered_clipping_starts_from_the_last_aggregate_of_the_same_epoch(groups):
    spec = "cc:tau=0.5,iterations=2"
    reducers = [Reducer(aggregator=spec, byzantine_f=1) for _ in range(4)]
    agg = make_aggregator(spec)
    first = same_everywhere(reduce_round(groups, reducers, 0, epoch=1))
    vs0 = [honest(0, r) for r in range(4)]
    assert torch.allclose(first, agg.aggregate(vs0, 1).vector)
    second = same_everywhere(reduce_round(groups, reducers, 1, epoch=1))
    vs1 = [honest(1, r) for r in range(4)]
    assert torch.allclose(second, agg.aggregate(vs1, 1, start=first).vector)
    assert not torch.allclose(second, agg.aggregate(vs1, 1).vector)
    # a new epoch (membership changed: a joiner has no previous aggregate) starts from zero
    third = same_everywhere(reduce_round(groups, reducers, 2, epoch=2))
    vs2 = [honest(2, r) for r in range(4)]
    assert torch.allclose(third, agg.aggregate(vs2, 1).vector)


def test_an_uncommitted_attempt_is_not_used_as_the_next_start(groups):
    spec = "cc:tau=0.5,iterations=2"
    reducers = [Reducer(aggregator=spec, byzantine_f=1) for _ in range(4)]
    reduce_round(groups, reducers, 0, epoch=1, commit=False)  # aborted attempt
    again = same_everywhere(reduce_round(groups, reducers, 1, epoch=1))
    vs1 = [honest(1, r) for r in range(4)]
    assert torch.allclose(again, make_aggregator(spec).aggregate(vs1, 1).vector)


def test_a_rule_that_cannot_run_skips_the_update_on_every_peer(groups, caplog):
    # krum needs n >= 2f + 3 = 5 vectors; 4 peers: every peer gets None, nobody crashes
    reducers = [Reducer(aggregator="krum", byzantine_f=1) for _ in range(4)]
    results = reduce_round(groups, reducers, 0)
    assert results == [None] * 4
    assert all(r.rejected_sums == 1 for r in reducers)
    assert "robust aggregation failed" in caplog.text
    # nobody contributing: None without running the rule (an all-NaN input would be an error)
    reducers = [Reducer(aggregator="median", byzantine_f=1) for _ in range(4)]
    assert reduce_round(groups, reducers, 0, contribute=[False] * 4) == [None] * 4
    assert all(r.rejected_sums == 0 for r in reducers)


def test_plain_reduction_is_finished_on_the_worker_before_anyone_waits(groups):
    # The result's post-processing (here: rejecting a non-finite sum) must not wait for the
    # training thread's wait(): an overlapped strategy waits late and should find it done.
    plain = [Reducer() for _ in range(4)]
    plain[1].attack = PeerAttack("nan")

    def run(g: Group) -> tuple[int, object]:
        r = plain[g.rank]
        pending = r.start(
            FakeRound(g, number=5, epoch=1), [("w", honest(5, g.rank))], contribute=True
        )
        for _ in range(3000):  # up to 30 s; never calls wait() before the check below
            if pending.done():
                break
            time.sleep(0.01)
        rejected_before_wait = r.rejected_sums
        result = pending.wait()
        with pytest.raises(RuntimeError, match="already waited"):
            pending.wait()
        return rejected_before_wait, result

    assert run_parallel(groups, run) == [(1, None)] * 4


def test_a_failed_reduction_leaves_no_reference_cycle_behind():
    # The error raised by wait() must not stay reachable from the pending reduction: that closes
    # a cycle through the failed round's process group, which the cyclic collector may then free
    # on one of Gloo's threads, aborting the process (seen as SIGABRT in the kill tests).
    g0, g1 = local_groups(2, timeout_s=20)
    pending = Reducer().start(
        FakeRound(g0, number=0, epoch=1), [("w", torch.ones(5))], contribute=True
    )
    future = weakref.ref(pending._future)
    g0.abort("test: the round failed elsewhere")
    gc.disable()
    try:
        with pytest.raises(CollectiveError, match="test: the round failed elsewhere"):
            pending.wait()
        assert pending.done()
        del pending
        assert future() is None  # freed by reference counting alone
    finally:
        gc.enable()
        # let rank 0's all-reduce (abandoned, still inside Gloo) complete
        g1.all_reduce(torch.zeros(6), async_op=True).wait()


def test_nan_attack_plain_mean_rejects_and_robust_rule_excludes(groups):
    plain = [Reducer() for _ in range(4)]
    plain[1].attack = PeerAttack("nan")
    assert reduce_round(groups, plain, 0) == [None] * 4  # every peer rejects the same sum
    assert all(r.rejected_sums == 1 for r in plain)
    robust = [Reducer(aggregator="trimmed_mean", byzantine_f=1) for _ in range(4)]
    robust[1].attack = PeerAttack("inf")
    got = same_everywhere(reduce_round(groups, robust, 0))
    assert bool(torch.isfinite(got).all())
    assert robust[0].last_report.excluded == {1: "contains Inf"}
    # the NaN vector was one of the f faulty ones: the rule runs with f = 0 on the other three
    ref = make_aggregator("trimmed_mean").aggregate([honest(0, r) for r in (0, 2, 3)], 0).vector
    assert torch.allclose(got, ref)
