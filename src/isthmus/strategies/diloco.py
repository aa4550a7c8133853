"""DiLoCo: Distributed Low-Communication training of language models.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105 (2023).

Every peer runs ``sync_every`` (H) inner optimizer steps on its own data, starting from the
shared global parameters theta. Then one round: each peer's *outer gradient* (pseudo-gradient)
delta_i = theta - theta_i is averaged across peers, and an outer optimizer (SGD with Nesterov
momentum, lr 0.7, momentum 0.9 in the paper) applies the mean to theta. Every peer then restarts
from the new theta. One round every H steps instead of one every step: communication drops by a
factor of about H against data parallel.

Shared state: the global parameters theta, the outer optimizer's momentum and the step counter.
The inner optimizer's state and the local parameters belong to each peer.

On failure: if a peer dies during the outer all-reduce, the survivors re-form and reduce their
outer gradients again; their H inner steps of local progress are kept (the outer gradient is
recomputed from the unchanged local parameters). A resynced peer contributes nothing to that
round (its local parameters did not start from theta) and restarts from the new theta.

Joining: a peer's first round is a catch-up round before any inner step, run by
:meth:`~isthmus.strategies.base.Strategy.join` before the first forward pass, or else by the
first ``step()`` (whose gradient is then dropped). A joiner thus waits for the members' next
outer round, receives theta, and starts from it instead of training from its own initialization.
At the start of a run this first round is the parity check of the initial states (and a joiner's
repair); nobody has trained, so it reduces nothing
(:func:`~isthmus.strategies.phased.nobody_trained`) and leaves theta as it is. The step counter
advances by the mean of the contributors' inner-step counts, which rides in the same all-reduce,
so every peer agrees on it.

**Heterogeneous peers.** Outer gradients are weighted by the tokens each peer
processed in the phase (``step(tokens=n)``; by default one per inner step, so inner steps count
when batches are equal): the reducer's ``weight`` is tokens per inner step with a step budget
(every contributor ran the same steps; exactly 1 by default, so a run of equal peers keeps its
bits) and ``tokens / H`` with a time budget. With ``inner_budget="time"`` a
phase ends at a deadline instead of after H steps: ``phase_seconds`` after the phase began when
that is set, otherwise when the fastest peer of the last round would have done H steps (each
round all-gathers every member's inner-step rate and count; a peer also stops at H). A peer half
as fast does half the steps instead of making everyone wait; its outer gradient counts for half.
The step counter then advances by the largest count of the round, so that every peer agrees
when the run is over. Each peer's inner steps per phase are in :meth:`metrics`
(``phase_steps``).

**Islands.** Each rank runs these rules on its shards (see :mod:`isthmus.strategies.sharded`):
an island contributes as one, with the mean of its ranks' weights; with a time budget its
leader's clock ends the island's phase (a broadcast inside the island after every inner step),
and the round's table holds each island's leader's rate and count.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from isthmus.comm.session import Round
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.base import outer_sgd, register_optimizer
from isthmus.strategies.model_state import SharedBuffers, as_started
from isthmus.strategies.outer_home import OuterDevice, OuterHome, check_outer_device
from isthmus.strategies.phased import PhasedStrategy, nobody_trained
from isthmus.strategies.sharded import island_snapshot, island_vote, start_reduction

__all__ = ["DiLoCo", "DiLoCoConfig"]

log = logging.getLogger("isthmus.diloco")


@dataclass(kw_only=True)
class DiLoCoConfig:
    sync_every: int = 20
    """H: inner steps between outer rounds (the default is the best of a search,
    docs/BENCHMARKS.md; the paper uses 500 on far larger models, where each inner step costs
    more and fewer rounds save more bytes)."""
    outer_lr: float = 0.7
    """Outer learning rate (paper: 0.7)."""
    outer_momentum: float = 0.9
    """Outer momentum (paper: 0.9)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (paper: yes)."""
    inner_budget: Literal["steps", "time"] = "steps"
    """What ends an inner phase: H steps (``steps``), or a deadline shared by the peers
    (``time``: see the module docstring), so that slow peers do fewer steps."""
    phase_seconds: float = 0.0
    """With ``inner_budget="time"``: the phase's length in seconds (0: as long as the fastest
    peer of the last round takes for H steps)."""
    outer_state_device: OuterDevice = "auto"
    """Where the outer state (theta, the outer momentum, the buffers' global copy) lives:
    ``cpu``, in host memory (a CUDA model's devices then hold only its shards and the inner
    optimizer; the outer gradient is taken and reduced from pinned host copies, over Gloo);
    ``same``, beside the model on its device (for NCCL across islands); ``auto``: ``cpu``,
    or ``same`` when the session's backend is ``nccl``. The same bits on a CPU model
    (:mod:`isthmus.strategies.outer_home`)."""
    time_budget: ClassVar[bool] = True
    """Whether the strategy implements ``inner_budget="time"`` (a subclass that does not sets
    False, so that the option is refused rather than ignored)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.inner_budget not in ("steps", "time"):
            raise ValueError(f"inner_budget must be 'steps' or 'time', got {self.inner_budget!r}")
        if self.inner_budget == "time" and not self.time_budget:
            raise ValueError(
                f"{type(self).__name__} has no time budget yet: use inner_budget='steps'"
            )
        if not (math.isfinite(self.phase_seconds) and self.phase_seconds >= 0):
            raise ValueError(f"phase_seconds must be >= 0, got {self.phase_seconds}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        check_outer_device(self.outer_state_device)


class DiLoCo(PhasedStrategy):
    """DiLoCo around the user's inner optimizer. Call :meth:`step` after every backward."""

    name = "diloco"
    Config = DiLoCoConfig
    config: DiLoCoConfig
    islands = ""  # every rule is elementwise: each rank of an island runs it on its shards

    def setup(self) -> None:
        super().setup()
        cfg = self.config
        self.home = OuterHome.of(self, cfg.outer_state_device)
        self.global_params = [self.home.copy(p) for p in self.params]
        self.outer = outer_sgd(self.global_params, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
        self.buffers = SharedBuffers(self.model_state.float_buffers, self.home.buffers_device)
        self.phase_tokens = 0.0
        self.phase_steps: list[int] = []
        """This peer's inner steps in each phase it synced (the last 1,000)."""
        self._phase_start = time.monotonic()
        self._fastest = 0.0  # the fastest member's inner steps per second in the last round
        self.share_model(self.global_params, "global", self.buffers)
        if self.session is not None:
            register_optimizer(self.session, "outer", self.outer, self.placements)
            self._register_counter()

    def _step(self, tokens: float = 1.0) -> None:
        """One inner step that processed ``tokens`` (the outer gradient's weight; by default
        one per step). Raises ValueError for a negative or non-finite count."""
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens}")
        super()._step(tokens)

    def catch_up(self) -> None:
        self.sync(catch_up=True)
        self._phase_start = time.monotonic()

    def inner_step(self, tokens: float = 1.0) -> bool:
        # the copies of theta into the model (issued by the last round) are done before the
        # training thread goes on: nothing may write host theta under them (an undone round's
        # restore, a repair) between rounds
        self.home.settle()
        self.optimizer.step()
        self.phase_tokens += tokens
        return True

    def boundary_due(self) -> bool:
        due = self.since >= self.config.sync_every or self._past_deadline()
        island = getattr(self.session, "island", None)
        if island is not None and self.config.inner_budget == "time":
            # every rank of an island must end its phase at the same step: its leader's clock
            due = bool(island.broadcast(due))
        return due

    def boundary(self) -> None:
        self.sync()
        self._phase_start = time.monotonic()

    def _past_deadline(self) -> bool:
        cfg = self.config
        if cfg.inner_budget != "time":
            return False
        if cfg.phase_seconds > 0:
            length = cfg.phase_seconds
        elif self._fastest > 0:
            length = cfg.sync_every / self._fastest
        else:
            return False  # no rate measured yet (the first phase): H steps
        return time.monotonic() - self._phase_start >= length

    def outer_gradient(self) -> list[torch.Tensor]:
        """delta = theta_global - theta_local, per parameter (fresh tensors, in theta's dtype;
        measured from theta as the model received it, see the module docstring), where the
        outer state lives (from host copies of the local parameters with ``cpu``)."""
        local = self.home.fetch(self.params)
        return [as_started(g, local[i]) - local[i] for i, g in enumerate(self.global_params)]

    def sync(self, *, catch_up: bool = False) -> None:
        """One outer round: average the outer gradients (and the floating buffers, with the
        step count), apply the outer step, restart from theta. A ``catch_up`` round contributes
        nothing: this peer has no work yet, and its parameters may not have started from theta
        (a peer resumed without its local state); at the start of a run nobody contributes, which
        leaves theta as a zero outer gradient would."""
        self.home.settle()  # the round may write theta on the host (its result, a repair)
        snap = island_snapshot(self.session, self.buffers.snapshot())
        # beside the outer state (the buffers' snapshot is there: one device for the cat)
        where = self.global_params[0].device if self.global_params else None
        steps = torch.tensor([float(self.since)], device=where)
        if self.buffers:
            steps = torch.cat([steps, self.buffers.flat(snap)])
        if not catch_up:
            self.phase_steps = [*self.phase_steps[-999:], self.since]
            log.debug("phase of %d inner steps (%g tokens)", self.since, self.phase_tokens)
        # The outer gradient's weight. With a step budget every contributor ran the same number
        # of steps, so tokens per step carry the weighting (exactly 1 with unit steps: a run of
        # equal peers keeps its bits); with a time budget, tokens over H.
        timed = self.config.inner_budget == "time"
        weight = self.phase_tokens / (self.config.sync_every if timed else max(1, self.since))
        elapsed = time.monotonic() - self._phase_start
        rate = self.since / elapsed if elapsed > 0 and not catch_up else 0.0
        gathered: list[torch.Tensor] = []
        if self.session is None:
            delta = self.outer_gradient()
            result: Reduced | None = Reduced(delta, steps, 1)
            if not all(map(all_finite, delta)) or not self.buffers.finite(snap):
                # the reducer's policy, applied to the peer alone: a non-finite update is
                # dropped (theta stays as it was) and the peer restarts from theta
                self.reducer.nonfinite_skips += 1
                log.warning("non-finite values in this peer's outer gradient: not applying it")
                result = None
        else:
            reducer, buffers = self.reducer, self.buffers

            def reduce(rnd: Round) -> Reduced | None:
                if nobody_trained(rnd):
                    # every member decides this from the plan alike: no collective at all, and
                    # the result a reduction of nobody's work gives (theta unchanged)
                    return None
                items = list(zip(self.names, self.outer_gradient(), strict=True))
                ok = not catch_up and not rnd.resynced and buffers.finite(snap)
                # an island decides as one (before the table below, which reads the decision)
                ok, w = island_vote(rnd, items, ok, weight)
                if timed:
                    # before the reducer's collectives, from this thread: the same order on
                    # every member
                    mine = torch.tensor([rate, float(self.since)] if ok else [0.0, 0.0])
                    gathered[:] = [self._rates(rnd, mine)]
                pending = start_reduction(
                    reducer, rnd, items, self.placements, contribute=ok, exact=steps, weight=w,
                    agreed=True,
                )  # fmt: skip
                rnd.check_faults("collective", step=self.step_count)
                return pending.wait()

            if self.checkpointer is not None:
                # the round may write the shared state (a repair as it begins, its result):
                # the copy a checkpoint is making of it on its writer thread must be done first
                self.checkpointer.settle()
            # the round moves the inner steps into the shared counter: step_count stays
            result = self.session.run_round(
                reduce, **self.round_options(step_after=self.step_count)
            )
            if gathered:
                table = gathered[0].view(-1, 2)
                self._fastest = float(table[:, 0].max())
                if result is not None and result.exact is not None:
                    # every peer ends the run together: the counter takes the largest count
                    result.exact[0] = table[:, 1].max()
        self.phase_tokens = 0.0
        self.apply_outer(result)

    def _rates(self, rnd: Round, mine: torch.Tensor) -> torch.Tensor:
        """Every member's ``[rate, inner steps]`` (a time budget's table), the same on every
        rank: on an island, the leaders gather theirs in the group all islands' rank 0 share
        (their primary group: it always holds the tuple of owners ``(0, ..., 0)``) and tell
        their followers, so that the island's phases end on its leader's clock."""
        # where the round's reductions are: the outer state's device
        device = self.global_params[0].device if self.global_params else torch.device("cpu")
        island = getattr(self.session, "island", None)
        if island is None:
            return rnd.group.all_gather_flat(mine.to(device)).cpu()
        table = rnd.group.all_gather_flat(mine.to(device)).cpu() if island.leader else None
        return island.broadcast(table)  # type: ignore[no-any-return]

    def pipelines_rounds(self) -> bool:
        """Whether an outer round may be applied before its verdict (``pipeline_commit``):
        inner steps write only local copies, so only rounds write the shared state, unless the
        model has integer buffers (shared as they are, moved by every forward pass)."""
        return not self.model_state.other_buffers

    def round_written_shared(self) -> set[str]:
        """The shared tensors only rounds write (the outer round's result, a repair, a
        restore): the global model and buffers, the outer optimizer's state and the step
        counter. Inner steps touch only local copies, so a checkpoint may copy these on its
        writer thread while training goes on (:mod:`isthmus.checkpoint.save`); :meth:`sync`
        waits for that copy before it runs a round."""
        if self.session is None:
            return set()
        names = {*self.held_by.values(), "meta/step"}
        names.update(n for n, _ in self.session.state.items() if n.startswith("outer/"))
        return names

    def step_written_local(self, settle: Callable[[], None]) -> Callable[[tuple[Any, ...]], bool]:
        """Which tensors of :meth:`local_state` only the inner optimizer's ``step()`` writes
        (its state, and the trainable parameters; not the floating buffers, which a forward pass
        writes), so that a checkpoint may copy them on its writer thread; ``settle`` (which
        waits for that copy) runs before every step of the inner optimizer from now on."""
        self.optimizer.register_step_pre_hook(lambda *_: settle())
        trainable = set(self.names)

        def stepped(path: tuple[Any, ...]) -> bool:
            # the optimizer's state, not its param groups: a scheduler writes those (a tensor lr
            # in place) between steps
            return path[:2] == ("optimizer", "state") or (
                path[0] == "model" and path[1] in trainable
            )

        return stepped

    def apply_outer(self, result: Reduced | None) -> None:
        """Apply a committed reduction (mean outer gradients, mean inner-step count and mean
        buffers); None means nobody contributed and theta is unchanged. Every peer restarts
        from theta and the buffers' global copy."""
        if result is not None:
            self._outer_update(result.tensors)
            assert result.exact is not None
            self.global_step += round(float(result.exact[0]))
            if self.buffers:
                self.buffers.land(result.exact[1:])
        for p, g in zip(self.params, self.global_params, strict=True):
            self.home.load(p, g)
        self.buffers.restart()
        self.since = 0
        self.outer_rounds += 1

    def _outer_update(self, mean: list[torch.Tensor]) -> None:
        """theta <- the outer optimizer's step on the mean outer gradients (fp32, one per
        parameter). A subclass with another outer rule overrides this alone."""
        for g, d in zip(self.global_params, mean, strict=True):
            g.grad = d.to(g.dtype)  # the reduction is fp32; the model may not be
        self.outer.step()

    def metrics(self) -> dict[str, Any]:
        return {
            **super().metrics(),
            "inner_budget": self.config.inner_budget,
            "phase_steps": list(self.phase_steps),
        }

    def final_round(self) -> None:
        """Sync the inner steps done since the last outer round, so the run ends on theta."""
        if self.since > 0:
            self.sync()

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _progress(self) -> dict[str, float]:
        # the outer gradient's weight is phase_tokens / since: without it a peer resumed in the
        # middle of a phase would weigh its next outer gradient differently
        return {**super()._progress(), "phase_tokens": self.phase_tokens}

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        # a checkpoint without a token count: one token per inner step, the default
        self.phase_tokens = float(progress.get("phase_tokens", self.since))
