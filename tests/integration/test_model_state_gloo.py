"""A catch-up round over real in-process Gloo groups contributes nothing to the buffers' global
copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isthmus.comm.group import Group
from isthmus.strategies import DiLoCo, DiLoCoConfig
from isthmus.testing import local_groups, run_parallel
from support.sessions import Rounds

pytestmark = pytest.mark.usefixtures("one_thread")


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
        rounds = Rounds(g)
        # a peer with its local state resumed at its checkpoint's revision, never at the run's
        # first round (which reduces nothing: nobody can have trained before it)
        rounds.revision = 3
        st = DiLoCo(rounds, m, opt, DiLoCoConfig(sync_every=2))
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
