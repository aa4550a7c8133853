"""Eager (one-step-delayed) DiLoCo: the outer all-reduce of round t runs during round t+1.

Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and Computation in DiLoCo",
arXiv:2502.12996 (2025); the one-outer-step-delayed scheme is also PCCL's "async DiLoCo"
(Prime Intellect, PCCL, the Prime Collective Communications Library, 2025).

DiLoCo (:mod:`isthmus.strategies.diloco`) blocks at every outer step while the outer gradients
are averaged. Here a peer does not wait: at the end of inner phase t it starts the all-reduce of
its outer gradient delta_i(t) and immediately trains phase t+1; the mean D(t) is applied at the
end of phase t+1, one outer step late, so the whole all-reduce hides behind H inner steps.

Per boundary (every ``sync_every`` = H inner steps), on every peer:

1. ``delta_i(t) = start_i(t) - x_i`` (this phase's progress, measured from where it started);
2. settle round t-1: ``theta <- OuterOpt(theta, D(t-1))`` (SGD, optionally with Nesterov
   momentum as in DiLoCo; theta and the momentum are shared and bit-identical);
3. begin round t and start reducing ``delta_i(t)``;
4. the next phase starts at ``start_i(t+1) = theta - k * delta_i(t) / M`` (eager) or at
   ``theta`` (``eager=False``, the naive delayed scheme), and ``x_i <- start_i(t+1)``.

Step 4 is the *eager update*: the paper replaces this peer's stale share of the delayed average
by its fresh outer gradient, ``(1/M) (delta_i(t) + sum_{j != i} delta_j(t-1))``. isthmus keeps the
shared theta on the delayed trajectory (bit-identical on all peers, what a joiner receives) and
adds the fresh local share only to the local starting point, scaled by ``k``, the step the outer
optimizer takes on a fresh gradient (``outer_lr * (1 + momentum)`` with Nesterov, ``outer_lr``
without). The fresh share is not accumulated: the next start is rebuilt from the new theta, in
which delta_i(t) is then counted exactly once, through D(t). With plain outer SGD (no momentum)
this is exactly the paper's per-worker trajectory; with momentum it is its first-order
approximation (the paper's formula is marked unconfirmed in ALGORITHMS.md).

Defaults: DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) is unstable once its update
arrives one phase late: its momentum amplifies each outer gradient about 7 times, and with the
delay the amplified steps overshoot. On the tiny GPT with 4 peers (H = 20, 300 steps; see
docs/BENCHMARKS.md) the final eval loss was 3.43 with (0.7, 0.9), 2.74 with momentum
0.5, 2.67 with (0.5, 0.5) and 2.64 with (1.0, 0): the defaults are lr 1.0 without momentum. The
eager update matters: the naive delayed scheme with the same (1.0, 0) reached 2.86.

Shared state: theta, the outer momentum, the step counter. Local: the inner optimizer, the local
parameters and the phase's starting point.

Joining: a joiner is admitted when the members begin round t (after they applied D(t-1)); it
receives theta, momentum and the step counter (equal to the members' step at that moment), takes
part in round t's reduction without contributing, trains phase t+1 from theta, and applies D(t) at
the next boundary like everyone: it receives the in-flight result and stays in parity.

On failure: see :mod:`isthmus.strategies.overlap`. A peer dying while round t is in flight
aborts round t for everyone at the next boundary (or at once if the coordinator pushes the
abort); the survivors reduce their snapshots of delta(t) again, blocking, and apply the mean of
the survivors. The inner steps of phase t+1 already taken stay in their local parameters.
A peer whose update is not finite contributes nothing that round (the reducer's policy) and
restarts from theta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.session import Session
from isthmus.strategies.base import (
    config_from,
    materialize_optimizer_state,
    outer_sgd,
    register_globals,
    register_optimizer,
)
from isthmus.strategies.overlap import DelayedOuter
from isthmus.strategies.reducer import Reduced, Reducer

__all__ = ["EagerConfig", "EagerDiLoCo"]


@dataclass(kw_only=True)
class EagerConfig:
    sync_every: int = 50
    """H: inner steps per phase; each outer all-reduce overlaps the H steps of the next phase."""
    outer_lr: float = 1.0
    """Outer learning rate. 1.0 (not DiLoCo's 0.7): see the note on defaults in the module."""
    outer_momentum: float = 0.0
    """Outer momentum. 0 (not DiLoCo's 0.9): momentum amplifies the delayed update, see the
    module's note on defaults."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (when ``outer_momentum`` > 0)."""
    eager: bool = True
    """Start each phase from theta plus this peer's fresh outer step (the eager update); False:
    start from theta alone (the naive one-step-delayed scheme, which the paper shows is worse)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")

    @property
    def fresh_step(self) -> float:
        """How far the outer optimizer moves theta along a fresh outer gradient."""
        if self.nesterov and self.outer_momentum > 0:
            return self.outer_lr * (1 + self.outer_momentum)
        return self.outer_lr


class EagerDiLoCo(DelayedOuter):
    """One-step-delayed DiLoCo with eager updates. Call :meth:`step` after every backward and
    :meth:`finish` once at the end (it settles the last round so that every peer ends on theta)."""

    name = "eager"

    def __init__(
        self,
        session: Session | None,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: EagerConfig | None = None,
        *,
        reducer: Reducer | None = None,
        compression: Any = None,
        aggregator: Any = None,
        byzantine_f: int = 0,
    ) -> None:
        self.config = config or EagerConfig()
        super().__init__(
            session,
            model,
            inner_optimizer,
            sync_every=self.config.sync_every,
            reducer=reducer
            or Reducer(compression=compression, aggregator=aggregator, byzantine_f=byzantine_f),
        )
        self.outer = outer_sgd(
            self.global_params,
            self.config.outer_lr,
            self.config.outer_momentum,
            self.config.nesterov,
        )
        # Momentum buffers exist (zeros) from the start, with or without a session, so that a
        # one-peer run does the same arithmetic either way.
        materialize_optimizer_state(self.outer)
        if session is not None:
            register_globals(session, self.names, self.global_params)
            register_optimizer(session, "outer", self.outer)
            self._register_counter()

    @classmethod
    def from_options(
        cls,
        session: Session | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: Reducer,
        **options: Any,
    ) -> EagerDiLoCo:
        return cls(session, model, optimizer, config_from(EagerConfig, options), reducer=reducer)

    def apply_outer(self, result: Reduced | None) -> None:
        if result is None:
            return
        for g, d in zip(self.global_params, result.tensors, strict=True):
            g.grad = d.to(g.dtype)  # the reduction is fp32; the model may not be
        self.outer.step()

    def restart(self, delta: list[torch.Tensor] | None, contributors: int) -> None:
        if delta is None or not self.config.eager:
            for s, g in zip(self.start, self.global_params, strict=True):
                s.copy_(g)
            return
        k = self.config.fresh_step / contributors
        for s, g, d in zip(self.start, self.global_params, delta, strict=True):
            torch.add(g, d, alpha=-k, out=s)
