"""The phase of a run, as the membership sees it: one value and the moves allowed between them.

A run is always in exactly one :class:`Phase`:

* ``STARTING``: no round has formed yet. The first round waits for ``start_peers`` ready peers,
  or for ``start_timeout`` after the first of them became ready.
* ``RESTARTING``: every peer that held the run's state is gone and the run continues from a
  checkpoint. The next round forms as a first round does: it waits for ``start_peers``, or for
  ``restart_timeout`` (at most ``start_timeout``) after the first of them became ready.
* ``RUNNING``: a round is formed and its members are working; it ends committed or aborted.
* ``COMMITTED``: between rounds, the last one committed: the next round keeps the epoch when its
  members are the same.
* ``ABORTED``: between rounds, the last one aborted: the next round opens a new epoch (fresh
  process groups), whoever its members are.

``RUNNING`` carries the :class:`Round` that runs (its plan, when it formed, which begin attempt
each member was admitted with, and the members' reports so far); no other phase has a round.
:data:`TRANSITIONS` lists every legal move; :meth:`RunPhase.to` refuses any other with
:class:`IllegalTransition` (a bug in the caller, never a peer's doing). Pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from isthmus.coordinator.protocol import Go, RoundPlan

__all__ = ["TRANSITIONS", "IllegalTransition", "Phase", "Round", "RunPhase"]


class Phase(str, enum.Enum):
    STARTING = "starting"
    RESTARTING = "restarting"
    RUNNING = "running"
    COMMITTED = "committed"
    ABORTED = "aborted"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.RUNNING}),
    Phase.RESTARTING: frozenset({Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.COMMITTED, Phase.ABORTED}),
    Phase.COMMITTED: frozenset({Phase.RUNNING, Phase.RESTARTING}),
    Phase.ABORTED: frozenset({Phase.RUNNING, Phase.RESTARTING}),
}
"""Where each phase may go. A round forms from any phase but ``RUNNING``; it ends committed or
aborted; the run restarts from a checkpoint only between rounds of a run that had started."""


class IllegalTransition(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow (names both phases)."""


@dataclass
class Round:
    """The round that runs: its plan, when it formed, the begin attempt (nonce) each member was
    admitted with (asking again with it gets the same plan; its keys are the members), and the
    members' reports so far (peer id -> succeeded)."""

    plan: RoundPlan
    started_at: float
    nonces: dict[int, str]
    reports: dict[int, bool] = field(default_factory=dict)
    succeeded: int = 0
    """How many members have reported success (kept so that no report scans the members)."""

    @functools.cached_property
    def go(self) -> Go:
        """The answer to a member's begin: go with :attr:`plan` (one immutable decision for
        every member, made once)."""
        return Go(plan=self.plan)

    def has(self, pid: int) -> bool:
        """Whether ``pid`` is a member of this round."""
        return pid in self.nonces

    def report(self, pid: int, ok: bool) -> None:
        """Record member ``pid``'s outcome (a later report replaces an earlier one)."""
        self.succeeded += bool(ok) - bool(self.reports.get(pid))
        self.reports[pid] = ok

    @property
    def all_succeeded(self) -> bool:
        """Every member has reported success."""
        return self.succeeded == len(self.nonces)


class RunPhase:
    """The run's phase, the round that runs (in ``RUNNING``), and the clock of the round that
    is forming.

    ``waiting_since`` is when the first peer became ready for the round that is forming (None:
    nobody is waiting, or a round is running); the first round's ``start_timeout`` counts from
    it. Every transition clears it: each round that forms has a clock of its own.
    """

    __slots__ = ("moves", "phase", "round", "waiting_since")

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.round: Round | None = None
        self.waiting_since: float | None = None
        self.moves = 0
        """Transitions so far: tells a waiter cheaply that the phase (or its round) changed."""

    def to(self, new: Phase, round: Round | None = None) -> None:
        """Move to ``new``; ``round`` is the round that runs, given exactly when ``new`` is
        ``RUNNING``. Raises :class:`IllegalTransition` when :data:`TRANSITIONS` does not allow
        the move, ValueError when ``round`` is missing or not wanted; the phase is then
        unchanged."""
        if new not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"a run cannot go from {self.phase.value} to {new.value}")
        if (new is Phase.RUNNING) != (round is not None):
            raise ValueError(
                f"the {new.value} phase {'needs' if round is None else 'has no'} round"
            )
        self.phase, self.round, self.waiting_since = new, round, None
        self.moves += 1

    def may(self, new: Phase) -> bool:
        """Whether :meth:`to` would accept ``new``."""
        return new in TRANSITIONS[self.phase]

    # -- the questions the membership asks -------------------------------------------------------
    @property
    def started(self) -> bool:
        """A round has formed since the run (re)started from a checkpoint or from scratch."""
        return self.phase not in (Phase.STARTING, Phase.RESTARTING)

    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    @property
    def new_epoch_due(self) -> bool:
        """The next round opens a new epoch whatever its members: nothing formed yet since the
        (re)start, or the last round aborted."""
        return self.phase in (Phase.STARTING, Phase.RESTARTING, Phase.ABORTED)

    def waiting(self, now: float) -> float:
        """A peer is ready while no round runs: start the forming round's clock unless it runs
        already. Returns when it started."""
        if self.waiting_since is None:
            self.waiting_since = now
        return self.waiting_since

    def nobody_waiting(self) -> None:
        """No peer is ready any more: the next ready peer starts the clock afresh."""
        self.waiting_since = None

    def __repr__(self) -> str:
        return f"RunPhase({self.phase.value}, waiting_since={self.waiting_since})"
