"""The skeleton of every strategy that trains in phases: inner steps alone, then a boundary.

DiLoCo, local SGD, Streaming DiLoCo, eager DiLoCo, CO2, SparseLoCo and gossip all run the same
loop; :class:`PhasedStrategy` owns it once, and each strategy says only what its own rule is::

    step():  check faults
             re-issue the round a loaded checkpoint caught in flight    (reissue)
             first step with a session: catch up with the run, drop this step's gradient
                                           (catch_up; or before it, by join())
             otherwise: one inner step                                  (inner_step)
                        a boundary if the phase is over                 (boundary_due, boundary)
    finish(): the last round of a peer that joined                      (final_round)

**Catch-up.** A peer's first round with a session comes before any inner step: a joiner
receives the run's state there instead of training from its own initialization, and at the
start of a run that round doubles as the parity check of the initial states. A loop that calls
:meth:`~isthmus.strategies.base.Strategy.join` before its first forward pass runs it there;
otherwise it is the first ``step()``, whose gradient is then dropped, and so is what its
forward pass added to the model's buffers
(:meth:`~isthmus.strategies.base.Strategy.drop_catch_up_forward`): one forward and backward
pass spent for nothing, the same round and the same bits either way. A one-peer run equals
its run without a session bit for bit. Without a session there is nobody to catch up with: the
first step trains. At the start of a run nobody has trained, and the first round reduces
nothing (:func:`nobody_trained`), decided alike by every member.

**Counters.** ``since`` counts the inner steps since the phase began and ``outer_rounds`` the
rounds applied; :attr:`step_count` is the shared step counter (advanced at boundaries) plus
``since``. ``joined`` says whether the catch-up round happened.

**Local state** (checkpoints): the counters above (those of :attr:`phase_counters`) with
``joined``, the user's optimizer state and the local model; a strategy adds its own. A peer
loaded with its local state is in step with the loaded shared state and skips the catch-up
round. A strategy that keeps a round in flight across steps stores it in :attr:`_resume` when
loading; the first ``step()`` after the load hands it to :meth:`reissue`.

**The reducer's state.** Whatever a round's reduction staged (error feedback, a compressor's
warm start) is kept when the round commits, by the session's commit hook that every strategy's
reducer is attached to (:meth:`~isthmus.reduce.reducer.Reducer.attach`): no strategy commits the
reducer itself, and an aborted attempt's state is discarded by the retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from isthmus.comm.session import Round
from isthmus.strategies.base import Strategy

__all__ = ["PhasedStrategy", "nobody_trained"]


def nobody_trained(rnd: Round) -> bool:
    """Whether no member of ``rnd`` can have local work to contribute, decided from the round's
    plan alone so that every member decides the same: the run's first round. No round has
    committed yet, so every member's first round is its catch-up round, before any inner step
    (a peer resumed with its local state is at its checkpoint's revision, never at round 0; a
    member that trained on the tentative result of an aborted first round is void and would
    contribute nothing either). Such a round still begins and commits (a joiner's repair, the
    parity check of the initial states, a checkpoint of its revision), but its reduction would
    carry only zeros and give the result of nobody's work (None: theta, the outer state and the
    buffers' global copy stay as they are), so a strategy for which that holds does not run it."""
    return rnd.number == 0


class PhasedStrategy(Strategy):
    """Base of the strategies that train in phases (see the module docstring).

    A subclass extends :meth:`setup` (calling this one first), implements :meth:`catch_up` and
    :meth:`boundary`, and overrides :meth:`inner_step`, :meth:`boundary_due`,
    :meth:`final_round` and :meth:`reissue` where its rule differs from the defaults.
    """

    phase_counters: ClassVar[tuple[str, ...]] = ("since", "outer_rounds")
    """The skeleton's counters that the strategy's checkpoints carry, with ``joined`` (gossip's
    rounds follow its step counter and carry none of them)."""

    def setup(self) -> None:
        self.since = 0
        """Inner steps since the phase began."""
        self.outer_rounds = 0
        """Rounds applied (the catch-up round included)."""
        self.joined = self.session is None
        """Whether the catch-up round happened (at once without a session)."""
        self._resume: dict[str, Any] | None = None
        """A round a loaded checkpoint caught in flight, re-issued by the next step."""
        # a fixed local-state structure from the start (checkpoints load into a template)
        self._materialize_inner()

    @property
    def step_count(self) -> int:
        return int(self.global_step) + self.since

    # -- the loop ---------------------------------------------------------------------------------
    def _step(self, *args: Any, **kwargs: Any) -> None:
        self.check_faults("step")
        if self._resume is not None:
            saved, self._resume = self._resume, None
            self.reissue(saved)
        if not self.joined:
            self.joined = True
            self.drop_catch_up_forward()
            self.catch_up()  # this call's gradient is dropped
            return
        if not self.inner_step(*args, **kwargs):
            return
        self.local_steps += 1
        self.since += 1
        if self.boundary_due():
            self.boundary()

    def join(self) -> None:
        """Run the catch-up round that this peer's first ``step()`` would be, now, before the
        first forward pass, so that no forward and backward pass is spent on a step whose
        gradient is dropped: the same round with the same bits, followed by what follows a
        step (a pipelined round's vote, a checkpoint due); the next ``step()`` trains.
        Optional: a loop without it catches up at its first ``step()``. Does nothing without a
        session and for a peer that joined already (a second call, a peer loaded with its local
        state, a call after the first step). Raises what the round raises (see
        :meth:`Session.run_round <isthmus.comm.session.Session.run_round>`)."""
        if self.joined:
            return
        self.check_faults("step")  # as the first step would, before its catch-up round
        self.joined = True
        # no forward pass ran for this round: nothing to take back from the buffers
        self._built_buffers = []
        self.catch_up()
        self._after_step()

    def inner_step(self, *args: Any, **kwargs: Any) -> bool:
        """One step on this peer alone (default: the user's optimizer steps); False when the
        call was not a whole step (gossip's first half of a SAM step), which then advances no
        counter and ends no phase."""
        self.optimizer.step()
        return True

    def boundary_due(self) -> bool:
        """Whether the inner step just taken ends a phase (default: ``sync_every`` of them)."""
        return self.since >= self.config.sync_every

    def catch_up(self) -> None:
        """The first step's round with a session: join the run (see the module docstring)."""
        raise NotImplementedError

    def boundary(self) -> None:
        """The strategy's round(s) at the end of a phase."""
        raise NotImplementedError

    def reissue(self, saved: dict[str, Any]) -> None:
        """Issue again the round a checkpoint caught in flight (:attr:`_resume`, as the
        strategy's :meth:`_load_local_tensors` stored it)."""
        raise NotImplementedError

    def _finish(self) -> None:
        if self.joined:
            self.final_round()

    def final_round(self) -> None:
        """At :meth:`finish`, for a peer that joined: sync what is left so every peer ends on
        the shared state (default: nothing)."""

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _progress(self) -> dict[str, float]:
        out: dict[str, float] = super()._progress()
        if "since" in self.phase_counters:
            out["since"] = self.since
        out["joined"] = int(self.joined)
        if "outer_rounds" in self.phase_counters:
            out["outer_rounds"] = self.outer_rounds
        return out

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        if "since" in self.phase_counters:
            self.since = int(progress["since"])
        # A peer with its local state is in step with the loaded shared state: no catch-up round
        # (DiLoCo's would apply the outer momentum to a zero outer gradient and change theta).
        self.joined = bool(progress["joined"])
        if "outer_rounds" in self.phase_counters:
            self.outer_rounds = int(progress["outer_rounds"])

    def _local_tensors(self) -> dict[str, Any]:
        """The user's optimizer state and the local model (parameters and floating buffers)."""
        return self._inner_local()

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        self._load_inner_local(state)
