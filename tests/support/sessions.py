"""Stand-ins for the parts of :class:`~isthmus.comm.session.Session` and its ``Round`` that
strategies and the reducer use, over in-process groups and without a coordinator: every round
commits, and no fault is ever injected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import Group
from isthmus.comm.state import SharedState
from isthmus.coordinator.protocol import RoundPlan


@dataclass
class FakeRound:
    """What the reducer reads from a round."""

    group: Any
    epoch: int = 1
    number: int = 1
    resynced: bool = False

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def rank(self) -> int:
        return self.group.rank


class Registry:
    """What setup() uses of a Session: registration only (no rounds are run)."""

    def __init__(self) -> None:
        self.state = SharedState()
        self.hooks: list[Callable[[Any], None]] = []

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None:
        self.hooks.append(fn)


class CommittedRound:
    """A round of epoch 0 whose members are every rank of ``group`` and whose plan transfers
    nothing; ``resynced`` says whether this peer was repaired in it."""

    def __init__(self, group: Group, number: int, *, resynced: bool = False) -> None:
        self.group, self.number, self.epoch, self.resynced = group, number, 0, resynced
        self.rank, self.world = group.rank, group.world
        self.plan = RoundPlan(
            round=number,
            epoch=0,
            members=tuple(range(group.world)),
            transfers=(),
            expected={},
            new_epoch=False,
        )

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        pass


class Rounds(Registry):
    """A session whose rounds always commit, over an in-process group (no coordinator): each
    round runs the strategy's function, then the commit hooks with the round's plan.
    ``resynced`` names the rounds in which this peer was repaired."""

    def __init__(self, group: Group, resynced: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.group, self.revision, self.resynced_in = group, 0, resynced
        self.faults, self.stats = FaultInjector(), group.stats

    def run_round(self, fn: Callable[[Any], Any]) -> Any:
        rnd = CommittedRound(self.group, self.revision, resynced=self.revision in self.resynced_in)
        out = fn(rnd)
        self.revision += 1
        for hook in self.hooks:
            hook(rnd.plan)
        return out
