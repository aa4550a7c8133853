"""A formed round as its caller sees it: the group for its collectives, then one commit.

:meth:`isthmus.comm.session.Session.begin` makes one; the session keeps what a round needs (the
coordinator's verdict, the fault injector, whether this peer's state was just repaired) and the
round asks it. A round that needs no collective may be handed out before its epoch's group is
connected (:mod:`isthmus.comm.ahead`): :attr:`Round.group` then waits for the connection
(bounded) the first time it is read, and its rank and world come from the plan.
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

    def _group_for(self, plan: RoundPlan) -> Group: ...


class Round:
    """One formed round. Use :attr:`group` for collectives, then :meth:`commit` exactly once.

    ``group`` None: the round was handed out ahead of its epoch's group (see the module
    docstring)."""

    def __init__(
        self, session: RoundOwner, plan: RoundPlan, group: Group | None, started: float
    ) -> None:
        self.session = session
        self.plan = plan
        self._group = group
        self.started = started
        self.setup_failed = False
        """The group, connected ahead, could not be had: the attempt failed in its set-up."""
        self._done = False

    @property
    def group(self) -> Group:
        """The group for this round's collectives. For a round handed out ahead of its group,
        the first read waits for the connection (bounded by ``collective_timeout`` and the
        probes that name a member not reached) and raises
        :class:`~isthmus.comm.group.CollectiveError` when it failed or the epoch was aborted:
        report the round failed (:meth:`Session.run_round` does) and begin again."""
        if self._group is None:
            try:
                self._group = self.session._group_for(self.plan)
            except Exception:
                self.setup_failed = True
                raise
        return self._group

    @property
    def number(self) -> int:
        return self.plan.round

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def rank(self) -> int:
        if self._group is None:  # not connected yet: the plan says it
            return self.plan.rank_of(self.session.peer_id or 0)
        return self._group.rank

    @property
    def world(self) -> int:
        return len(self.plan.members) if self._group is None else self._group.world

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
