"""Fault-tolerant data parallel: gradients averaged every step, then the optimizer steps.

The classic synchronous scheme (as in torch DDP), made fault-tolerant by isthmus's rounds: each
step is one round. Gradients go through the strategy's :class:`~isthmus.reduce.reducer.Reducer`
(bucketed all-reduces by default, or compressed, or robustly aggregated), and the optimizer steps
only after the round commits on every peer. If a peer dies mid-reduction, the survivors re-form and
reduce the same gradients again; the dead peer's contribution for that step is lost, nothing else.

Shared state: the model's parameters, the optimizer's state and the step counter. They stay
bit-identical because every peer applies the same averaged gradient to the same state with the
same deterministic optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isthmus.comm.session import Round
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.base import Strategy, register_module, register_optimizer

__all__ = ["DDP", "DDPConfig"]


@dataclass(kw_only=True)
class DDPConfig:
    """DDP has no options of its own: how gradients are reduced is the reducer's business
    (``compression``, ``aggregator``, ``byzantine_f``)."""


class DDP(Strategy):
    """Data parallel; ``compression``, ``aggregator`` and ``byzantine_f`` choose how gradients
    are reduced (see :class:`Reducer`).

    With ``session=None`` this is exactly ``optimizer.step()``: bit-for-bit plain training.
    A peer whose gradient holds NaN/Inf contributes nothing that step (logged); the others'
    average is applied by everyone.
    """

    name = "ddp"
    Config = DDPConfig
    config: DDPConfig

    def setup(self) -> None:
        if self.session is not None:
            register_module(self.session, "model", zip(self.names, self.params, strict=True))
            register_optimizer(self.session, "opt", self.optimizer)
            self._register_counter()

    def step(self) -> None:
        self.check_faults("step")
        if self.session is None:
            self.optimizer.step()
        else:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            items = [(n, p.grad) for n, p in zip(self.names, self.params, strict=True)]
            reducer = self.reducer

            def reduce(rnd: Round) -> Reduced | None:
                pending = reducer.start(rnd, items, contribute=not rnd.resynced)
                rnd.check_faults("collective", step=self.step_count)
                return pending.wait()

            result = self.session.run_round(reduce)
            reducer.commit()
            # Committed on every peer; every peer holds the same result, so takes the same branch.
            if result is not None:
                for p, g in zip(self.params, result.tensors, strict=True):
                    p.grad.copy_(g)  # type: ignore[union-attr]
                self.optimizer.step()
        self.global_step += 1
        self.local_steps += 1
