"""DiLoCo's inner phases (issue 17): a time budget ends a phase at its deadline, options are
checked, and a strategy without a time budget refuses the option instead of ignoring it."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.eager import EagerConfig
from isthmus.strategies.streaming import StreamingConfig


class Clock:
    """A fake monotonic clock: each inner step takes ``step_s`` seconds."""

    def __init__(self, step_s: float) -> None:
        self.now = 100.0
        self.step_s = step_s

    def __call__(self) -> float:
        return self.now


def _train(cfg: DiLoCoConfig, clock: Clock, steps: int) -> DiLoCo:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    d = DiLoCo(None, model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    x = torch.randn(4, 3)
    for _ in range(steps):
        model(x).square().mean().backward()
        clock.now += clock.step_s
        d.step()
        d.optimizer.zero_grad()
    return d


def test_a_phase_ends_at_its_deadline_or_at_h(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(step_s=1.0)
    monkeypatch.setattr("isthmus.strategies.diloco.time.monotonic", clock)
    timed = _train(DiLoCoConfig(sync_every=10, inner_budget="time", phase_seconds=3.5), clock, 12)
    assert timed.phase_steps == [4, 4, 4]  # 4 s of 1 s steps reach the 3.5 s deadline
    slow = Clock(step_s=0.1)
    monkeypatch.setattr("isthmus.strategies.diloco.time.monotonic", slow)
    fast = _train(DiLoCoConfig(sync_every=5, inner_budget="time", phase_seconds=3.5), slow, 10)
    assert fast.phase_steps == [5, 5]  # never more than H
    steps = _train(DiLoCoConfig(sync_every=5), clock, 10)
    assert steps.phase_steps == [5, 5] and steps.metrics()["inner_budget"] == "steps"


def test_budget_options_are_checked() -> None:
    with pytest.raises(ValueError, match="inner_budget must be 'steps' or 'time'"):
        DiLoCoConfig(inner_budget="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="phase_seconds must be >= 0"):
        DiLoCoConfig(phase_seconds=-1.0)
    for cls in (StreamingConfig, EagerConfig):
        with pytest.raises(ValueError, match="has no time budget yet"):
            cls(inner_budget="time")
    model = torch.nn.Linear(2, 1)
    d = DiLoCo(None, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="tokens must be a finite number"):
        d.step(tokens=-1)
