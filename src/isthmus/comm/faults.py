"""Fault injection as library code, shared by tests, the demo and the lab.

A :class:`FaultInjector` holds a list of :class:`Fault` events. Code that wants to be
fault-injectable calls :meth:`FaultInjector.check` at named points with the current step and
round; the first matching, not-yet-fired fault acts:

* ``kill``: SIGKILL this process (nothing is flushed; the closest thing to a power cut);
* ``stop``: SIGSTOP this process (a silent peer; someone else must SIGCONT it);
* ``fail``: raise :class:`InjectedFailure`, a collective failure (the round aborts and retries);
* ``corrupt``: flip one bit of one shared tensor in place (the parity check must catch it).

Points used by isthmus: ``step`` (start of a training step), ``collective`` (a round's reduction
was issued and is in flight), ``commit`` (about to report the round's outcome).
Spec strings (CLI, scenarios): ``ACTION@POINT:step=N`` or ``ACTION@POINT:round=N``, e.g.
``kill@collective:step=20``; the short form ``kill@20`` means ``kill@step:step=20``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any

import torch

from isthmus.comm.group import CollectiveError

__all__ = ["Fault", "FaultInjector", "InjectedFailure"]

ACTIONS = ("kill", "stop", "fail", "corrupt")
POINTS = ("step", "collective", "commit")


class InjectedFailure(CollectiveError):
    """A collective failure raised on purpose by a ``fail`` fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    action: str
    point: str = "step"
    step: int | None = None
    round: int | None = None
    tensor: str | None = None  # for corrupt: which shared tensor (default: the first)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; use one of {ACTIONS}")
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; use one of {POINTS}")
        if self.step is None and self.round is None:
            raise ValueError("a fault needs a step or a round at which to fire")

    @staticmethod
    def parse(spec: str) -> Fault:
        """Parse ``ACTION@POINT:step=N`` / ``ACTION@POINT:round=N`` / ``ACTION@N``."""
        try:
            action, _, rest = spec.partition("@")
            if rest.isdigit():
                return Fault(action=action, point="step", step=int(rest))
            point, _, cond = rest.partition(":")
            key, _, val = cond.partition("=")
            if key not in ("step", "round") or not val.isdigit():
                raise ValueError
            return Fault(action=action, point=point, **{key: int(val)})
        except ValueError as e:
            raise ValueError(
                f"bad fault spec {spec!r}: use ACTION@POINT:step=N or ACTION@POINT:round=N "
                f"(actions {ACTIONS}, points {POINTS}), or ACTION@N for a step ({e})"
            ) from None


@dataclass
class FaultInjector:
    faults: list[Fault] = field(default_factory=list)
    fired: list[Fault] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def check(
        self, point: str, *, step: int | None = None, round: int | None = None, state: Any = None
    ) -> None:
        """Fire every pending fault that matches this point, step and round."""
        for f in list(self.faults):
            if f.point != point:
                continue
            if f.step is not None and (step is None or step < f.step):
                continue
            if f.round is not None and (round is None or round < f.round):
                continue
            self.faults.remove(f)
            self.fired.append(f)
            self._fire(f, state)

    @staticmethod
    def _fire(f: Fault, state: Any) -> None:
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.action == "fail":
            raise InjectedFailure(f"injected failure at {f.point} (step {f.step}, round {f.round})")
        elif f.action == "corrupt":
            if state is None or len(state) == 0:
                raise RuntimeError("a corrupt fault needs shared state to corrupt")
            name = f.tensor or next(iter(state))
            t = state[name]
            # Flip the lowest bit of the first byte: the smallest possible divergence.
            t.detach().reshape(-1).view(torch.uint8)[0] ^= 1
