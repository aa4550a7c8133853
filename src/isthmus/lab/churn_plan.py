"""Churn as a pure schedule: what happens to which peer slot, when, and whether it still applies.

A *slot* is one peer position (its namespace in the lab); the processes that run there one after
another are its incarnations (``peer1``, then ``peer1.1`` after a restart). :class:`ChurnPlan`
holds the planned events (a scenario's ``[[churn]]``, a ``[random_churn]`` schedule, the demo's
``--kill``/``--join``) and answers three questions, without clocks or processes of its own, so it
is tested in one process with made-up observations:

* :meth:`ChurnPlan.faults_for`: a kill or stop on the *step* clock is fired by the peer on itself,
  at exactly that step (an injected fault, :mod:`isthmus.comm.faults`): which fault specs does the
  incarnation that starts at a given step carry? A plan made with ``self_fired=False`` (a user's
  script, which has no injector of the launcher's making) hands out none: such a kill or stop is
  due like any other event once the run reaches its step.
* :meth:`ChurnPlan.due`: which events are due at this run step and this many seconds after the
  first round formed?
* :meth:`ChurnPlan.decide`: given the slot's state now, apply a due event, keep it waiting (a join
  whose slot's kill fault has not fired yet), or skip it with the reason (kill a peer that already
  exited).

The executor (:mod:`isthmus.run.churn_hook`) observes processes and applies what this module decides.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ChurnPlan",
    "Decision",
    "Planned",
    "SlotState",
    "check_sequences",
    "random_schedule",
    "starting_slots",
]

SlotState = Literal["absent", "running", "stopped", "exited"]
"""A slot's state: never started, running, frozen (SIGSTOP), or its last process exited."""


@dataclass(kw_only=True)
class Planned:
    """One planned event. ``clock`` is ``step`` (the run's step counter) or ``seconds`` (since
    the first round formed); ``source`` says who planned it (scenario, random, cli)."""

    action: Literal["kill", "join", "stop", "cont"]
    slot: int
    clock: Literal["step", "seconds"]
    when: float
    source: str = "scenario"

    @property
    def by_fault(self) -> bool:
        """Fired by the peer itself, at exactly its step (a kill or stop on the step clock)."""
        return self.clock == "step" and self.action in ("kill", "stop")

    @property
    def how(self) -> str:
        return f"at {self.clock} {self.when:g}"


@dataclass(frozen=True)
class Decision:
    """``apply`` the event now, ``wait`` (ask again later) or ``skip`` it (``reason`` says why).
    For an applied join, ``from_step`` is the run step its new incarnation starts at."""

    kind: Literal["apply", "wait", "skip"]
    reason: str = ""
    from_step: float = 0.0


def starting_slots(slots: int, events: Iterable[Planned]) -> list[int]:
    """The slots running at the start: all but those whose first event is a join."""
    first: dict[int, Planned] = {}
    for ev in sorted(events, key=lambda e: (e.clock != "step", e.when)):
        first.setdefault(ev.slot, ev)
    return [i for i in range(slots) if not (i in first and first[i].action == "join")]


@dataclass
class ChurnPlan:
    """The pending events of a run and the faults handed to running incarnations."""

    pending: list[Planned] = field(default_factory=list)
    fired: dict[int, list[Planned]] = field(default_factory=dict)
    """Per slot: step-clock kills and stops handed to its incarnation as faults, not yet seen."""
    self_fired: bool = True
    """Whether peers fire step-clock kills and stops on themselves (the built-in job); False:
    they are applied from outside when due."""

    def by_fault(self, p: Planned) -> bool:
        """Whether the peer fires ``p`` on itself."""
        return self.self_fired and p.by_fault

    def __post_init__(self) -> None:
        self.pending.sort(key=lambda p: (p.clock, p.when))

    def faults_for(self, slot: int, from_step: float) -> list[str]:
        """The fault specs of the incarnation of ``slot`` that starts at run step ``from_step``:
        its step-clock kills and stops at or after that step, up to its first kill (a later one
        belongs to a later incarnation). They leave the pending list for :attr:`fired`."""
        out: list[str] = []
        mine = sorted(
            (p for p in self.pending if self.by_fault(p) and p.slot == slot), key=lambda p: p.when
        )
        for p in mine:
            if p.when < from_step:
                continue
            out.append(f"{p.action}@step:step={int(p.when)}")
            self.pending.remove(p)
            self.fired.setdefault(slot, []).append(p)
            if p.action == "kill":
                break
        return out

    def due(self, *, run_step: float, elapsed: float | None) -> list[Planned]:
        """Pending events whose time has come (``elapsed`` None: the run has not started, so no
        timed event is due). Fault-fired events are never due here: the peer fires them."""
        return [
            p
            for p in self.pending
            if not self.by_fault(p)
            and (
                (p.clock == "step" and run_step >= p.when)
                or (p.clock == "seconds" and elapsed is not None and elapsed >= p.when)
            )
        ]

    def decide(self, p: Planned, state: SlotState, *, run_step: float) -> Decision:
        """What to do with due event ``p`` when its slot is in ``state``."""
        alive = state in ("running", "stopped")
        if p.action == "join":
            if alive:
                if p.source == "scenario":
                    return Decision("wait")  # its kill (a fault at a later step) has not fired yet
                return Decision("skip", "the peer is running")
            return Decision("apply", from_step=p.when if p.clock == "step" else run_step)
        if p.action == "cont":
            if state == "stopped":
                return Decision("apply")
            if alive and p.source == "scenario":
                return Decision("wait")  # its stop (a fault) has not fired yet
            return Decision("skip", "the peer is not stopped")
        if not alive:
            return Decision("skip", "the peer is not running")
        if p.action == "stop" and state == "stopped":
            return Decision("skip", "the peer is already stopped")
        return Decision("apply")

    def done(self, p: Planned) -> None:
        """``p`` was applied or skipped: it is no longer pending."""
        self.pending.remove(p)

    def observed(self, slot: int, action: Literal["kill", "stop"]) -> Planned | None:
        """The slot's process was seen killed (SIGKILL) or stopped: the fault event that did it,
        if one was handed out (it is then no longer awaited)."""
        for p in self.fired.get(slot, []):
            if p.action == action:
                self.fired[slot].remove(p)
                return p
        return None

    def can_wake(self, *, run_step: float) -> bool:
        """Whether a planned ``cont`` may still wake a stopped peer when every live peer is
        stopped: a timed one, or a step-clock one already due (the run step cannot advance)."""
        return any(
            p.action == "cont" and (p.clock == "seconds" or run_step >= p.when)
            for p in self.pending
        )

    def leftovers(self) -> list[tuple[Planned, str]]:
        """At the end of the run: every event that never happened, with why. Random events
        scheduled past the end are dropped silently (they were never due)."""
        out = [
            (p, "the run ended first")
            for p in self.pending
            if not (p.clock == "seconds" and p.source == "random")
        ]
        for fired in self.fired.values():
            out += [(p, "the peer never reached that step") for p in fired]
        return out


def random_schedule(
    *,
    failures_per_minute: float,
    seed: int,
    kind: Literal["kill", "stop"],
    recover_after_seconds: float | None,
    min_peers: int,
    peers: int,
    duration_s: float,
) -> list[tuple[str, int, float]]:
    """Failures arriving as a Poisson process, as ``(action, peer, seconds)`` in time order.

    Gaps are exponential; each failure picks a uniformly random running peer, unless that would
    leave fewer than ``min_peers`` running (then it is skipped). A failed peer comes back
    (``join`` after a kill, ``cont`` after a stop) ``recover_after_seconds`` later, or never;
    recoveries after ``duration_s`` are dropped. The same seed gives the same events.
    """
    rng = random.Random(seed)
    recover = "join" if kind == "kill" else "cont"
    rate_per_s = failures_per_minute / 60.0
    down_until: dict[int, float] = {}  # peer -> when it is back (inf: never)
    events: list[tuple[str, int, float]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            break
        running = [p for p in range(peers) if down_until.get(p, -1.0) <= t]
        if len(running) - 1 < min_peers:
            continue
        victim = rng.choice(running)
        events.append((kind, victim, round(t, 6)))
        if recover_after_seconds is None:
            down_until[victim] = math.inf
        else:
            back = t + recover_after_seconds
            down_until[victim] = back
            if back < duration_s:
                events.append((recover, victim, round(back, 6)))
    events.sort(key=lambda e: e[2])
    return events


# transitions allowed per action: state before -> state after
_MOVES = {
    "kill": ({"running", "stopped"}, "dead"),
    "join": ({"dead"}, "running"),
    "stop": ({"running"}, "stopped"),
    "cont": ({"stopped"}, "running"),
}


def check_sequences(events: Sequence[Any], peers: int) -> tuple[str, str] | None:
    """Whether a scenario's churn makes sense: ``(key, problem)`` for the first event that does
    not, else None. Events have ``action``, ``peer``, ``clock`` and ``when``.

    Per peer (when its events share one clock): no two events at the same time, and each action
    needs the state it acts on (kill a running or stopped peer, join a dead or absent one, stop
    a running one, cont a stopped one). When every event is on one clock, the whole run is
    replayed (at equal times arrivals before departures) to make sure someone always runs.
    Steps and seconds cannot be ordered against each other: such peers are left to the run.
    """
    indexed = list(enumerate(events))
    state: dict[int, str] = {}
    for peer in {ev.peer for ev in events}:
        mine = sorted(
            ((i, ev) for i, ev in indexed if ev.peer == peer), key=lambda x: (x[1].clock, x[1].when)
        )
        if len({ev.clock for _, ev in mine}) > 1:
            state[peer] = "unknown"
            continue
        for (_, a), (j, b) in itertools.pairwise(mine):
            if a.when == b.when:
                return (
                    f"churn[{j}]",
                    f"two events for peer {peer} at the same {a.clock} {b.when:g}; their order "
                    "would be undefined",
                )
        current = "dead" if mine[0][1].action == "join" else "running"
        state[peer] = current
        for i, ev in mine:
            allowed, after = _MOVES[ev.action]
            if current not in allowed:
                return (
                    f"churn[{i}].action",
                    f"cannot {ev.action} peer {peer} at {ev.clock} {ev.when:g}: it is {current} "
                    f"then ({ev.action} needs a {' or '.join(sorted(allowed))} peer)",
                )
            current = after
    if len({ev.clock for ev in events}) != 1 or "unknown" in state.values():
        return None
    running = set(range(peers))
    for peer in state:
        first = min((ev for ev in events if ev.peer == peer), key=lambda e: e.when)
        if first.action == "join":
            running.discard(peer)
    if not running:
        return (
            "churn",
            "every peer starts absent (first event is a join); at least one must run from the start",
        )
    for i, ev in sorted(indexed, key=lambda x: (x[1].when, x[1].action in ("kill", "stop"))):
        if ev.action in ("kill", "stop"):
            running.discard(ev.peer)
        else:
            running.add(ev.peer)
        if not running:
            return (
                f"churn[{i}]",
                f"after this event no peer is left running (at {ev.clock} {ev.when:g}); "
                "keep at least one peer alive",
            )
    return None
