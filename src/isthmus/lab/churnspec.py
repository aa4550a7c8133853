"""A scenario's churn: the ``[[churn]]`` entries (:class:`ChurnEvent`, one thing happening to one
peer at a step or a time) and ``[random_churn]`` (:class:`RandomChurn`, failures arriving at random,
reproducible by seed). Both are checked on construction and raise a
:class:`~isthmus.spec.SpecError` naming the key; :mod:`isthmus.lab.scenario` reads them from the
file and checks them against the network and the run."""

from __future__ import annotations

from dataclasses import dataclass

from isthmus.lab.checks import check_float, check_int, check_str, one_of
from isthmus.lab.churn_plan import random_schedule
from isthmus.settings import Checked, setting
from isthmus.spec import SpecError

__all__ = ["CHURN_ACTIONS", "ChurnEvent", "RandomChurn"]

CHURN_ACTIONS = ("kill", "join", "stop", "cont")


@dataclass(frozen=True, kw_only=True)
class ChurnEvent:
    """One ``[[churn]]`` entry: something happens to one peer at a step or a time.

    ``kill`` ends the peer's process (SIGKILL), ``join`` starts it (a peer whose first event is a
    join is absent at the start), ``stop`` freezes it (SIGSTOP: a silent peer), ``cont`` resumes it.
    """

    action: str
    """One of :data:`CHURN_ACTIONS`."""
    peer: int
    """Peer index, 0-based."""
    at_step: int | None = None
    """When peer ``peer`` reaches this inner step. Exactly one of ``at_step``/``at_seconds``."""
    at_seconds: float | None = None
    """Seconds after the run starts. Exactly one of ``at_step``/``at_seconds``."""

    def __post_init__(self) -> None:
        check_str(self.action, "action")
        one_of(self.action, CHURN_ACTIONS, "churn action", "action")
        check_int(self.peer, "peer", minimum=0)
        if (self.at_step is None) == (self.at_seconds is None):
            raise SpecError(
                "give exactly one of at_step (a step number) or at_seconds (time since start)",
                key="at_step",
            )
        if self.at_step is not None:
            check_int(self.at_step, "at_step", minimum=0)
        if self.at_seconds is not None:
            object.__setattr__(
                self, "at_seconds", check_float(self.at_seconds, "at_seconds", minimum=0.0)
            )

    @property
    def clock(self) -> str:
        """``"step"`` or ``"seconds"``: which clock the event is on."""
        return "step" if self.at_step is not None else "seconds"

    @property
    def when(self) -> float:
        """The event's time on its own clock."""
        return float(self.at_step if self.at_step is not None else self.at_seconds)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class RandomChurn(Checked):
    """``[random_churn]``: failures arriving at random (a Poisson process), reproducible by seed."""

    failures_per_minute: float = setting(
        gt=0, help="Mean failures per minute over the whole run (not per peer)."
    )
    seed: int = setting(0, ge=0, help="Seed of the schedule; the same seed gives the same events.")
    kind: str = setting(
        "kill",
        choices=("kill", "stop"),
        help="kill (the peer rejoins with join) or stop (it resumes with cont).",
    )
    recover_after_seconds: float | None = setting(
        None,
        gt=0,
        help="Delay before the failed peer rejoins or resumes; None: it never comes back.",
    )
    min_peers: int = setting(
        1, ge=1, help="Never fail a peer if fewer than this many would be left running."
    )

    def schedule(self, *, peers: int, duration_s: float) -> list[ChurnEvent]:
        """The concrete events for a run of ``duration_s`` seconds with ``peers`` peers.

        Failures arrive with exponential gaps; each picks a uniformly random running peer, unless
        that would leave fewer than ``min_peers`` running (then the failure is skipped). Recoveries
        that would fall after ``duration_s`` are dropped. Deterministic for a given seed.
        """
        check_int(peers, "peers", minimum=1)
        check_float(duration_s, "duration_s", minimum=0.0)
        return [
            ChurnEvent(action=action, peer=peer, at_seconds=t)
            for action, peer, t in random_schedule(
                failures_per_minute=self.failures_per_minute,
                seed=self.seed,
                kind=self.kind,
                recover_after_seconds=self.recover_after_seconds,
                min_peers=self.min_peers,
                peers=peers,
                duration_s=duration_s,
            )
        ]
