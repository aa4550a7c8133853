"""The phased skeleton on its own: a toy strategy that records what the skeleton asks of it. The
first step with a session is the catch-up round (no inner step), a boundary ends every
``sync_every`` inner steps, a call that was not a whole step advances nothing, a checkpointed
round in flight is re-issued first, and progress survives a local-state round trip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.faults import FaultInjector
from isthmus.comm.state import SharedState
from isthmus.strategies import PhasedStrategy


@dataclass(kw_only=True)
class ToyConfig:
    sync_every: int = 3


class Toy(PhasedStrategy):
    name = "toy"
    Config = ToyConfig

    def setup(self) -> None:
        super().setup()
        self.events: list[tuple[str, int]] = []
        self.half = False  # the next inner_step is only half a step (as gossip's SAM)

    def catch_up(self) -> None:
        self.events.append(("catch_up", self.step_count))

    def inner_step(self, *args: Any, **kwargs: Any) -> bool:
        if self.half:
            self.half = False
            return False
        return super().inner_step()

    def boundary(self) -> None:
        self.events.append(("boundary", self.step_count))
        self.global_step += self.since
        self.since = 0
        self.outer_rounds += 1

    def reissue(self, saved: dict[str, Any]) -> None:
        self.events.append(("reissue", saved["n"]))

    def final_round(self) -> None:
        self.events.append(("final", self.since))


class Registry:
    """What the strategy uses of a session without running rounds."""

    def __init__(self) -> None:
        self.state, self.faults = SharedState(), FaultInjector()

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def add_commit_hook(self, fn: Any) -> None:
        pass


def _toy(session: Any = None) -> Toy:
    w = torch.nn.Parameter(torch.zeros(2))
    model = torch.nn.Module()
    model.w = w
    return Toy(session, model, torch.optim.SGD([w], lr=1.0), ToyConfig())


def _step(st: Toy, n: int = 1) -> None:
    for _ in range(n):
        st.model.w.grad = torch.ones(2)
        st.step()


def test_catch_up_then_a_boundary_every_sync_every_inner_steps() -> None:
    st = _toy(Registry())
    _step(st, 8)  # the catch-up round, then 7 inner steps
    assert st.events == [("catch_up", 0), ("boundary", 3), ("boundary", 6)]
    assert torch.equal(st.model.w.detach(), torch.full((2,), -7.0))  # the catch-up's is dropped
    assert (st.local_steps, st.since, st.step_count, st.outer_rounds) == (7, 1, 7, 2)
    st.half = True
    _step(st)  # half a step: no counter moves, no boundary
    assert (st.local_steps, st.since) == (7, 1) and len(st.events) == 3
    st.finish()
    assert st.events[-1] == ("final", 1)


def test_without_a_session_the_first_step_trains_and_finish_needs_no_join() -> None:
    st = _toy()
    _step(st, 3)
    assert st.events == [("boundary", 3)] and st.local_steps == 3
    unjoined = _toy(Registry())
    unjoined.finish()
    assert unjoined.events == []  # a peer that never joined has nothing to sync


def test_progress_round_trip_skips_the_catch_up_and_reissues_first() -> None:
    st = _toy(Registry())
    _step(st, 5)
    state = st.local_state()
    assert set(state["progress"]) == {"local_steps", "since", "joined", "outer_rounds"}
    fresh = _toy(Registry())
    fresh.load_local_state(state)
    assert (fresh.joined, fresh.since, fresh.outer_rounds, fresh.local_steps) == (True, 1, 1, 4)
    fresh._resume = {"n": 7}  # as a strategy's _load_local_tensors stores a round in flight
    _step(fresh)
    assert fresh.events == [("reissue", 7)] and fresh._resume is None and fresh.since == 2
