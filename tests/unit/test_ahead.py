"""Connecting an epoch's group behind round 0 (comm/ahead.py): which rounds are handed out ahead
of their group, the attempt's outcomes (connected, failed, abandoned, past its bound), what the
session does with an attempt of another epoch, and a round's group read lazily."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from isthmus.comm.ahead import ConnectsAhead, GroupAhead, connects_ahead
from isthmus.comm.connect import Graveyard
from isthmus.comm.group import CollectiveError
from isthmus.comm.round import Round
from isthmus.coordinator.protocol import RoundPlan, Transfer


def plan(
    round: int = 0, epoch: int = 1, members: tuple[int, ...] = (3, 5, 7), **kw: Any
) -> RoundPlan:
    return RoundPlan(
        round=round, epoch=epoch, members=members, transfers=kw.pop("transfers", ()),
        expected={}, new_epoch=True, **kw,
    )  # fmt: skip


class FakeGroup:
    def __init__(self, name: str = "epoch1", rank: int = 1, world: int = 3) -> None:
        self.name, self.rank, self.world = name, rank, world
        self.aborts: list[str] = []

    @property
    def aborted(self) -> bool:
        return bool(self.aborts)

    def abort(self, reason: str) -> None:
        self.aborts.append(reason)

    def busy(self) -> bool:
        return False


def blocks_until_cancelled(seen: list[bool]) -> Any:
    def build(cancelled: Any) -> Any:
        deadline = time.monotonic() + 10
        while not cancelled():
            assert time.monotonic() < deadline, "never cancelled"
            time.sleep(0.005)
        seen.append(True)
        raise CollectiveError("connect abandoned")

    return build


def test_only_the_first_round_without_transfers_over_gloo_of_several_members_goes_ahead():
    assert connects_ahead(plan(), backend="gloo")
    assert not connects_ahead(plan(round=1), backend="gloo")  # any later round reduces
    moved = Transfer(src=3, dst=7, names=("w",))
    assert not connects_ahead(plan(transfers=(moved,)), backend="gloo")  # a joiner's repair
    assert not connects_ahead(plan(members=(3,)), backend="gloo")  # a group of one: no wait
    assert not connects_ahead(plan(), backend="nccl")


def test_a_connected_group_is_handed_to_the_waiter():
    g = FakeGroup()
    ahead = GroupAhead(1, lambda cancelled: g, bound_s=5.0, name="t")
    assert ahead.wait() is g
    assert ahead.done() and not ahead.busy()
    assert ahead.connected_s is not None and ahead.connected_s >= 0
    assert g.aborts == []


def test_a_failed_connection_is_raised_as_it_was_at_the_wait():
    err = CollectiveError("could not connect; cannot reach peer 5 at 10.0.0.2:4000 (refused)")
    err.unreached = ((5, "10.0.0.2:4000", "refused"),)  # type: ignore[attr-defined]

    def build(cancelled: Any) -> Any:
        raise err

    ahead = GroupAhead(1, build, bound_s=5.0, name="t")
    with pytest.raises(CollectiveError) as e:
        ahead.wait()
    assert e.value is err and e.value.unreached[0][0] == 5  # type: ignore[attr-defined]


def test_any_other_error_of_the_connection_becomes_a_collective_error():
    def build(cancelled: Any) -> Any:
        raise ValueError("connections differ: 1 here, 2 at rank 0")

    with pytest.raises(CollectiveError, match="epoch 4 failed: connections differ"):
        GroupAhead(4, build, bound_s=5.0, name="t").wait()


def test_an_abort_stops_the_connection_and_the_waiter_gets_the_reason():
    seen: list[bool] = []
    ahead = GroupAhead(1, blocks_until_cancelled(seen), bound_s=30.0, name="t")
    threading.Timer(0.05, ahead.abort, ("round 0 aborted by the coordinator",)).start()
    with pytest.raises(CollectiveError, match="aborted by the coordinator"):
        ahead.wait()
    assert seen == [True]
    ahead._thread.join(5)
    assert not ahead.busy()


def test_the_waiters_abandon_reason_abandons_the_attempt():
    seen: list[bool] = []
    ahead = GroupAhead(1, blocks_until_cancelled(seen), bound_s=30.0, name="t")
    with pytest.raises(CollectiveError, match="epoch 1 was aborted"):
        ahead.wait(lambda: "epoch 1 was aborted")
    ahead._thread.join(5)
    assert seen == [True]


def test_the_wait_ends_at_the_attempts_bound():
    seen: list[bool] = []
    ahead = GroupAhead(2, blocks_until_cancelled(seen), bound_s=0.1, name="t")
    with pytest.raises(CollectiveError, match="group of epoch 2 was not connected within"):
        ahead.wait()
    ahead._thread.join(5)
    assert seen == [True]


def test_a_group_connected_after_the_attempt_was_abandoned_is_aborted():
    g = FakeGroup()
    go = threading.Event()

    def build(cancelled: Any) -> Any:
        go.wait(5)
        return g  # this connection ignores cancelled(): it finished anyway

    ahead = GroupAhead(1, build, bound_s=30.0, name="t")
    ahead.abort("superseded by a new epoch")
    go.set()
    with pytest.raises(CollectiveError, match="superseded"):
        ahead.wait()
    assert g.aborts == ["superseded by a new epoch"]
    ahead.abort("again")  # a connected group is aborted by a later abort too; the reason stays
    assert g.aborts[-1] == "again"
    with pytest.raises(CollectiveError, match="superseded"):
        ahead.wait()


class Owner(ConnectsAhead):
    """The session's side of ConnectsAhead: connects with a given build, keeps the group set."""

    def __init__(self, build: Any) -> None:
        self.config = type("C", (), {"collective_timeout": 5.0, "probe_timeout": 1.0})()
        self.name = "p"
        self._ahead: GroupAhead | None = None
        self._graveyard = Graveyard()
        self._aborted_epochs: set[int] = set()
        self._build = build
        self.connects: list[int] = []
        self.group: Any = None

    def _connect(self, plan: RoundPlan, cancelled: Any = lambda: False) -> Any:
        self.connects.append(plan.epoch)
        return self._build(plan, cancelled)

    def _set_group(self, g: Any) -> None:
        self.group = g

    def _group_for(self, plan: RoundPlan) -> Any:
        g = self._take_ahead(plan) or self._connect(plan)
        self._set_group(g)
        return g


def test_the_next_round_of_the_epoch_takes_the_group_and_another_epoch_drops_it():
    made: list[FakeGroup] = []

    def build(p: RoundPlan, cancelled: Any) -> FakeGroup:
        made.append(FakeGroup(f"epoch{p.epoch}"))
        return made[-1]

    owner = Owner(build)
    owner._connect_ahead(plan(epoch=1))
    owner._connect_ahead(plan(epoch=1))  # the same epoch again: one attempt
    assert owner._group_for(plan(round=1, epoch=1)) is made[0]
    assert owner.connects == [1] and owner._ahead is None
    owner._connect_ahead(plan(epoch=2))  # round 0 again, in a new epoch
    owner._ahead._thread.join(5)  # type: ignore[union-attr]
    g3 = owner._group_for(plan(round=0, epoch=3))  # a third epoch: the second's is aborted
    assert g3.name == "epoch3" and made[1].aborts == ["superseded by a new epoch"]
    assert owner.connects == [1, 2, 3]


def test_a_failed_attempt_fails_the_next_round_and_the_retry_connects_anew():
    calls: list[int] = []

    def build(p: RoundPlan, cancelled: Any) -> FakeGroup:
        calls.append(p.epoch)
        if len(calls) == 1:
            raise CollectiveError("cannot reach peer 5")
        return FakeGroup(f"epoch{p.epoch}")

    owner = Owner(build)
    owner._connect_ahead(plan(epoch=1))
    with pytest.raises(CollectiveError, match="cannot reach peer 5"):
        owner._group_for(plan(round=1, epoch=1))
    assert owner._group_for(plan(round=1, epoch=2)).name == "epoch2"


def test_an_aborted_epoch_ends_the_wait_for_its_group():
    seen: list[bool] = []
    owner = Owner(lambda p, cancelled: blocks_until_cancelled(seen)(cancelled))
    owner._connect_ahead(plan(epoch=1))
    owner._aborted_epochs.add(1)
    with pytest.raises(CollectiveError, match="epoch 1 was aborted"):
        owner._take_ahead(plan(round=1, epoch=1))
    assert owner._graveyard.drain(5.0) == 0 and seen == [True]


class Session:
    peer_id = 5

    def __init__(self, result: Any) -> None:
        self.result, self.taken = result, 0

    def _group_for(self, plan: RoundPlan) -> Any:
        self.taken += 1
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def test_a_round_handed_out_ahead_reads_rank_and_world_from_the_plan_and_its_group_once():
    g = FakeGroup(rank=1, world=3)
    s = Session(g)
    rnd = Round(s, plan(), None, 0.0)  # type: ignore[arg-type]
    assert (rnd.rank, rnd.world, s.taken) == (1, 3, 0)  # members (3, 5, 7): peer 5 is rank 1
    assert rnd.group is g and rnd.group is g and s.taken == 1
    assert not rnd.setup_failed


def test_a_round_whose_group_cannot_be_had_is_a_failed_setup():
    s = Session(CollectiveError("cannot reach peer 7"))
    rnd = Round(s, plan(), None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(CollectiveError, match="peer 7"):
        rnd.group  # noqa: B018
    assert rnd.setup_failed
