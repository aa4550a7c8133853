"""Connecting an epoch's group behind the first phase's compute, for a round that needs none.

The run's first round (round 0) gives nobody's work: no member has trained yet. When its plan
transfers nothing (no joiner to repair, the initial states' hashes all equal), the round's
verdict does not depend on a single byte between the members, and a strategy whose first round
reduces nothing (the DiLoCo family, :func:`~isthmus.strategies.phased.nobody_trained`) runs no
collective in it. :meth:`Session.begin <isthmus.comm.session.Session.begin>` therefore hands such
a round out at once (:func:`connects_ahead` decides, from the plan alone, so every member decides
alike) and connects the epoch's group on a thread of its own (:class:`GroupAhead`) while the
caller commits the round and computes its first phase. The next round of the same epoch takes
the group from there, waiting only for what is left of the connection; a round that reads
:attr:`Round.group <isthmus.comm.round.Round.group>` before (a strategy whose round 0 reduces)
waits for it there. The link probes of a new member set, which need the group, run when the
group is taken at the next round's begin, on every member at the same point.

Kept on the connection at the round's begin: a round with transfers (a joiner's repair, a
corrupted tensor), any round after round 0, groups of one, NCCL groups, and islands (an island's
ranks connect their groups in an order their leader sets: :mod:`isthmus.comm.island`).

What happens on failure: the connection keeps its bounds (``collective_timeout``, then probes of
the members bounded by ``probe_timeout`` to name the one not reached). A connection that fails
is not seen by the round handed out ahead; it raises :class:`~isthmus.comm.group.CollectiveError`
(the same error, naming the unreached member) where the group is next needed: the next round's
set-up fails like any failed set-up, and the survivors form a new epoch. The coordinator
aborting the epoch, a new epoch, a new registration or closing the session ends the attempt (its
connections are cut); an attempt or group left behind is parked until torch is done with it
(:class:`~isthmus.comm.connect.Graveyard`), and a group that was connected for an epoch that is
gone is aborted first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from isthmus.comm.connect import Graveyard
from isthmus.comm.group import CollectiveError, Group
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["ConnectsAhead", "GroupAhead", "connects_ahead"]

log = logging.getLogger("isthmus.session")


def connects_ahead(plan: RoundPlan, *, backend: str) -> bool:
    """Whether the round of ``plan`` is handed out before its epoch's group is connected: the
    run's first round, with no transfers, over Gloo, of at least two members. Decided from the
    plan (and settings every member of a run shares), so alike everywhere. (An island's ranks
    never ask: :class:`~isthmus.comm.island.IslandSession` begins its rounds its own way.)"""
    return plan.round == 0 and not plan.transfers and len(plan.members) > 1 and backend == "gloo"


class GroupAhead:
    """Epoch ``epoch``'s group, being connected by ``build`` on a daemon thread of its own.

    ``build(cancelled)`` connects and returns the group; it must stop connecting (raise) soon
    after ``cancelled()`` turns True. ``bound_s``: how long the attempt may take from its start
    (``build``'s own bounds and a margin); :meth:`wait` never waits past it.
    """

    def __init__(
        self, epoch: int, build: Callable[[Callable[[], bool]], Group], *, bound_s: float, name: str
    ) -> None:
        self.epoch = epoch
        self.started = time.monotonic()
        self.deadline = self.started + bound_s
        self.connected_s: float | None = None
        """Seconds from the start to a connected group (None: not connected, or failed)."""
        self._lock = threading.Lock()
        self._reason: str | None = None  # why the attempt was abandoned
        self._group: Group | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

        def run() -> None:
            try:
                g = build(lambda: self._reason is not None)
            except BaseException as e:  # handed to wait()
                self._error = e
            else:
                with self._lock:
                    self._group = g
                    self.connected_s = time.monotonic() - self.started
                    why = self._reason
                if why is not None:  # abandoned while it connected: nobody will take it
                    g.abort(why)
            finally:
                self._finished.set()

        self._thread = threading.Thread(target=run, daemon=True, name=f"isthmus-ahead-{name}")
        self._thread.start()

    def done(self) -> bool:
        """True once the attempt ended (connected or failed)."""
        return self._finished.is_set()

    def abort(self, reason: str) -> None:
        """Abandon the attempt: a connection under way stops (``build`` sees it), a group already
        connected is aborted (its connections cut). Idempotent; the first reason stays."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
            g = self._group
        if g is not None:
            g.abort(reason)

    def busy(self) -> bool:
        """True while the attempt's thread, or the group it connected, may be inside torch (for
        :class:`~isthmus.comm.connect.Graveyard`)."""
        g = self._group
        return self._thread.is_alive() or (g is not None and g.busy())

    def wait(self, abandon: Callable[[], str | None] = lambda: None) -> Group:
        """The connected group. Polls ``abandon()`` every 10 ms; a reason it returns (the epoch
        was aborted) abandons the attempt. Raises :class:`CollectiveError`: the attempt's own
        failure as it was raised (naming the members not reached), the reason it was
        abandoned, or that it did not end by its bound (it is abandoned then). A caller that
        does not take the group must :meth:`abort` it and park this object."""
        while not self._finished.wait(0.01):
            why = abandon()
            if why is None and time.monotonic() > self.deadline:
                why = (
                    f"the group of epoch {self.epoch} was not connected within "
                    f"{self.deadline - self.started:.0f}s"
                )
            if why is not None:
                self.abort(why)
                raise CollectiveError(why)
        with self._lock:
            why, g = self._reason, self._group
        if why is not None:  # abandoned: whatever the connection raised came of that
            raise CollectiveError(why) from self._error
        if self._error is not None:
            if isinstance(self._error, CollectiveError):
                raise self._error
            raise CollectiveError(
                f"connecting the group of epoch {self.epoch} failed: {self._error}"
            ) from self._error
        assert g is not None
        return g


class ConnectsAhead:
    """The part of :class:`~isthmus.comm.session.Session` that connects an epoch's group behind
    a round (see the module docstring). It uses the session's config, graveyard, aborted epochs
    and its ``_connect`` and ``_set_group``."""

    if TYPE_CHECKING:  # what the session provides
        config: Any
        name: str
        _ahead: GroupAhead | None
        _graveyard: Graveyard
        _aborted_epochs: set[int]

        def _connect(self, plan: RoundPlan, cancelled: Callable[[], bool] = ...) -> Group: ...
        def _set_group(self, g: Group | None) -> None: ...
        def _group_for(self, plan: RoundPlan) -> Group: ...

    def _connect_ahead(self, plan: RoundPlan) -> None:
        """Start connecting ``plan``'s epoch on a thread of its own, unless an attempt for that
        epoch is under way already; the previous epoch's attempt and group are retired."""
        if self._ahead is not None and self._ahead.epoch == plan.epoch:
            return
        self._drop_ahead("superseded by a new epoch")
        self._set_group(None)  # the previous epoch's group is of no use to this one
        cfg = self.config
        self._ahead = GroupAhead(
            plan.epoch,
            lambda cancelled: self._connect(plan, cancelled),
            # connect_epoch's own bounds (the connection, then probes naming a member), a margin
            bound_s=cfg.collective_timeout + cfg.probe_timeout + 5.0,
            name=f"epoch{plan.epoch}",
        )

    def _drop_ahead(self, reason: str) -> None:
        """Abandon the attempt under way, if any, and park it until torch is done with it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.abort(reason)
            self._graveyard.park(ahead)

    def _take_ahead(self, plan: RoundPlan) -> Group | None:
        """The group connected ahead for ``plan``'s epoch, once connected (waits for what is
        left, bounded; abandoned at once if the coordinator aborts the epoch); None when no
        attempt for that epoch is under way (one for another epoch is abandoned). Raises
        :class:`CollectiveError` when the attempt failed, naming the members not reached."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.epoch != plan.epoch:
            ahead.abort("superseded by a new epoch")
            self._graveyard.park(ahead)
            return None
        t0 = time.monotonic()
        epoch = plan.epoch
        try:
            g = ahead.wait(
                lambda: f"epoch {epoch} was aborted" if epoch in self._aborted_epochs else None
            )
        except CollectiveError:
            self._graveyard.park(ahead)  # until its thread is out of torch
            raise
        log.info(
            "%s: round %d took epoch %d's group, connected ahead in %.2fs; waited %.2fs",
            self.name, plan.round, epoch, ahead.connected_s or 0.0, time.monotonic() - t0,
        )  # fmt: skip
        return g
