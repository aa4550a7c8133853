"""A catch-up round over real in-process Gloo groups contributes nothing to the buffers' global
copy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import Group
from isthmus.comm.state import SharedState
from isthmus.strategies import DiLoCo, DiLoCoConfig
from isthmus.testing import local_groups, run_parallel


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Registry:
    """What setup() uses of a Session: registration only (no rounds are run)."""

    def __init__(self) -> None:
        self.state = SharedState()
        self.hooks: list[Any] = []

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def add_commit_hook(self, fn: Any) -> None:
        self.hooks.append(fn)


class _Plan:
    def __init__(self, world: int) -> None:
        self.members, self.resynced = tuple(range(world)), ()


class _Round:
    def __init__(self, group: Group, number: int) -> None:
        self.group, self.number, self.epoch, self.resynced = group, number, 0, False
        self.rank, self.world, self.plan = group.rank, group.world, _Plan(group.world)

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        pass


class Rounds(Registry):
    """A session whose rounds always commit, over an in-process group (no coordinator)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group, self.revision, self.faults = group, 0, FaultInjector()

    def run_round(self, fn: Any) -> Any:
        rnd = _Round(self.group, self.revision)
        out = fn(rnd)
        self.revision += 1
        for hook in self.hooks:
            hook(rnd.plan)
        return out


def test_a_catch_up_round_contributes_nothing():
    """A peer's first step (the catch-up) carries no work, whatever its parameters hold: here a
    slot resumed without its local state (its own initialization, not theta) meets a peer that
    trained two steps. The round's mean is that peer's outer gradient alone."""

    def model() -> nn.Linear:
        torch.manual_seed(0)
        return nn.Linear(4, 2)

    def steps(st: DiLoCo, m: nn.Linear, n: int) -> None:
        for _ in range(n):
            m(torch.ones(3, 4)).sum().backward()
            st.step()
            st.optimizer.zero_grad()

    models = [model(), model()]  # built here: threads would share the global RNG
    with torch.no_grad():
        models[1].weight.add_(5.0)

    def peer(g: Group) -> list[torch.Tensor]:
        m = models[g.rank]
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        st = DiLoCo(Rounds(g), m, opt, DiLoCoConfig(sync_every=2))
        if g.rank == 0:
            st.joined = True  # in step with the run (as after loading its local state)
        steps(st, m, 2 if g.rank == 0 else 1)
        return st.global_params

    theta, _ = run_parallel(local_groups(2), peer)
    m = model()
    alone = DiLoCo(None, m, torch.optim.SGD(m.parameters(), lr=0.1), DiLoCoConfig(sync_every=2))
    steps(alone, m, 2)
    for got, want in zip(theta, alone.global_params, strict=True):
        assert torch.equal(got, want)
