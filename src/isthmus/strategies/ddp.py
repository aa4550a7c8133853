"""Fault-tolerant data parallel: gradients averaged every step, then the optimizer steps.

The classic synchronous scheme (as in torch DDP), made fault-tolerant by isthmus's rounds: each
step is one round. Gradients go through the strategy's :class:`~isthmus.reduce.reducer.Reducer`
(bucketed all-reduces by default, or compressed, or robustly aggregated), and the optimizer steps
only after the round commits on every peer. If a peer dies mid-reduction, the survivors re-form and
reduce the same gradients again; the dead peer's contribution for that step is lost, nothing else.

Shared state: the model's parameters, trainable and frozen (``model/<name>``), its integer
buffers (``model/<name>``), a global copy of its floating buffers (``global/<name>``), the
optimizer's state and the step counter. They stay bit-identical because every peer applies the
same averaged gradient to the same state with the same deterministic optimizer.

Buffers: torch DDP broadcasts rank 0's buffers before each forward. Here the floating ones
(BatchNorm's running statistics) are *averaged* over the round's contributors, so every peer's
batches count in them as they do in the gradient: each round carries the model's buffers as
its forward pass left them in the reducer's ``exact`` values (an fp32 sum, never compressed and
never robustly aggregated, even with ``aggregator=``: a byzantine peer can move them), and after
the commit every peer copies the mean into its model. A peer whose buffers hold NaN/Inf
contributes nothing that round. Integer buffers (``num_batches_tracked``) advance alike on every
peer (one forward pass per step) and are kept equal by the parity check; a joiner receives them.
The user's optimizer state is shared, so a peer keeps no local state but the RNG and error
feedback (:meth:`~isthmus.strategies.base.Strategy.local_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.session import Round
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.base import Strategy, register_optimizer
from isthmus.strategies.model_state import SharedBuffers

__all__ = ["DDP", "DDPConfig"]


@dataclass(kw_only=True)
class DDPConfig:
    """DDP has no options of its own: how gradients are reduced is the reducer's business
    (``compression``, ``aggregator``, ``byzantine_f``)."""


class DDP(Strategy):
    """Data parallel; ``compression``, ``aggregator`` and ``byzantine_f`` choose how gradients
    are reduced (see :class:`Reducer`).

    With ``session=None`` this is exactly ``optimizer.step()``: bit-for-bit plain training.
    A peer whose gradient or buffers hold NaN/Inf contributes nothing that step (logged); the
    others' average is applied by everyone.
    """

    name = "ddp"
    Config = DDPConfig
    config: DDPConfig
    first_round_uses_work = True  # the first step trains on the batch drawn before the round

    def setup(self) -> None:
        self.buffers = SharedBuffers(self.model_state.float_buffers)
        self.share_model([p.data for p in self.params], "model", self.buffers)
        if self.session is not None:
            register_optimizer(self.session, "opt", self.optimizer)
            self._register_counter()

    def _step(self) -> None:
        self.check_faults("step")
        if self.session is None:
            self.optimizer.step()
        else:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            items = [(n, p.grad) for n, p in zip(self.names, self.params, strict=True)]
            reducer, buffers = self.reducer, self.buffers
            snap = buffers.snapshot()
            exact = buffers.flat(snap) if buffers else None

            def reduce(rnd: Round) -> Reduced | None:
                ok = not rnd.resynced and (not buffers or buffers.finite(snap))
                pending = reducer.start(rnd, items, contribute=ok, exact=exact)
                rnd.check_faults("collective", step=self.step_count)
                return pending.wait()

            result = self.session.run_round(reduce)
            reducer.commit()
            # Committed on every peer; every peer holds the same result, so takes the same branch.
            if result is not None:
                for p, g in zip(self.params, result.tensors, strict=True):
                    p.grad.copy_(g)  # type: ignore[union-attr]
                self.optimizer.step()
                if result.exact is not None:
                    buffers.land(result.exact)
            # Nothing ran forward since the snapshot: the model takes the copy as it is (with
            # nobody contributing, every peer goes back to the last agreed buffers).
            buffers.restart()
        self.global_step += 1
        self.local_steps += 1

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        # Nothing of the model is local, but its floating buffers are read from the global copy
        # (loaded with the shared state) only after a round: bring them in now.
        self.buffers.restart()
