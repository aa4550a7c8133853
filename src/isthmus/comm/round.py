"""A formed round as its caller sees it: the group for its collectives, then one commit.

:meth:`isthmus.comm.session.Session.begin` makes one; the session keeps what a round needs (the
coordinator's verdict, the fault injector, whether this peer's state was just repaired) and the
round asks it.
"""

from __future__ import annotations

from typing import Protocol

from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import Group
from isthmus.comm.state import SharedState
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["Round"]


class RoundOwner(Protocol):
    """What a round asks of the session that formed it (:class:`isthmus.comm.session.Session`)."""

    peer_id: int | None
    faults: FaultInjector
    state: SharedState
    _void: bool

    def _commit(self, rnd: Round, ok: bool, error: str, cause: BaseException | None) -> bool: ...


class Round:
    """One formed round. Use :attr:`group` for collectives, then :meth:`commit` exactly once."""

    def __init__(self, session: RoundOwner, plan: RoundPlan, group: Group, started: float) -> None:
        self.session = session
        self.plan = plan
        self.group = group
        self.started = started
        self._done = False

    @property
    def number(self) -> int:
        return self.plan.round

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def resynced(self) -> bool:
        """True if this peer's state was repaired at the start of this round: anything it computed
        before the round (gradients, local progress) came from a stale state and must not count.
        Also True after this peer undid a tentatively applied round (``pipeline_commit``) until
        a round commits: its work since started from a revision that never became final."""
        return self.session.peer_id in self.plan.resynced or self.session._void

    @property
    def contributors(self) -> int:
        """Members whose local work counts in this round (world minus resynced peers)."""
        return self.world - len(self.plan.resynced)

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        """Give the fault injector a chance to act at ``point`` inside this round."""
        self.session.faults.check(point, step=step, round=self.number, state=self.session.state)

    def commit(
        self, ok: bool = True, error: str = "", *, cause: BaseException | None = None
    ) -> bool:
        """Report this peer's outcome and wait for the round's. True means committed by every
        member: apply the result. False means aborted: discard it and begin again. A failure
        names the members this peer could not reach, from ``cause`` (the exception), the text
        of ``error`` or probes of the members."""
        if self._done:
            raise RuntimeError("Round.commit called twice")
        self._done = True
        return self.session._commit(self, ok, error, cause)
