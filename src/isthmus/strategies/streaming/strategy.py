"""Streaming DiLoCo: sync one fragment of the model at a time, overlapped with training.

Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy, Shen, Ramé, Szlam,
Ranzato, Barham, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch", arXiv:2501.18512 (2025).

DiLoCo (:mod:`isthmus.strategies.diloco`) all-reduces the whole model's outer gradient every H
steps, so its peak bandwidth is one model every H steps. Streaming DiLoCo splits the parameters
into P **fragments** and syncs one fragment every H/P steps, staggered, so that every fragment is
still synced once per H steps but one sync moves about 1/P of the model:

* **Fragments** (:func:`assign_fragments`): parameters are grouped by the numbered layer their
  name contains (``blocks.3.mlp.fc.weight`` is layer 3). ``strided`` puts layers j, j+P, j+2P, ...
  in fragment j (the paper found it slightly better); ``sequential`` cuts the layers into P
  contiguous blocks. Parameters outside any numbered layer (a GPT's token and position
  embeddings, the tied head, the final LayerNorm) all go to fragment ``nonlayer_fragment``
  (default 0), which is therefore the largest: one sync moves more than 1/P of the model.
  ``balanced`` (an isthmus
  addition, not in the paper) packs whole tensors into fragments of about equal size instead,
  for the smallest peak. A custom ``fragment_of(name) -> int`` may replace the rule.
* **Schedule** (:func:`fragment_for_round`): the fragment a round syncs is ``round % P``, where
  ``round`` is the committed round number (the run's revision), which every peer agrees on, also
  after aborts (a retried round keeps its number, so its fragment) and joins.
* **Overlap** (``overlap`` = tau): a fragment's outer gradient ``theta_f - x_f`` is snapshotted
  and its all-reduce started tau inner steps before it is applied; training goes on meanwhile.
  Syncs are applied at steps H/P, 2H/P, ... and issued tau steps earlier (tau < H/P, so at most
  one round is in flight).
* **Mixing** (``alpha``): once the mean arrives, the outer optimizer (Nesterov SGD as in DiLoCo)
  updates theta_f, and the local fragment becomes ``(1 - alpha) theta_f + alpha x_f``; alpha = 0
  restarts the fragment from theta_f (DiLoCo's rule). The default is 0, the better of the two on
  long runs (docs/BENCHMARKS.md); the paper's 0.5 can do better on short ones.

With ``fragments=1``, ``overlap=0`` and ``alpha=0`` this is DiLoCo bit for bit (same shared
state, same operations in the same order).

The paper's 4-bit outer gradients are available through the reducer (``compression="e3m0"``).
SparseLoCo (:mod:`isthmus.strategies.sparseloco`) runs on this skeleton with its own outer rule
and its own exchange per fragment (:meth:`StreamingDiLoCo._planned`).

Shared state (same names as DiLoCo): theta for every fragment, the buffers' global copy, the
frozen parameters and integer buffers, the outer momentum, the step counter (the step at which
the last round was applied). Mixed precision as in DiLoCo (fp32 theta for bf16/fp16 models).

Buffers: every fragment round carries *all* the floating buffers (they are small), snapshotted
when the round is issued, in the reducer's ``exact`` values with the apply step (an fp32 sum,
never compressed or robustly aggregated); the contributors' mean becomes the global copy. The
model's buffers then take that mean plus what their own forward passes added during the tau
overlapped steps (:meth:`~isthmus.strategies.base.SharedBuffers.rebase`; with tau = 0, or for a
joiner or a repaired peer, simply the mean), so no step's statistics are lost and one peer's
buffers are those of plain training. Integer buffers are kept equal by the parity check.

Joining: a joiner's first ``step()`` waits for the members' next round (a fragment sync),
receives the state as of the last commit, takes part in the reduction without contributing,
blocks until the round commits (it does not train during the tau overlapped steps), applies the
fragment's update like the members and restarts its whole model from theta. It learns the step at
which the round was applied from the reduction's exact values, so it continues in step.

On failure: see :mod:`isthmus.strategies.pipeline`. A peer dying while a fragment's all-reduce is
in flight aborts that round for everyone; the survivors reduce the fragment's snapshot (taken at
issue) again, blocking, and apply it; the tau inner steps taken meanwhile stay in the local
parameters (mixed by alpha like any overlapped step). A peer resynced by a retry restarts its
whole model from theta. A non-finite update contributes nothing that round.

At :meth:`finish`, the fragments with unsynced progress are synced one round each (so the peak
bytes per round stay those of one fragment) and every peer ends on theta.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isthmus.comm.session import Round
from isthmus.strategies.base import outer_sgd, register_optimizer
from isthmus.strategies.diloco import DiLoCoConfig
from isthmus.strategies.model_state import SharedBuffers, as_started
from isthmus.strategies.outer_home import OuterHome
from isthmus.strategies.phased import PhasedStrategy, nobody_trained
from isthmus.strategies.pipeline import Planned, RoundPipeline, SteadyOverlap
from isthmus.strategies.sharded import island_snapshot
from isthmus.strategies.streaming.math import (
    PATTERNS,
    Pattern,
    assign_fragments,
    fragment_for_round,
)

__all__ = ["StreamingConfig", "StreamingDiLoCo"]


@dataclass(kw_only=True)
class StreamingConfig(DiLoCoConfig):
    """DiLoCo's outer settings, and how the model is cut into fragments synced in turn."""

    time_budget: ClassVar[bool] = False  # inner_budget="time" is DiLoCo's and local SGD's

    sync_every: int = 20
    """H: each fragment is synced once every H inner steps (DiLoCo's default)."""
    fragments: int = 2
    """P: number of fragments; one is synced every H/P steps. H must be a multiple of P."""
    pattern: Pattern = "strided"
    """``strided`` (layers j, j+P, ...), ``sequential`` (contiguous blocks of layers) or
    ``balanced`` (whole tensors packed into P fragments of about equal size)."""
    overlap: int = 1
    """tau: inner steps between starting a fragment's all-reduce and applying it (< H/P)."""
    alpha: float = 0.0
    """Mixing: local fragment <- (1 - alpha) theta_f + alpha x_f after its sync (0: DiLoCo's
    restart from theta_f). The paper uses 0 and 0.5; mixing keeps part of each replica's drift,
    which helps short runs and costs once the replicas should agree (docs/BENCHMARKS.md)."""
    nonlayer_fragment: int = 0
    """The fragment that holds every parameter outside numbered layers (embeddings, norms)."""

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"fragments (P) must be >= 1, got {self.fragments}")
        if self.sync_every < 1 or self.sync_every % self.fragments:
            raise ValueError(
                f"sync_every (H={self.sync_every}) must be a positive multiple of fragments "
                f"(P={self.fragments}) so that a fragment syncs every H/P steps"
            )
        if not 0 <= self.overlap < self.interval:
            raise ValueError(
                f"overlap (tau={self.overlap}) must be in 0..{self.interval - 1} (below H/P = "
                f"{self.interval}, so that one fragment's sync ends before the next starts)"
            )
        if not 0 <= self.alpha < 1:
            raise ValueError(f"alpha must be in [0, 1) (0 restarts from theta), got {self.alpha}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")
        if not 0 <= self.nonlayer_fragment < self.fragments:
            raise ValueError(
                f"nonlayer_fragment must be in 0..{self.fragments - 1}, got {self.nonlayer_fragment}"
            )
        super().__post_init__()  # the outer settings, checked last as they always were

    @property
    def interval(self) -> int:
        """H/P: inner steps between two fragment syncs."""
        return self.sync_every // self.fragments


@dataclass(frozen=True)
class _Sync:
    fragment: int
    apply_step: int
    base: int
    """The shared step counter when the round was built: the exact values carry
    ``apply_step - base`` (a few steps), which float32 holds exactly however long the run."""
    ref: tuple[torch.Tensor, ...] | None = None
    """The buffer snapshot this round carries (None: this peer contributes nothing)."""


class StreamingDiLoCo(PhasedStrategy):
    """Streaming DiLoCo around the user's inner optimizer. Call :meth:`step` after every
    backward and :meth:`finish` once at the end."""

    name = "streaming"
    Config = StreamingConfig
    config: StreamingConfig
    islands = ""  # fragments are whole tensors, each rank syncs its shards of them

    def __init__(
        self, *args: Any, fragment_of: Callable[[str], int] | None = None, **kwargs: Any
    ) -> None:
        """As :class:`~isthmus.strategies.base.Strategy`, plus ``fragment_of(name) -> fragment``,
        a custom rule for which fragment a parameter belongs to (see :func:`assign_fragments`,
        which also says what raises)."""
        self.fragment_of = fragment_of
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        super().setup()
        cfg, session = self.config, self.session
        self.fragments = assign_fragments(
            self.names,
            cfg.fragments,
            pattern=cfg.pattern,
            nonlayer_fragment=cfg.nonlayer_fragment,
            fragment_of=self.fragment_of,
            # the full tensors' sizes: every rank of every island must cut the same fragments
            sizes=[p.numel() if x is None else x.numel_full
                   for p, x in zip(self.params, self.placements, strict=True)],
        )  # fmt: skip
        self.home = OuterHome.of(self, cfg.outer_state_device)
        self.global_params = [self.home.copy(p) for p in self.params]
        self.outer = outer_sgd(self.global_params, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
        self.buffers = SharedBuffers(self.model_state.float_buffers, self.home.buffers_device)
        # (step, fragment) of every applied round, in order: the schedule as it happened
        self.sync_log: list[tuple[int, int]] = []
        self.pipeline = RoundPipeline(session, self.reducer, lambda: self.step_count)
        self.steady = SteadyOverlap(self.reducer.timing)
        # The same names as DiLoCo: with P=1, tau=0 the two share state bit for bit.
        self.share_model(self.global_params, "global", self.buffers)
        if session is not None:
            register_optimizer(session, "outer", self.outer, self.placements)
            self._register_counter()

    def fragment_sizes(self) -> list[int]:
        """Elements per fragment (what one sync moves, before compression)."""
        return [sum(self.params[i].numel() for i in idx) for idx in self.fragments]

    def catch_up(self) -> None:
        """A blocking round: a joiner receives theta and the members' step; at the start of a
        run it is fragment 0's round and reduces nothing, exactly like DiLoCo's."""
        self._issue(self.step_count, catch_up=True)
        self._settle()
        self.steady.mark_start()  # the catch-up round blocks by design

    def _lands(self, step: int) -> bool:
        """Whether the round in flight is applied at ``step``."""
        flight = self.pipeline.flight
        return flight is not None and step >= flight.plan.tag.apply_step

    def _starts(self, step: int) -> bool:
        """Whether a fragment's round is issued at ``step`` (tau steps before it is applied)."""
        return (step + self.config.overlap) % self.config.interval == 0

    def boundary_due(self) -> bool:
        s = self.step_count
        return self._lands(s) or self._starts(s)

    def boundary(self) -> None:
        """Settle the round in flight if it is due, then issue the next fragment's round if one
        starts here (and settle it at once when nothing overlaps it)."""
        s = self.step_count
        if self._lands(s):
            self._settle()
        tau = self.config.overlap
        if self.pipeline.flight is None and self._starts(s):
            self._issue(s + tau)
            if tau == 0:
                self._settle()

    def _issue(self, apply_step: int, *, catch_up: bool = False) -> None:
        self.home.settle()  # the round's begin may repair theta on the host

        # a catch-up round contributes nothing (see DiLoCo.sync)
        def build(rnd: Round | None) -> Planned:
            number = rnd.number if rnd is not None else self.pipeline.next_number()
            frag = fragment_for_round(number, self.config.fragments)
            idx = self.fragments[frag]
            # the fragment's local parameters where the outer state is (host copies, each
            # fragment in buffers of its own, read tensor by tensor as their copies land)
            local = self.home.fetch([self.params[i] for i in idx], slot=f"fragment{frag}")
            base = int(self.global_step)  # read after begin: a joiner's was just received
            snap = island_snapshot(self.session, self.buffers.snapshot())
            ok = (
                not catch_up
                and (rnd is None or not rnd.resynced)
                and (not self.buffers or self.buffers.finite(snap))
            )
            flat = self.buffers.flat(snap)  # the step rides beside it, on its device
            plan = Planned(
                items=[
                    (self.names[i], as_started(self.global_params[i], local[k]) - local[k])
                    for k, i in enumerate(idx)
                ],
                contribute=ok,
                exact=torch.cat(
                    [torch.tensor([float(apply_step - base)], device=flat.device), flat]
                ),
                tag=_Sync(frag, apply_step, base, tuple(snap) if ok else None),
                placements=[self.placements[i] for i in idx],
                # the run's first round: every member is in its catch-up round (no fragment's
                # outer gradient, no outer momentum step, no error feedback to carry)
                idle=rnd is not None and nobody_trained(rnd),
            )
            return self._planned(frag, plan)

        self.pipeline.issue(build)

    def _planned(self, fragment: int, plan: Planned) -> Planned:
        """A fragment's round as planned (its outer gradient, contribution, exact values), before
        it starts; also for a retry that rebuilds it and a round re-issued from a checkpoint.
        Here it is averaged by the reducer as it is; SparseLoCo gives it its own exchange."""
        return plan

    def _outer_update(self, idx: Sequence[int], mean: Sequence[torch.Tensor]) -> None:
        """theta_f <- the outer optimizer's step on fragment ``idx``'s mean outer gradients (fp32,
        one per parameter). A subclass with another outer rule overrides this alone."""
        for g in self.global_params:
            g.grad = None
        for i, d in zip(idx, mean, strict=True):
            self.global_params[i].grad = d.to(self.global_params[i].dtype)
        self.outer.step()

    def _settle(self, final_step: int | None = None) -> None:
        self.home.settle()  # theta is written on the host below (the result, a repair)
        s = self.pipeline.settle()
        tag: _Sync = s.tag
        idx = self.fragments[tag.fragment]
        result = s.result
        step_at = tag.apply_step
        if result is not None:
            self._outer_update(idx, result.tensors)
            if result.exact is not None:
                # the contributors' apply step: what a joiner needs to continue in step
                step_at = tag.base + round(float(result.exact[0]))
                if self.buffers:
                    self.buffers.land(result.exact[1:])
        if final_step is not None:
            step_at = final_step
        self.global_step.fill_(step_at)
        self.since = 0
        alpha = self.config.alpha
        with torch.no_grad():
            if s.resynced_at_issue or s.resynced_late:
                # A joiner or a repaired peer: none of its local parameters can be trusted.
                for p, g in zip(self.params, self.global_params, strict=True):
                    self.home.load(p, g)
                self.buffers.restart()
            elif alpha == 0:
                for i in idx:
                    self.home.load(self.params[i], self.global_params[i])
            else:
                for i in idx:
                    p = self.params[i]
                    p.mul_(alpha).add_(
                        self.home.on_model(self.global_params[i], p), alpha=1 - alpha
                    )
        if not (s.resynced_at_issue or s.resynced_late):
            if tag.ref is None:
                self.buffers.restart()
            else:
                self.buffers.rebase(tag.ref)
        self.outer_rounds += 1
        self.sync_log.append((step_at, tag.fragment))

    def final_round(self) -> None:
        """Settle the sync in flight, then sync every fragment that has progress not yet synced
        (one round each), and end on theta (model included) on every peer. The fragment whose
        round was in flight is treated as every round treats it: the steps taken after its issue
        are mixed by ``alpha`` when it lands (dropped with alpha 0), not sent again; so with
        ``overlap`` > 0 a run's last (up to) tau steps of that fragment do not reach theta."""
        self.steady.mark_end()
        target = self.step_count
        just_synced = self.since == 0 and self.outer_rounds > 0
        if self.pipeline.in_flight:
            self._settle(final_step=target)
            just_synced = True
        todo = self.config.fragments - 1 if just_synced else self.config.fragments
        for _ in range(todo):
            self._issue(target)
            self._settle(final_step=target)
        self.home.settle()
        for p, g in zip(self.params, self.global_params, strict=True):
            self.home.load(p, g)
        self.buffers.restart()

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _progress(self) -> dict[str, float]:
        return {**super()._progress(), "rounds": self.pipeline.rounds}

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        self.pipeline.rounds = int(progress["rounds"])

    def _local_tensors(self) -> dict[str, Any]:
        """The inner optimizer, the local model and the round in flight, if any (its snapshot:
        re-issued by the first :meth:`step` after loading, as it would have been reduced)."""
        f = self.pipeline.flight
        tag: _Sync | None = f.plan.tag if f is not None else None
        delta = {
            n: torch.zeros_like(g) for n, g in zip(self.names, self.global_params, strict=True)
        }
        ref = dict(zip(self.buffers.names, self.buffers.shared(), strict=True))
        flight: dict[str, Any] = {
            "present": 0,
            "contribute": 0,
            "fragment": 0,
            "apply_step": 0,
            "base": 0,
            "exact": torch.zeros(1 + self.buffers.numel),
        }
        if f is not None and tag is not None:
            delta.update(dict(f.plan.items))
            assert f.plan.exact is not None
            flight.update(
                present=1,
                contribute=int(f.plan.contribute and tag.ref is not None),
                fragment=tag.fragment,
                apply_step=tag.apply_step,
                base=tag.base,
                exact=f.plan.exact,
            )
            if tag.ref is not None:
                ref = dict(zip(self.buffers.names, tag.ref, strict=True))
        return {**super()._local_tensors(), "flight": {**flight, "delta": delta, "ref": ref}}

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        super()._load_local_tensors(state)
        saved = state.get("flight")
        if not isinstance(saved, Mapping) or not saved.get("present"):
            self._resume = None
            return
        self._resume = {
            "fragment": int(saved["fragment"]),
            "apply_step": int(saved["apply_step"]),
            "base": int(saved["base"]),
            "contribute": bool(saved["contribute"]),
            "exact": saved["exact"].clone(),
            "delta": [saved["delta"][n].clone() for n in self.names],
            "ref": tuple(saved["ref"][n].clone() for n in self.buffers.names),
        }

    def reissue(self, saved: dict[str, Any]) -> None:
        """Issue again the round a checkpoint caught in flight, with the snapshot it carried."""
        frag = saved["fragment"]
        items = [(self.names[i], saved["delta"][i]) for i in self.fragments[frag]]
        ref = saved["ref"] if saved["contribute"] else None
        tag = _Sync(frag, saved["apply_step"], saved["base"], ref)

        def build(rnd: Round | None) -> Planned:
            ok = saved["contribute"] and (rnd is None or not rnd.resynced)
            plan = Planned(
                items=items,
                contribute=ok,
                exact=saved["exact"],
                tag=tag,
                placements=[self.placements[i] for i in self.fragments[frag]],
            )
            return self._planned(frag, plan)

        self.pipeline.issue(build)

    def metrics(self) -> dict[str, Any]:
        return {
            **super().metrics(),
            "outer_rounds": self.outer_rounds,
            "round_retries": self.pipeline.retries,
            "steady_overlap_fraction": round(self.steady.fraction, 4),
            "fragments": self.config.fragments,
            "fragment_elements": self.fragment_sizes(),
        }
