"""The delayed outer round of eager DiLoCo and CO2: round t is reduced while phase t+1 trains.

:class:`DelayedOuter` runs on the phased skeleton
(:class:`~isthmus.strategies.phased.PhasedStrategy`) and the round pipeline
(:class:`~isthmus.strategies.pipeline.RoundPipeline`: at most one round in flight, retried from
its snapshot on failure); a subclass gives its outer state and two rules, how a mean outer
gradient moves the shared state and where the next phase starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from isthmus.comm.session import Round, Session
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.model_state import SharedBuffers, as_started, load_tensors
from isthmus.strategies.outer_home import LocalView, OuterHome
from isthmus.strategies.phased import PhasedStrategy, nobody_trained
from isthmus.strategies.pipeline import Flight, Planned, RoundPipeline, SteadyOverlap
from isthmus.strategies.sharded import island_snapshot

__all__ = ["DelayedOuter"]


class DelayedOuter(PhasedStrategy):
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
        super().setup()
        self.sync_every = self.config.sync_every
        # theta, the start and the outer state where the config puts them (host or device)
        self.home = OuterHome.of(self, self.config.outer_state_device)
        self.global_params = [self.home.copy(p) for p in self.params]
        # Where this peer's current phase started (local): outer gradients are measured from it.
        self.start = [self.home.copy(p) for p in self.params]
        self.buffers = SharedBuffers(self.model_state.float_buffers, self.home.buffers_device)
        self._ref: list[torch.Tensor] = []  # the buffers the round in flight is measured from
        self.stale = False  # a retry resynced this peer: its next outer gradient must not count
        self.pipeline = RoundPipeline(self.session, self.reducer, lambda: self.step_count)
        self.steady = SteadyOverlap(self.reducer.timing)
        self.init_outer()
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

    def catch_up(self) -> None:
        """Join the members' next round (its reduction goes on while this peer trains),
        contributing nothing (see :meth:`DiLoCo.sync <isthmus.strategies.diloco.DiLoCo.sync>`)."""
        self.stale = True
        self._issue(self._phase_delta())

    def _phase_delta(self, local: LocalView | None = None) -> list[torch.Tensor]:
        """``start - local`` where the outer state lives (``local``: the local parameters as
        fetched there, :meth:`OuterHome.fetch`; fetched now by default)."""
        local = local or self.home.fetch(self.params)
        return [as_started(s, local[i]) - local[i] for i, s in enumerate(self.start)]

    def boundary(self) -> None:
        # The host copies of the local parameters start first (on CUDA on a side stream, the
        # training thread returning at once) and are read once the round in flight is settled:
        # the copies run while this thread waits for that round. Neither the settle nor the
        # outer step it applies writes the local parameters or the start they are measured from.
        local = self.home.fetch(self.params)
        target = self.step_count
        if self.pipeline.in_flight:
            self._settle(target)
        else:
            self.global_step.fill_(target)
            self.since = 0
        delta = self._phase_delta(local)
        self.remeasure(delta)
        self._issue(delta)

    def _settle(self, target: int, *, final: bool = False) -> None:
        self.home.settle()  # theta is written on the host below (the result, a repair)
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
        self.home.settle()  # the round's begin may repair theta on the host
        stale = self.stale
        h = self.sync_every
        buffers = self.buffers
        snap: list[torch.Tensor] = []

        def build(rnd: Round | None) -> Planned:
            # after the previous round landed in the buffers (see the class docstring)
            snap[:] = island_snapshot(self.session, buffers.snapshot())
            contribute = not stale and (rnd is None or not rnd.resynced)
            contribute = contribute and (not buffers or buffers.finite(snap))
            # read after begin: a joiner's counter was just received
            return Planned(
                items=list(zip(self.names, delta, strict=True)),
                contribute=contribute,
                exact=buffers.flat(snap) if buffers else None,
                tag=int(self.global_step) + h,
                placements=self.placements,
                # the run's first round is every member's catch-up: nobody sends anything
                idle=rnd is not None and nobody_trained(rnd),
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
        self.home.settle()  # the start is written on the host below
        with torch.no_grad():
            self.restart(own, max(1, contributors))
            for p, s in zip(self.params, self.start, strict=True):
                self.home.load(p, s)
        if contributed:
            self._ref = list(snap)
        else:
            self.buffers.restart()
            self._ref = self.buffers.shared()

    def final_round(self) -> None:
        """Settle the round in flight and sync the last (partial) phase, blocking, so that every
        peer ends on the same global parameters (model included)."""
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
        self.home.settle()
        with torch.no_grad():
            for p, s, g in zip(self.params, self.start, self.global_params, strict=True):
                s.copy_(g)
                self.home.load(p, g)
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
    def _progress(self) -> dict[str, float]:
        return {**super()._progress(), "stale": int(self.stale)}

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        self.stale = bool(progress["stale"])

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
            **super()._local_tensors(),
            "start": dict(zip(self.names, self.start, strict=True)),
            "flight": flight,
        }

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        super()._load_local_tensors(state)
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

    def reissue(self, saved: dict[str, Any]) -> None:
        """Issue again the round a checkpoint caught in flight, with the snapshot it carried.
        The phase it started already began before the checkpoint (the loaded start and local
        parameters): a peer that still contributes keeps them, one resynced restarts."""
        h = self.sync_every

        def build(rnd: Round | None) -> Planned:
            return Planned(
                items=list(zip(self.names, saved["delta"], strict=True)),
                contribute=saved["contribute"] and (rnd is None or not rnd.resynced),
                exact=saved["exact"],
                tag=int(self.global_step) + h,
                placements=self.placements,
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
