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
that much compute, or members are evicted as silent. The reduction itself is still bounded by
the session's ``collective_timeout``, counted from issue.

With ``session=None`` nothing leaves the process: the "reduction" of one peer is its own update,
and it is applied at the same point of the schedule as with a session (so one-peer results do not
depend on the transport).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from isthmus.comm.group import CollectiveError
from isthmus.comm.session import Round, Session
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.reducer import PendingMean, Reduced, Reducer
from isthmus.strategies.base import Strategy
from isthmus.strategies.model_state import SharedBuffers, as_started, global_copy, load_tensors

__all__ = ["Build", "DelayedOuter", "Exchange", "Flight", "Planned", "RoundPipeline", "Settled"]

log = logging.getLogger("isthmus.overlap")

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
        if plan.exchange is not None:
            return plan.exchange.start(rnd, plan.contribute)
        return self.reducer.start(rnd, plan.items, contribute=plan.contribute, exact=plan.exact)

    def _commit(self, plan: Planned) -> None:
        self.reducer.commit()
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


class DelayedOuter(Strategy):
    """Base of the strategies whose outer round t is reduced while phase t+1 trains.

    Every ``sync_every`` (H) inner steps a *boundary*: (1) this phase's outer gradient
    ``start - local`` is snapshotted; (2) the round in flight (issued at the previous boundary) is
    settled and its mean applied to the shared state by :meth:`apply_outer`, after which
    :meth:`remeasure` may move the snapshot's reference point; (3) a new round begins and starts
    reducing the snapshot; (4) the next phase starts from :meth:`restart`.
    The order (settle, apply, then begin) is what keeps joiners in parity: a joiner is admitted
    at step (3), receives the shared state with the previous result already applied, and is a
    member of the round whose reduction is in flight, so it receives that result too.

    Step counter: the shared ``meta/step`` equals the members' step count at every begin (it is
    set to the boundary's step before the next round begins), so a joiner continues at the
    members' step without being told anything else.

    Buffers: each round carries a snapshot of the model's floating buffers, taken at its
    boundary after the previous round landed, in the reducer's ``exact`` values (an fp32 sum,
    never compressed or robustly aggregated). When the round settles (one boundary later), the
    contributors' mean becomes the shared global copy, and the model's buffers take it plus what
    their own forward passes gathered since the snapshot
    (:meth:`~isthmus.strategies.base.SharedBuffers.rebase`). The global copy is then the mean of
    every peer's statistics, one round late like theta, and no phase's statistics are dropped
    (copying the stale mean over the buffers would discard every other phase's); with one peer
    the buffers are those of plain training. A peer that contributes nothing to a round (a
    joiner, a resynced peer) restarts its buffers from the global copy. Integer buffers are kept
    equal by the parity check.

    Mixed precision: theta, the outer state and :attr:`start` are fp32 for bf16/fp16 models; the
    model receives them cast, and outer gradients are measured from the cast start.

    A checkpoint (:meth:`~isthmus.strategies.base.Strategy.local_state`) holds the round in
    flight as this peer issued it; the first :meth:`step` after loading issues it again with
    that snapshot, so training continues as it would have.

    Subclasses' configs have ``sync_every``. They create and register their outer state in
    :meth:`init_outer` and :meth:`register_outer`, and implement :meth:`apply_outer` and
    :meth:`restart`.
    """

    def setup(self) -> None:
        self.sync_every = self.config.sync_every
        self.global_params = [global_copy(p) for p in self.params]
        # Where this peer's current phase started (local): outer gradients are measured from it.
        self.start = [global_copy(p) for p in self.params]
        self.buffers = SharedBuffers(self.model_state.float_buffers)
        self._ref: list[torch.Tensor] = []  # the buffers the round in flight is measured from
        self._resume: dict[str, Any] | None = None  # a round in flight at a checkpoint
        self.since = 0
        self.outer_rounds = 0
        # Without a session there is nobody to catch up with: the first step trains (as DiLoCo).
        self.joined = self.session is None
        self.stale = False  # a retry resynced this peer: its next outer gradient must not count
        self.pipeline = RoundPipeline(self.session, self.reducer, lambda: self.step_count)
        self.steady = SteadyOverlap(self.reducer.timing)
        self.init_outer()
        self._materialize_inner()
        self.share_model(self.global_params, "global", self.buffers)
        if self.session is not None:
            self.register_outer(self.session)
            self._register_counter()

    def init_outer(self) -> None:
        """Create the outer state (an optimizer, a momentum) over :attr:`global_params`."""
        raise NotImplementedError

    def register_outer(self, session: Session) -> None:
        """Register the outer state with ``session`` (after theta, before the step counter)."""
        raise NotImplementedError

    @property
    def step_count(self) -> int:
        return int(self.global_step) + self.since

    def _step(self) -> None:
        self.check_faults("step")
        if self._resume is not None:
            self._reissue(self._resume)
        if not self.joined:
            # Catch-up: join the members' next round (its reduction goes on while we train);
            # this call's gradient is dropped, as in DiLoCo.
            self.joined = True
            self.drop_catch_up_forward()
            self.stale = True  # it contributes nothing (see DiLoCo.sync)
            self._issue(self._phase_delta())
            return
        self.optimizer.step()
        self.local_steps += 1
        self.since += 1
        if self.since >= self.sync_every:
            self._boundary()

    def _phase_delta(self) -> list[torch.Tensor]:
        return [as_started(s, p) - p.detach() for s, p in zip(self.start, self.params, strict=True)]

    def _boundary(self) -> None:
        delta = self._phase_delta()
        target = self.step_count
        if self.pipeline.in_flight:
            self._settle(target)
        else:
            self.global_step.fill_(target)
            self.since = 0
        self.remeasure(delta)
        self._issue(delta)

    def _settle(self, target: int, *, final: bool = False) -> None:
        s = self.pipeline.settle()
        self.apply_outer(s.result)
        if s.result is not None and s.result.exact is not None and self.buffers:
            self.buffers.land(s.result.exact)
        if s.resynced_late:
            self.buffers.restart()
        else:
            self.buffers.rebase(self._ref)
        self.outer_rounds += 1
        if s.resynced_late:
            # Our state was replaced by the retry: the local progress since it is void (the next
            # round we issue contributes nothing), and we continue at the members' step.
            self.stale = True
            if not final:
                target = int(s.tag)
        self.global_step.fill_(target)
        self.since = 0

    def _issue(self, delta: list[torch.Tensor]) -> None:
        stale = self.stale
        h = self.sync_every
        buffers = self.buffers
        snap: list[torch.Tensor] = []

        def build(rnd: Round | None) -> Planned:
            # after the previous round landed in the buffers (see the class docstring)
            snap[:] = buffers.snapshot()
            contribute = not stale and (rnd is None or not rnd.resynced)
            contribute = contribute and (not buffers or buffers.finite(snap))
            # read after begin: a joiner's counter was just received
            return Planned(
                items=list(zip(self.names, delta, strict=True)),
                contribute=contribute,
                exact=buffers.flat(snap) if buffers else None,
                tag=int(self.global_step) + h,
            )

        flight = self.pipeline.issue(build)
        self.stale = False
        self.since = 0
        self._restart(flight, delta, snap)

    def _restart(self, flight: Flight, delta: list[torch.Tensor] | None, snap: Any) -> None:
        """Start the next phase once ``flight`` was issued (see :meth:`restart`)."""
        contributors = flight.rnd.contributors if flight.rnd is not None else 1
        # A non-finite outer gradient is not sent (the reducer's policy); it must not steer this
        # peer's next start either: restart from the shared state instead.
        contributed = flight.plan.contribute
        own = delta if contributed and delta and all(map(all_finite, delta)) else None
        with torch.no_grad():
            self.restart(own, max(1, contributors))
            for p, s in zip(self.params, self.start, strict=True):
                p.copy_(s)
        if contributed:
            self._ref = list(snap)
        else:
            self.buffers.restart()
            self._ref = self.buffers.shared()

    def _finish(self) -> None:
        """Settle the round in flight and sync the last (partial) phase, blocking, so that every
        peer ends on the same global parameters (model included)."""
        if not self.joined:
            return
        self.steady.mark_end()
        target = self.step_count
        progressed = self.since > 0
        delta = self._phase_delta()
        if self.pipeline.in_flight:
            self._settle(target, final=True)
        self.remeasure(delta)
        if progressed:
            # Every member progressed alike (same step counter), so every member issues this
            # last round; one resynced by the settle above takes part without contributing.
            self._issue(delta)
            self._settle(target, final=True)
        with torch.no_grad():
            for p, s, g in zip(self.params, self.start, self.global_params, strict=True):
                s.copy_(g)
                p.copy_(g)
        self.buffers.restart()
        self.global_step.fill_(target)
        self.since = 0
        self.stale = False  # every peer now stands on theta: no local progress to void

    def apply_outer(self, result: Reduced | None) -> None:
        """Apply a committed mean outer gradient to the shared state (None: nobody contributed;
        leave it unchanged). Must do the same thing on every peer."""
        raise NotImplementedError

    def remeasure(self, delta: list[torch.Tensor]) -> None:
        """Called with this phase's outer gradient (``start - local``, in place) once the round
        in flight has landed in the shared state; the default leaves it as it is."""

    def restart(self, delta: list[torch.Tensor] | None, contributors: int) -> None:
        """Set :attr:`start` (under no_grad) for the next phase from the shared state and, when
        this peer contributed, its own fresh outer gradient ``delta``. The local parameters are
        then copied from it."""
        raise NotImplementedError

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _progress(self) -> dict[str, int]:
        return {
            **super()._progress(),
            "since": self.since,
            "joined": int(self.joined),
            "stale": int(self.stale),
            "outer_rounds": self.outer_rounds,
        }

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        self.since = int(progress["since"])
        self.joined = bool(progress["joined"])  # in step with the loaded state: no catch-up
        self.stale = bool(progress["stale"])
        self.outer_rounds = int(progress["outer_rounds"])

    def _local_tensors(self) -> dict[str, Any]:
        """The inner optimizer, the local model, the phase's start and the round in flight."""
        f = self.pipeline.flight
        flight: dict[str, Any] = {
            "present": int(f is not None),
            "contribute": int(f is not None and f.plan.contribute),
            "delta": {
                n: torch.zeros_like(g) for n, g in zip(self.names, self.global_params, strict=True)
            },
            "ref": dict(zip(self.buffers.names, self.buffers.shared(), strict=True)),
        }
        if self.buffers:
            flight["exact"] = torch.zeros(self.buffers.numel)
        if f is not None:
            flight["delta"].update(dict(f.plan.items))
            if self.buffers and f.plan.exact is not None:
                flight["exact"] = f.plan.exact
            if self._ref:
                flight["ref"] = dict(zip(self.buffers.names, self._ref, strict=True))
        return {
            **self._inner_local(),
            "start": dict(zip(self.names, self.start, strict=True)),
            "flight": flight,
        }

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        self._load_inner_local(state)
        load_tensors("start", dict(zip(self.names, self.start, strict=True)), state["start"])
        saved = state["flight"]
        self._resume = None
        if saved["present"]:
            self._resume = {
                "contribute": bool(saved["contribute"]),
                "delta": [saved["delta"][n].clone() for n in self.names],
                "exact": saved["exact"].clone() if self.buffers else None,
                "ref": [saved["ref"][n].clone() for n in self.buffers.names],
            }

    def _reissue(self, saved: dict[str, Any]) -> None:
        """Issue again the round a checkpoint caught in flight, with the snapshot it carried.
        The phase it started already began before the checkpoint (the loaded start and local
        parameters): a peer that still contributes keeps them, one resynced restarts."""
        self._resume = None
        h = self.sync_every

        def build(rnd: Round | None) -> Planned:
            return Planned(
                items=list(zip(self.names, saved["delta"], strict=True)),
                contribute=saved["contribute"] and (rnd is None or not rnd.resynced),
                exact=saved["exact"],
                tag=int(self.global_step) + h,
            )

        flight = self.pipeline.issue(build)
        if flight.plan.contribute:
            self._ref = saved["ref"]
        else:
            self._restart(flight, None, [])

    def metrics(self) -> dict[str, Any]:
        return {
            **super().metrics(),
            "outer_rounds": self.outer_rounds,
            "round_retries": self.pipeline.retries,
            "steady_overlap_fraction": round(self.steady.fraction, 4),
        }
