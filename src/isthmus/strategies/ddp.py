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

from typing import Any

import torch

from isthmus.comm.session import Round, Session
from isthmus.reduce.reducer import Reduced, Reducer
from isthmus.strategies.base import Strategy, register_module, register_optimizer

__all__ = ["DDP"]


class DDP(Strategy):
    """Data parallel. ``bucket_mb`` bounds one all-reduce; ``compression``, ``aggregator`` and
    ``byzantine_f`` choose how gradients are reduced (see :class:`Reducer`).

    With ``session=None`` this is exactly ``optimizer.step()``: bit-for-bit plain training.
    A peer whose gradient holds NaN/Inf contributes nothing that step (logged); the others'
    average is applied by everyone.
    """

    name = "ddp"

    def __init__(
        self,
        session: Session | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        reducer: Reducer | None = None,
        compression: Any = None,
        aggregator: Any = None,
        byzantine_f: int = 0,
    ) -> None:
        super().__init__(session, model)
        self.optimizer = optimizer
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.reducer = reducer or Reducer(
            compression=compression, aggregator=aggregator, byzantine_f=byzantine_f
        )
        if session is not None:
            register_module(session, "model", zip(self.names, self.params, strict=True))
            register_optimizer(session, "opt", optimizer)
            self._register_counter()

    @classmethod
    def from_options(
        cls,
        session: Session | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: Reducer,
        **options: Any,
    ) -> DDP:
        if options:
            raise ValueError(f"ddp takes no options, got {sorted(options)}")
        return cls(session, model, optimizer, reducer=reducer)

    def step(self) -> None:
        self.check_faults("step")
        if self.session is None:
            self.optimizer.step()
        else:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            items = [(n, p.grad) for n, p in zip(self.names, self.params, strict=True)]
            assert self.reducer is not None
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
