"""Eager (one-step-delayed) DiLoCo: the outer all-reduce of round t runs during round t+1.

Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and Computation in DiLoCo",
arXiv:2502.12996 (2025); the one-outer-step-delayed scheme is also PCCL's "async DiLoCo"
(Prime Intellect, PCCL, the Prime Collective Communications Library, 2025).

DiLoCo (:mod:`isthmus.strategies.diloco`) blocks at every outer step while the outer gradients
are averaged. Here a peer does not wait: at the end of inner phase t it starts the all-reduce of
its outer gradient delta_i(t) and immediately trains phase t+1; the mean D(t) is applied to the
shared theta at the end of phase t+1, one outer step late, so the whole all-reduce hides behind
H inner steps.

Per boundary (every ``sync_every`` = H inner steps), on every peer:

1. ``delta_i = start_i - x_i``: this phase's progress, measured from where the phase started;
2. settle round t-1: ``theta <- OuterOpt(theta, D(t-1))`` (DiLoCo's outer SGD with Nesterov
   momentum; theta and the momentum are shared and bit-identical on every peer);
3. ``delta_i <- delta_i + anchor * (theta - start_i)``: move the reference point from the start
   towards theta, now that theta is known (below);
4. begin round t and start reducing ``delta_i``;
5. the next phase starts at ``start_i`` (per ``start``, below), and ``x_i <- start_i``.

Where the next phase starts (``start``):

* ``"predicted"`` (the default): where theta will be once round t lands, predicted by the outer
  optimizer itself, ``OuterOpt(theta, delta_i)``, with this peer's own fresh outer gradient
  standing in for the mean it cannot know yet; the momentum's part of the step is exact. With one
  peer the prediction is exact and the run is DiLoCo's, bit for bit.
* ``"paper"``: the paper's eager update, ``theta - k * delta_i / M``: the fresh own *share*
  replaces its stale one, ``(1/M) (delta_i(t) + sum_{j != i} delta_j(t-1))``; ``k`` is the outer
  step on a fresh gradient (``outer_lr * (1 + momentum)`` with Nesterov).
* ``"theta"``: theta itself, the naive one-step-delayed scheme the paper shows is worse.

Why predict, and why ``anchor``: every start misses the true next theta by an error e_i (the
part of the mean it could not know). The inner optimizer partly undoes that error during the
phase, so the progress it reports contains ``-e_i`` in the directions it corrects (steep ones),
and the outer momentum amplifies that spurious part up to ``outer_lr / (1 - momentum)``, seven
times with DiLoCo's (0.7, 0.9), so with the paper's update those settings overshoot. Measured
from theta instead (``anchor = 1``), the outer
gradient carries the error in the directions the phase did *not* correct (flat ones); measured
from the midpoint, at most half of it gets through in any direction. Predicting the mean by the
peer's whole outer gradient (not its 1/M share) makes the error average to zero over the peers,
leaving only its noise part (docs/BENCHMARKS.md, "Eager DiLoCo with a predicted start", compares
the starts). The prediction and the anchor are isthmus's, not the paper's; ``start="paper",
anchor=0`` (with ``outer_lr=1.0, outer_momentum=0``) is the paper's scheme, which can be ahead on
short runs, before DiLoCo's outer momentum has built up.

Shared state: theta, the buffers' global copy, the frozen parameters and integer buffers, the
outer momentum, the step counter (fp32 theta and momentum for bf16/fp16 models). Local: the inner
optimizer, the local parameters and buffers and the phase's starting point. Buffers: the mean of
the snapshot each peer took at a boundary is applied to the global copy when that round settles,
one boundary later, and the model keeps what it gathered since on top of it (see
:class:`~isthmus.strategies.delayed.DelayedOuter`).

Joining: a joiner is admitted when the members begin round t (after they applied D(t-1)); it
receives theta, momentum and the step counter (equal to the members' step at that moment), takes
part in round t's reduction without contributing, trains phase t+1 from the prediction with no
gradient of its own (theta plus the momentum's step), and applies D(t) at the next boundary like
everyone: it receives the in-flight result and stays in parity.

On failure: see :mod:`isthmus.strategies.pipeline`. A peer dying while round t is in flight
aborts round t for everyone at the next boundary (or at once if the coordinator pushes the
abort); the survivors reduce their snapshots of delta(t) again, blocking, and apply the mean of
the survivors. The inner steps of phase t+1 already taken stay in their local parameters.
A peer whose update is not finite contributes nothing that round (the reducer's policy) and
restarts from the prediction without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.base import (
    materialize_optimizer_state,
    outer_sgd,
    register_optimizer,
)
from isthmus.strategies.delayed import DelayedOuter
from isthmus.strategies.diloco import DiLoCoConfig

__all__ = ["EagerConfig", "EagerDiLoCo", "preview_sgd"]


Start = Literal["predicted", "paper", "theta"]
STARTS: tuple[str, ...] = get_args(Start)


@dataclass(kw_only=True)
class EagerConfig(DiLoCoConfig):
    """DiLoCo's outer settings, and where each phase starts and its outer gradient is measured
    from. DiLoCo's outer momentum overshoots with ``start="paper"``: use 0 there (see the
    module's notes)."""

    time_budget: ClassVar[bool] = False  # inner_budget="time" is DiLoCo's and local SGD's

    sync_every: int = 20
    """H: inner steps per phase; each outer all-reduce overlaps the H steps of the next phase
    (the default is the best of a search, docs/BENCHMARKS.md)."""
    start: Start = "predicted"
    """Where each phase starts: ``"predicted"`` (the outer step on this peer's own fresh outer
    gradient), ``"paper"`` (theta plus the fresh own share, the paper's eager update) or
    ``"theta"`` (the naive delayed scheme)."""
    anchor: float = 0.5
    """Where the outer gradient is measured from, between the phase's start (0, the paper) and
    theta once the round in flight has landed (1); 0.5 is the midpoint. The start's error passes
    into the outer gradient with a factor up to ``max(anchor, 1 - anchor) * lr * (1 + momentum)``,
    below 1 for anchors between 0.25 and 0.75 with DiLoCo's outer settings (docs/BENCHMARKS.md
    compares anchors)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {', '.join(STARTS)}; got {self.start!r}")
        if not 0 <= self.anchor <= 1:
            raise ValueError(f"anchor must be in [0, 1], got {self.anchor}")

    @property
    def fresh_step(self) -> float:
        """How far the outer optimizer moves theta along a fresh outer gradient."""
        if self.nesterov and self.outer_momentum > 0:
            return self.outer_lr * (1 + self.outer_momentum)
        return self.outer_lr


def preview_sgd(
    theta: torch.Tensor,
    buf: torch.Tensor | None,
    grad: torch.Tensor,
    lr: float,
    momentum: float,
    nesterov: bool,
    out: torch.Tensor,
) -> None:
    """Write into ``out`` where ``torch.optim.SGD`` (no dampening, no weight decay) would move
    ``theta`` with ``grad``, changing neither ``theta`` nor the momentum ``buf``. It uses the
    operations of torch's single-tensor SGD, so on the CPU ``out`` has the bits that the step
    itself will give."""
    step = grad
    if momentum > 0:
        assert buf is not None, "a momentum SGD has a momentum buffer (materialized at start)"
        b = buf.mul(momentum).add_(grad)
        step = grad.add(b, alpha=momentum) if nesterov else b
    torch.add(theta, step, alpha=-lr, out=out)


class EagerDiLoCo(DelayedOuter):
    """One-step-delayed DiLoCo with eager updates. Call :meth:`step` after every backward and
    :meth:`finish` once at the end (it settles the last round so that every peer ends on theta)."""

    name = "eager"
    Config = EagerConfig
    config: EagerConfig
    islands = ""  # the outer step and every start rule are elementwise: each rank on its shards

    def init_outer(self) -> None:
        cfg = self.config
        self.outer = outer_sgd(self.global_params, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
        # Momentum buffers exist (zeros) from the start, with or without a session, so that a
        # one-peer run does the same arithmetic either way.
        materialize_optimizer_state(self.outer)

    def register_outer(self, session: Session) -> None:
        register_optimizer(session, "outer", self.outer, self.placements)

    def apply_outer(self, result: Reduced | None) -> None:
        if result is None:
            return
        for g, d in zip(self.global_params, result.tensors, strict=True):
            g.grad = d.to(g.dtype)  # the reduction is fp32; the model may not be
        self.outer.step()

    def remeasure(self, delta: list[torch.Tensor]) -> None:
        a = self.config.anchor
        if a == 0:
            return
        with torch.no_grad():
            for d, s, g in zip(delta, self.start, self.global_params, strict=True):
                d.add_(g - s, alpha=a)

    def restart(self, delta: list[torch.Tensor] | None, contributors: int) -> None:
        cfg = self.config
        if cfg.start == "predicted":
            lr, mu = cfg.outer_lr, cfg.outer_momentum
            nesterov = cfg.nesterov and mu > 0
            for i, (s, g) in enumerate(zip(self.start, self.global_params, strict=True)):
                est = delta[i].to(g.dtype) if delta is not None else torch.zeros_like(g)
                buf = self.outer.state[g].get("momentum_buffer")
                preview_sgd(g, buf, est, lr, mu, nesterov, out=s)
            return
        if delta is None or cfg.start == "theta":
            for s, g in zip(self.start, self.global_params, strict=True):
                s.copy_(g)
            return
        k = cfg.fresh_step / contributors
        for s, g, d in zip(self.start, self.global_params, delta, strict=True):
            torch.add(g, d, alpha=-k, out=s)
