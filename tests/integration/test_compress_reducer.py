"""The Reducer's compressed mode with real in-process groups and stand-in rounds: aborted
attempts leave compressor state as it was, a new epoch restarts shared state so a joiner agrees
with the members, several reductions in one round keep each other's state, rejected sums stage
nothing, and a non-finite update is never sent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from isthmus.comm.group import CollectiveError, Group
from isthmus.reduce.reducer import Reducer
from isthmus.testing import local_groups, run_parallel
from support.sessions import FakeRound

SHAPES = {"w": (24, 16), "b": (16,), "v": (40,)}

# every stateful family: local error feedback, shared aggregates, shared Q, round counters
STATEFUL = [
    "topk:0.1+ef",
    "topk:0.1+ef21",
    "randk:0.2+econtrol",
    "powersgd:rank=2",
    "sign",
    "sketch:0.2,rows=3,width=0.5",
]


class FailingGroup:
    """A group whose ``fail_at``-th collective raises, as when a peer dies inside it. Every rank
    wraps its group the same way, so all ranks fail at the same point and none is left waiting."""

    def __init__(self, group: Group, fail_at: int) -> None:
        self._g = group
        self._fail_at = fail_at
        self._n = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._g, name)

    def _count(self) -> None:
        self._n += 1
        if self._n >= self._fail_at:
            raise CollectiveError("injected: a peer died inside the collective")

    def all_reduce(self, *a: Any, **k: Any) -> Any:
        self._count()
        return self._g.all_reduce(*a, **k)

    def all_gather_flat(self, *a: Any, **k: Any) -> Any:
        self._count()
        return self._g.all_gather_flat(*a, **k)

    def all_to_all(self, *a: Any, **k: Any) -> Any:
        self._count()
        return self._g.all_to_all(*a, **k)


def _items(rank: int, rnd: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return [(k, torch.randn(s, generator=g)) for k, s in SHAPES.items()]


def _state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):  # numpy RandomState state
        return repr(a) == repr(b)
    return a == b


def _same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


@pytest.fixture(scope="module")
def epochs():
    """Two epochs of three peers: independent process groups, as after a membership change."""
    return local_groups(3), local_groups(3)


@pytest.mark.parametrize("spec", STATEFUL)
def test_aborted_attempts_leave_state_as_before_the_round(spec, epochs):
    g1s, g2s = epochs

    def body(g1: Group) -> dict[str, Any]:
        g2 = g2s[g1.rank]
        # reference: round 1 in epoch 1, round 2 in epoch 2 (the retry's epoch), round 3
        ref = Reducer(compression=spec)
        calls = g1.stats.calls
        r1 = ref.mean(FakeRound(g1, 1, 1), _items(g1.rank, 1), contribute=True)
        calls = g1.stats.calls - calls
        ref.commit()
        r2 = ref.mean(FakeRound(g2, 2, 2), _items(g1.rank, 2), contribute=True)
        ref.commit()
        r3 = ref.mean(FakeRound(g2, 2, 3), _items(g1.rank, 3), contribute=True)
        ref.commit()

        red = Reducer(compression=spec)
        a1 = red.mean(FakeRound(g1, 1, 1), _items(g1.rank, 1), contribute=True)
        red.commit()
        after1 = red.compressor.state_dict()
        # attempt 1 of round 2: a peer dies inside the compressor's last collective
        with pytest.raises(CollectiveError):
            red.mean(FakeRound(FailingGroup(g1, calls), 1, 2), _items(g1.rank, 2), contribute=True)
        failed_kept = _state_equal(red.compressor.state_dict(), after1)
        # attempt 2: the reduction completes but the round aborts at commit (no commit())
        red.mean(FakeRound(g1, 1, 2), _items(g1.rank, 2), contribute=True)
        aborted_kept = _state_equal(red.compressor.state_dict(), after1)
        # attempt 3, in the survivors' new epoch: commits
        a2 = red.mean(FakeRound(g2, 2, 2), _items(g1.rank, 2), contribute=True)
        red.commit()
        a3 = red.mean(FakeRound(g2, 2, 3), _items(g1.rank, 3), contribute=True)
        red.commit()
        assert r1 and r2 and r3 and a1 and a2 and a3
        return {
            "calls": calls,
            "failed_kept": failed_kept,
            "aborted_kept": aborted_kept,
            "same": [_same(x.tensors, y.tensors) for x, y in ((r1, a1), (r2, a2), (r3, a3))],
            "state": _state_equal(red.compressor.state_dict(), ref.compressor.state_dict()),
            "r3": r3.tensors,
        }

    out = run_parallel(g1s, body)
    for r, o in enumerate(out):
        assert o["calls"] >= 2, o["calls"]  # the exact all-reduce and the compressor's
        assert o["failed_kept"] and o["aborted_kept"], (spec, r)
        assert o["same"] == [True, True, True], (spec, r, o["same"])
        assert o["state"], (spec, r)
        assert _same(o["r3"], out[0]["r3"])  # identical bits on every peer


def test_same_epoch_retry_repeats_the_attempt_exactly(epochs):
    g1s, _ = epochs

    def body(g: Group) -> bool:
        red = Reducer(compression="topk:0.1+ef21")
        red.mean(FakeRound(g, 1, 1), _items(g.rank, 1), contribute=True)
        red.commit()
        first = red.mean(FakeRound(g, 1, 2), _items(g.rank, 2), contribute=True)
        again = red.mean(FakeRound(g, 1, 2), _items(g.rank, 2), contribute=True)
        assert first and again
        return _same(first.tensors, again.tensors)

    assert run_parallel(g1s, body) == [True] * 3


def test_several_reductions_in_one_round_keep_each_others_state(epochs):
    # e.g. a strategy reducing fragments of the model separately within one round
    g1s, _ = epochs

    def body(g: Group) -> set[str]:
        red = Reducer(compression="topk:0.1+ef")
        rnd = FakeRound(g, 1, 1)
        items = _items(g.rank, 1)
        red.mean(rnd, items[:1], contribute=True)
        red.mean(rnd, items[1:], contribute=True)
        red.commit()
        return set(red.compressor.state_dict()["local"])

    assert run_parallel(g1s, body) == [set(SHAPES)] * 3


def test_a_joiner_agrees_with_members_after_the_epoch_changes(epochs):
    # Members 0 and 1 build up compressor state in an epoch of two; peer 2 joins with a fresh
    # reducer. Without the per-epoch restart of shared state (sketch error, PowerSGD's Q, the
    # EF21 aggregate, random-k's counter) the joiner would compute different bits.
    _, g2s = epochs
    pair = local_groups(2)

    def body(g2: Group) -> list[list[list[torch.Tensor]]]:
        results = []
        for spec in STATEFUL:
            red = Reducer(compression=spec)
            if g2.rank < 2:
                for n in range(3):
                    red.mean(FakeRound(pair[g2.rank], 1, n), _items(g2.rank, n), contribute=True)
                    red.commit()
            outs = []
            for n in range(3, 5):
                # the joiner's first round is its resync round: it contributes nothing
                joining = g2.rank == 2 and n == 3
                res = red.mean(FakeRound(g2, 2, n), _items(g2.rank, n), contribute=not joining)
                red.commit()
                assert res is not None
                outs.append(res.tensors)
            results.append(outs)
        return results

    out = run_parallel(g2s, body)
    for s, spec in enumerate(STATEFUL):
        for n in range(2):
            for r in (1, 2):
                assert _same(out[r][s][n], out[0][s][n]), (spec, n, r)


def test_rejected_sum_stages_nothing(epochs):
    g1s, _ = epochs

    def body(g: Group) -> tuple[bool, bool, int]:
        red = Reducer(compression="topk:0.5+ef")
        red.mean(FakeRound(g, 1, 1), _items(g.rank, 1), contribute=True)
        red.commit()
        before = red.compressor.state_dict()
        # finite on every peer, but the sum overflows fp32: every peer rejects it alike
        huge = [(k, torch.full(s, 3e38)) for k, s in SHAPES.items()]
        res = red.mean(FakeRound(g, 1, 2), huge, contribute=True)
        red.commit()
        return res is None, _state_equal(red.compressor.state_dict(), before), red.rejected_sums

    assert run_parallel(g1s, body) == [(True, True, 1)] * 3


def test_non_finite_update_is_not_sent(epochs):
    g1s, _ = epochs

    def body(g: Group) -> tuple[list[torch.Tensor], int, int]:
        red = Reducer(compression="int8")
        items = _items(g.rank, 1)
        if g.rank == 1:
            items[0][1][3, 2] = float("nan")
        res = red.mean(FakeRound(g, 1, 1), items, contribute=True)
        assert res is not None
        return res.tensors, res.contributors, red.nonfinite_skips

    out = run_parallel(g1s, body)
    assert [o[1] for o in out] == [2, 2, 2]  # the peer with NaN contributed nothing
    assert [o[2] for o in out] == [0, 1, 0]
    for o in out:
        assert _same(o[0], out[0][0]) and all(bool(torch.isfinite(t).all()) for t in o[0])


class HookSession:
    """The commit hooks of a session, fired by hand as a committed round fires them."""

    def __init__(self) -> None:
        self.hooks: list[Any] = []

    def add_commit_hook(self, fn: Any) -> None:
        self.hooks.append(fn)

    def committed(self) -> None:
        for hook in self.hooks:
            hook(None)


def test_an_attached_reducer_keeps_a_rounds_state_when_the_session_commits(epochs):
    """No strategy commits the reducer: the session's commit hook does, for the rounds in which
    it reduced; a committed round without a reduction leaves its state as it is."""
    g1s, _ = epochs

    def body(g: Group) -> list[bool]:
        ref = Reducer(compression="topk:0.1+ef")
        ref.mean(FakeRound(g, 1, 1), _items(g.rank, 1), contribute=True)
        ref.commit()
        session, red = HookSession(), Reducer(compression="topk:0.1+ef")
        red.attach(session)
        fresh = red.compressor.state_dict()
        red.mean(FakeRound(g, 1, 1), _items(g.rank, 1), contribute=True)
        staged_only = _state_equal(red.compressor.state_dict(), fresh)
        session.committed()
        kept = _state_equal(red.compressor.state_dict(), ref.compressor.state_dict())
        session.committed()  # a round that reduced nothing through this reducer
        unchanged = _state_equal(red.compressor.state_dict(), ref.compressor.state_dict())
        return [staged_only, kept, not red._served, unchanged]

    assert run_parallel(g1s, body) == [[True, True, True, True]] * 3
