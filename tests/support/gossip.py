"""A stand-in for the session under the gossip strategy: rounds over whatever group and members
a layout gives, a joiner's state transfer played at a chosen round, and commit hooks called
after every round (all rounds commit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import CommStats, Group
from isthmus.comm.state import SharedState

Layout = Callable[[int], tuple[Group, tuple[int, ...]]]


@dataclass
class _Plan:
    members: tuple[int, ...]


class _Round:
    def __init__(
        self, session: FakeSession, group: Group, members: tuple[int, ...], resynced: bool
    ):
        self.group, self.plan, self.resynced = group, _Plan(members), resynced
        self.number, self.epoch = session.revision, 0
        self.rank, self.world = group.rank, group.world

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        pass


class FakeSession:
    """What the strategy uses of a Session. ``layout(round)`` gives this peer's group and the
    round's members (peer ids in rank order); ``resync`` = (round, {name: tensor}) plays the
    coordinator's state transfer to a joiner at the start of that round."""

    def __init__(
        self,
        peer_id: int,
        layout: Layout,
        *,
        revision: int = 0,
        resync: tuple[int, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.peer_id, self.layout, self.revision, self.resync = peer_id, layout, revision, resync
        self.state, self.faults, self.stats = SharedState(), FaultInjector(), CommStats()
        self.rounds: list[tuple[int, int]] = []
        self.hooks: list[Callable[[Any], None]] = []

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None:
        self.hooks.append(fn)

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def run_round(self, fn: Callable[[Any], Any]) -> Any:
        group, members = self.layout(self.revision)
        resynced = False
        if self.resync is not None and self.resync[0] == self.revision:
            for name, value in self.resync[1].items():
                self.state[name].copy_(value)
            resynced = True
        rnd = _Round(self, group, members, resynced)
        out = fn(rnd)
        self.rounds.append((self.revision, group.world))
        for hook in self.hooks:
            hook(rnd.plan)
        self.revision += 1
        return out
