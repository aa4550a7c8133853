"""Rounds that span training steps: issue a reduction, keep training, settle it later.

The strategies that hide communication behind compute (Streaming DiLoCo's overlapped fragments,
eager / one-step-delayed DiLoCo, CO2) share one shape of round::

    begin round r -> start its reduction -> (inner steps go on) -> wait -> commit -> apply

:class:`RoundPipeline` runs that shape with at most one round in flight. Rounds stay sequential in
the coordinator: the next round begins only after the one in flight committed *and was applied*,
and membership changes only between rounds. So a joiner is admitted when a round begins, receives
the shared state as of the last commit, and then takes part in (and receives the result of) the
reduction that round starts, exactly like every member.

What happens on failure (the guarantee every overlapped strategy documents):

* A collective that fails while in flight (a peer died: Gloo reports a closed connection, or the
  coordinator pushes an abort), an injected ``fail`` fault, or a commit that comes back False
  (another member failed, or died before reporting) aborts the round *for every member*. Nobody
  has applied anything yet: results are applied only after a commit.
* The round is then retried at once, blocking, by :meth:`Session.run_round` on a fresh begin with
  the survivors. The retry reduces the **snapshot taken when the round was issued** (the same
  outer gradient, the same step count), not a recomputation: the inner steps taken while the
  reduction was in flight stay in the local parameters as local progress, and the result applied
  on every peer is what the round would have produced without the failure, minus the dead peer's
  contribution. Recomputing from the current parameters instead would fold the steps taken since
  issue into this round on the survivors only, and count them twice (again in the next round).
  A plan with its own :class:`Exchange` (SparseLoCo's message) sends what it built once, and
  what it stages (SparseLoCo's residual) is kept only once an attempt committed.
* If the retry's begin resynced this peer (it had been evicted, e.g. stopped for too long), its
  snapshot is void: it rebuilds the round's items from the repaired state and contributes nothing
  (:attr:`Settled.resynced_late` tells the strategy to restart its local progress).

Timeouts: a round stays open while the inner steps between issue and settle run (tau steps for
Streaming DiLoCo, H for eager DiLoCo and CO2), so the coordinator's ``commit_timeout`` must exceed
that much compute, or members are evicted as silent. The reduction itself runs as long as its
bytes move (the session's ``stall_s`` and ``late_s``, :mod:`isthmus.comm.handle`).

With ``session=None`` nothing leaves the process: the "reduction" of one peer is its own update,
and it is applied at the same point of the schedule as with a session (so one-peer results do not
depend on the transport).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from isthmus.comm.group import CollectiveError
from isthmus.comm.layout import Placement
from isthmus.comm.session import Round, Session
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.reducer import PendingMean, Reduced, Reducer
from isthmus.strategies.sharded import island_vote, start_reduction

__all__ = ["Build", "Exchange", "Flight", "Planned", "RoundPipeline", "Settled", "SteadyOverlap"]

log = logging.getLogger("isthmus.pipeline")

Items = list[tuple[str, torch.Tensor]]


class Exchange(Protocol):
    """A round's own reduction, for a strategy that does not average ``items`` with the reducer
    (SparseLoCo all-gathers a compressed message). Built with the plan, so an aborted attempt's
    retry sends what the first attempt sent; what it stages is kept only by :meth:`commit`."""

    def start(self, rnd: Round, contribute: bool) -> PendingMean:
        """Start this attempt's collectives (absent if not ``contribute``); return at once."""
        ...

    def alone(self, contribute: bool) -> Reduced | None:
        """The result of a peer without a session (its own update, as the collective gives it)."""
        ...

    def commit(self) -> None:
        """The attempt started last (or :meth:`alone`) committed."""
        ...


@dataclass(kw_only=True)
class Planned:
    """What a round reduces, as built by the strategy for that round."""

    items: Items
    """Named update tensors (fresh tensors: the snapshot kept for a retry)."""
    contribute: bool
    """False for a peer whose local work must not count (joiner, resynced, nothing to send)."""
    exact: torch.Tensor | None = None
    """Values summed exactly and averaged over contributors (e.g. the step the round applies at)."""
    tag: Any = None
    """The strategy's own bookkeeping for this round (fragment index, apply step, ...)."""
    exchange: Exchange | None = None
    """How the round is reduced; None: the reducer's mean of ``items`` and ``exact``."""
    placements: list[Placement | None] | None = None
    """On a rank of an island: each item's placement in its full tensor (None: held whole), so
    that the reduction goes by shard (:func:`~isthmus.strategies.sharded.start_reduction`)."""
    idle: bool = False
    """Nobody in the round can contribute, decided alike by every member from the round's plan
    (:func:`~isthmus.strategies.phased.nobody_trained`): no collective runs and the result is
    None, what a reduction of nobody's work gives. The round still begins and commits."""


Build = Callable[[Round | None], Planned]
"""Builds a round's :class:`Planned` from the formed round (None without a session). Called after
begin, so it sees the round number and whether this peer was just resynced."""


@dataclass
class Flight:
    """A round in flight."""

    rnd: Round | None
    plan: Planned
    build: Build
    pending: PendingMean | None = None
    error: str = ""
    local: Reduced | None = None  # the result when there is no session


@dataclass
class Settled:
    """A committed round's outcome."""

    result: Reduced | None
    """The agreed update (None: nobody contributed, apply nothing)."""
    tag: Any
    """The :attr:`Planned.tag` of the attempt that committed."""
    number: int
    """The committed round's number (the run's revision before it)."""
    resynced_at_issue: bool
    """This peer was resynced when the round began (a joiner's first round)."""
    resynced_late: bool
    """This peer was resynced by a retry after issue: its local progress is void."""
    retried: bool
    """The first attempt aborted and the round was reduced again."""


class RoundPipeline:
    """At most one round in flight. :meth:`issue` begins a round and starts its reduction;
    :meth:`settle` waits for it, commits, retries on failure (see the module docstring)."""

    def __init__(self, session: Session | None, reducer: Reducer, step: Callable[[], int]) -> None:
        self.session = session
        self.reducer = reducer
        self._step = step
        self.flight: Flight | None = None
        self.rounds = 0  # rounds settled; the round number when there is no session
        self.retries = 0

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    def next_number(self) -> int:
        """The number the next round will get without a session (the count of settled rounds)."""
        return self.rounds

    def issue(self, build: Build) -> Flight:
        """Begin a round, build its items and start reducing them; return without waiting.

        Raises RuntimeError if a round is already in flight (rounds are sequential). A collective
        error at issue time is kept and handled by :meth:`settle` (abort, then retry); any other
        exception reports the round as failed and propagates.
        """
        if self.flight is not None:
            raise RuntimeError("a round is already in flight; settle it before issuing another")
        if self.session is None:
            plan = build(None)
            local = None
            if plan.exchange is not None:
                local = plan.exchange.alone(plan.contribute)
            elif plan.contribute and not all(all_finite(t) for _, t in plan.items):
                # the reducer's policy, applied to the peer alone: a non-finite update is dropped
                self.reducer.nonfinite_skips += 1
                log.warning("non-finite values in this peer's update: not applying it")
                plan.contribute = False
            elif plan.contribute:
                local = Reduced([t for _, t in plan.items], plan.exact, 1)
            self.flight = Flight(None, plan, build, local=local)
            return self.flight
        rnd = self.session.begin()
        try:
            plan = build(rnd)
            flight = Flight(rnd, plan, build)
            try:
                flight.pending = self._start(rnd, plan)
                # In flight from here on: the point where tests kill a peer mid-reduction.
                rnd.check_faults("collective", step=self._step())
            except CollectiveError as e:
                flight.error = str(e)
        except BaseException as e:
            with contextlib.suppress(Exception):
                rnd.commit(ok=False, error=f"{type(e).__name__}: {e}")
            raise
        self.flight = flight
        return flight

    def settle(self) -> Settled:
        """Wait for the round in flight, commit it (retrying until a commit), return the outcome.

        Raises RuntimeError if nothing is in flight; :class:`RoundFailed` or the session's own
        errors if the round cannot commit at all.
        """
        f = self.flight
        if f is None:
            raise RuntimeError("no round in flight")
        self.flight = None
        self.rounds += 1
        if f.rnd is None:
            if f.plan.exchange is not None:
                f.plan.exchange.commit()
            return Settled(f.local, f.plan.tag, self.rounds - 1, False, False, False)
        rnd = f.rnd
        result: Reduced | None = None
        error = f.error
        if not error:
            assert f.pending is not None
            try:
                result = f.pending.wait()
            except CollectiveError as e:
                error = str(e)
            except BaseException as e:
                with contextlib.suppress(Exception):
                    rnd.commit(ok=False, error=f"{type(e).__name__}: {e}")
                raise
        if not error:
            if rnd.commit():
                self._commit(f.plan)
                return Settled(result, f.plan.tag, rnd.number, rnd.resynced, False, False)
        else:
            rnd.commit(ok=False, error=error)
        return self._retry(f, error or "the round did not commit")

    def _start(self, rnd: Round, plan: Planned) -> PendingMean:
        if plan.idle:
            plan.contribute = False
            done: Future[Reduced | None] = Future()
            done.set_result(None)
            return PendingMean(done)
        if plan.exchange is not None:
            return plan.exchange.start(rnd, plan.contribute)
        # an island decides as one, and the strategy reads the decision from the plan
        plan.contribute, _ = island_vote(rnd, plan.items, plan.contribute)
        places = plan.placements or [None] * len(plan.items)
        return start_reduction(
            self.reducer, rnd, plan.items, places, contribute=plan.contribute, exact=plan.exact,
            agreed=True,
        )  # fmt: skip

    def _commit(self, plan: Planned) -> None:
        # The reducer's staged state was kept by the session's commit hook (Reducer.attach).
        if plan.exchange is not None:
            plan.exchange.commit()

    def _retry(self, f: Flight, why: str) -> Settled:
        assert self.session is not None and f.rnd is not None
        self.retries += 1
        first = f.rnd
        log.warning("round %d aborted (%s); reducing its snapshot again", first.number, why)
        last: dict[str, Any] = {}

        def again(rnd: Round) -> Reduced | None:
            if rnd.resynced or rnd.number != first.number:
                # This peer's state was repaired at this begin: the snapshot is void.
                plan = f.build(rnd)
                plan.contribute = False
            else:
                plan = f.plan
            last.update(plan=plan, rnd=rnd)
            pending = self._start(rnd, plan)
            rnd.check_faults("collective", step=self._step())
            return pending.wait()

        result = self.session.run_round(again)
        self._commit(last["plan"])
        rnd: Round = last["rnd"]
        resynced = rnd.resynced or rnd.number != first.number
        return Settled(result, last["plan"].tag, rnd.number, first.resynced, resynced, True)


class SteadyOverlap:
    """The overlap fraction of the reductions between two marks: after a blocking start-up round
    and before the blocking flush at the end. In a short run those two weigh a lot in
    :attr:`OverlapTiming.overlap_fraction <isthmus.reduce.reducer.OverlapTiming>` (which counts
    every reduction, as it should); this is the steady state in between."""

    def __init__(self, timing: Any) -> None:
        self.timing = timing
        self.start = (0.0, 0.0)
        self.end: tuple[float, float] | None = None

    def _now(self) -> tuple[float, float]:
        return (self.timing.comm_s, self.timing.blocked_s)

    def mark_start(self) -> None:
        self.start = self._now()

    def mark_end(self) -> None:
        if self.end is None:
            self.end = self._now()

    @property
    def fraction(self) -> float:
        end = self.end or self._now()
        comm, blocked = end[0] - self.start[0], end[1] - self.start[1]
        return 0.0 if comm <= 0 else max(0.0, 1.0 - blocked / comm)
