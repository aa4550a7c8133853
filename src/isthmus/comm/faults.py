"""Fault injection as library code, shared by tests, the demo and the lab.

A :class:`FaultInjector` holds a list of :class:`Fault` events. Code that wants to be
fault-injectable calls :meth:`FaultInjector.check` at named points with the current step and
round; the first matching, not-yet-fired fault acts:

* ``kill``: SIGKILL this process (nothing is flushed; the closest thing to a power cut);
* ``stop``: SIGSTOP this process (a silent peer; someone else must SIGCONT it);
* ``fail``: raise :class:`InjectedFailure`, a collective failure (the round aborts and retries);
* ``corrupt``: flip one bit of one shared tensor in place (the parity check must catch it);
* ``slow``: not an event but a state: while it is active, every step of this peer takes
  ``factor`` times as long (:meth:`FaultInjector.pace` sleeps ``factor - 1`` times the time the
  step's own work took). A heterogeneous or throttled machine, for tests, the demo and the lab.

Points used by isthmus: ``step`` (start of a training step), ``collective`` (a round's reduction
was issued and is in flight), ``commit`` (about to report the round's outcome), ``checkpoint``
(a checkpoint part of revision ``round`` is written but not yet reported; fired on the writer's
thread, so a ``kill`` there is a peer dying in the middle of a save), ``probe`` (a link probe
measured its ``step``-th pair, counting from 0, in round ``round``: :mod:`isthmus.comm.probe`).
Spec strings (CLI, scenarios) follow the grammar of :mod:`isthmus.spec`, the ``@`` part carrying
the point: ``ACTION@POINT:step=N`` or ``ACTION@POINT:round=N`` (or both), e.g.
``kill@collective:step=20``; the short form ``kill@20`` means ``kill@step:step=20``.
A slow peer is ``slow:FACTOR`` (the whole run) or ``slow:FACTOR@START-END`` (a bout: steps
``START`` to ``END - 1``), e.g. ``slow:3`` or ``slow:2.5@20-60``.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from isthmus.comm.group import CollectiveError
from isthmus.spec import Registry, SpecError, coerce, parse

__all__ = ["FAULT_ACTIONS", "Fault", "FaultInjector", "FaultWhen", "InjectedFailure"]

ACTIONS = ("kill", "stop", "fail", "corrupt")
Point = Literal["step", "collective", "commit", "checkpoint", "probe"]
POINTS: tuple[str, ...] = get_args(Point)
_USAGE = (
    "fault specs look like ACTION@POINT:step=N, ACTION@POINT:round=N, ACTION@N (step N), "
    "slow:FACTOR or slow:FACTOR@START-END"
)
# slow:FACTOR or slow:FACTOR@START-END (a bout over steps START..END-1)
_SLOW_RE = re.compile(r"^slow:([^@]+?)(?:@(\d+)-(\d+))?$")


class InjectedFailure(CollectiveError):
    """A collective failure raised on purpose by a ``fail`` fault."""


@dataclass(frozen=True, kw_only=True)
class FaultWhen:
    """The options of a fault spec: when it fires (at least one of the two)."""

    step: int | None = None
    """Fire at the first check at or after this step."""
    round: int | None = None
    """Fire at the first check at or after this round."""

    def __post_init__(self) -> None:
        if self.step is None and self.round is None:
            raise ValueError("a fault needs a step or a round at which to fire")
        for name in ("step", "round"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


FAULT_ACTIONS: Registry[None] = Registry("fault action")
"""The actions a fault spec may name; each takes :class:`FaultWhen`'s options."""
for _action in ACTIONS:
    FAULT_ACTIONS.add(_action, config=FaultWhen)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault: ``action`` at ``point``, once ``step`` and/or ``round`` is reached.
    Raises ValueError for an unknown action or point, or for one that could never fire."""

    action: str
    point: str = "step"
    step: int | None = None
    round: int | None = None
    tensor: str | None = None  # for corrupt: which shared tensor (default: the first)
    factor: float = 1.0  # for slow: how many times as long each step takes
    until: int | None = None  # for slow: first step after the bout (None: to the end)

    def __post_init__(self) -> None:
        if self.action == "slow":
            if not (math.isfinite(self.factor) and self.factor >= 1.0):
                raise ValueError(f"a slow fault's factor must be a number >= 1, got {self.factor}")
            if self.until is not None and self.until <= (self.step or 0):
                raise ValueError(
                    f"a slow bout must end after it starts, got steps {self.step}-{self.until}"
                )
            return
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; use one of {ACTIONS}")
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; use one of {POINTS}")
        FaultWhen(step=self.step, round=self.round)  # raises if it could never fire

    @staticmethod
    def parse(spec: str) -> Fault:
        """Parse ``ACTION@POINT:step=N`` / ``ACTION@POINT:round=N`` / ``ACTION@N``.

        Raises :class:`~isthmus.spec.SpecError` (a ValueError) naming the spec, what is wrong
        (an unknown action or point with the closest valid one, a missing step or round, a
        value that is not a count) and the accepted forms."""
        if spec.strip().startswith("slow"):
            return Fault._parse_slow(spec)
        try:
            parts = parse(spec, what="fault spec")
            if len(parts) != 1:
                raise SpecError("one fault per spec; give several specs instead of '+'")
            (part,) = parts
            entry = FAULT_ACTIONS.lookup(part.name)
            if part.at is None:
                raise SpecError(f"{part.name!r} needs @POINT or @STEP")
            if part.at.isdigit():  # the short form: ACTION@N is at step N
                if part.positional or part.named:
                    raise SpecError(f"ACTION@{part.at} takes no arguments")
                return Fault(action=entry.name, point="step", step=int(part.at))
            point = coerce(part.at, Point, key="point")
            when = entry.config(entry.options(part))
            return Fault(action=entry.name, point=point, step=when.step, round=when.round)
        except SpecError as e:
            raise SpecError(
                f"bad fault spec: {e.problem}; {_USAGE}", key=e.key, spec=spec
            ) from None

    @staticmethod
    def _parse_slow(spec: str) -> Fault:
        m = _SLOW_RE.match(spec.strip())
        problem = "write slow:FACTOR or slow:FACTOR@START-END (e.g. slow:3, slow:2@20-60)"
        if m is not None:
            try:
                factor = float(m.group(1))
            except ValueError:
                problem = f"the factor {m.group(1)!r} is not a number"
            else:
                start = int(m.group(2)) if m.group(2) is not None else 0
                until = int(m.group(3)) if m.group(3) is not None else None
                try:
                    return Fault(action="slow", step=start, until=until, factor=factor)
                except ValueError as e:
                    problem = str(e)
        raise SpecError(f"bad fault spec: {problem}; {_USAGE}", spec=spec) from None

    def slows(self, step: int) -> bool:
        """Whether this is a slow fault active at ``step``."""
        if self.action != "slow" or step < (self.step or 0):
            return False
        return self.until is None or step < self.until


@dataclass
class FaultInjector:
    faults: list[Fault] = field(default_factory=list)
    fired: list[Fault] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def check(
        self, point: str, *, step: int | None = None, round: int | None = None, state: Any = None
    ) -> None:
        """Fire every pending fault that matches this point, step and round (slow faults are
        states, never fired: see :meth:`pace`)."""
        for f in list(self.faults):
            if f.point != point or f.action == "slow":
                continue
            if f.step is not None and (step is None or step < f.step):
                continue
            if f.round is not None and (round is None or round < f.round):
                continue
            self.faults.remove(f)
            self.fired.append(f)
            self._fire(f, state)

    def slow_factor(self, step: int) -> float:
        """How many times as long a step takes at ``step`` (the largest active slow fault's
        factor; 1.0 when none is active)."""
        return max((f.factor for f in self.faults if f.slows(step)), default=1.0)

    def pace(self, step: int, seconds: float) -> float:
        """Called after a step's own work, which took ``seconds``: sleep ``(factor - 1) *
        seconds`` when a slow fault is active at ``step``. Returns the seconds slept."""
        extra = (self.slow_factor(step) - 1.0) * max(0.0, seconds)
        if extra > 0:
            time.sleep(extra)
        return extra

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
