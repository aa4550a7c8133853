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

**Fixed global batch** (``DDPConfig(global_batch=B)``, after ElasWave): the
optimization no longer depends on who is in the run. ``step(loss_fn)`` takes a function from a
list of global-stream positions to the mean loss over their samples, and each committed step
consumes exactly the positions ``[t B, (t + 1) B)`` (:mod:`isthmus.data.global_batch`): inside
the round, once its membership is known, every member computes the mean gradient of its
contiguous share (accumulating micro-batches of at most ``micro_batch``), and the reducer
weights it by the share's size, so the averaged gradient is the gradient of the ``B`` samples
whatever the split. The work happens after the round formed, so a peer repaired at its start (a
joiner) contributes too, and an aborted attempt is recomputed by the survivors on their new
shares: kills, joins and aborts change the summation order, never the samples nor the scale.
The step's mean loss over the ``B`` samples rides in the exact values (:attr:`DDP.last_loss`).

On an island (a peer of several local ranks, FSDP2 or DDP inside) the island's share is split
among its ranks (:func:`~isthmus.data.global_batch.island_part`, as the elastic sampler splits
it). The island's own gradient averaging runs a collective in every forward and backward pass
and weighs its ranks equally, so every rank runs the same number of passes (a rank with a
shorter part, or none, runs padding passes: a sample of the share with its loss times zero,
its floating buffers put back afterwards) and scales each micro-batch's loss by its size times
the island's size over the share's, so that the island's averaged gradient is the mean over
its whole share; the island's weight in the cross-island mean is its share's size. A sample
whose loss is not finite makes the island contribute nothing, padding or not.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.session import Round
from isthmus.data.global_batch import (
    island_part,
    micro_batches,
    share_positions,
    step_positions,
)
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.base import Strategy, register_optimizer
from isthmus.strategies.model_state import SharedBuffers
from isthmus.strategies.sharded import island_snapshot, start_reduction

__all__ = ["DDP", "DDPConfig", "LossFn", "accumulate_share"]

log = logging.getLogger("isthmus.ddp")

LossFn = Callable[[Sequence[int]], torch.Tensor]
"""Global-stream positions -> the mean loss over their samples (a scalar with a graph)."""


@dataclass(kw_only=True)
class DDPConfig:
    """How gradients are reduced is the reducer's business (``compression``, ``aggregator``,
    ``byzantine_f``); these options choose what each step computes."""

    global_batch: int = 0
    """B > 0: every committed step consumes exactly B samples, split among the round's members,
    and ``step(loss_fn)`` computes the gradients inside the round (see the module docstring).
    0: each peer trains on the batch it passed to ``backward()`` before ``step()``."""
    micro_batch: int = 0
    """With ``global_batch``: the most samples one forward pass takes; a larger share is
    accumulated over several (0: the whole share at once)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.micro_batch and not self.global_batch:
            raise ValueError("micro_batch only applies with global_batch; set global_batch too")


def accumulate_share(
    params: Sequence[torch.Tensor], loss_fn: LossFn, positions: range, micro_batch: int
) -> torch.Tensor:
    """Set ``params``' gradients to the mean gradient of the loss over ``positions``
    (micro-batches of at most ``micro_batch``, each weighted by its size) and return the mean
    loss (a detached fp32 scalar; NaN for no positions, and the gradients are then zero).
    Raises what ``loss_fn`` raises."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    n = len(positions)
    total = torch.zeros((), dtype=torch.float32)
    for piece in micro_batches(positions, micro_batch):
        loss = loss_fn(list(piece))
        (loss * (len(piece) / n)).backward()
        total += loss.detach().float() * len(piece)
    return total / n if n else torch.tensor(math.nan)


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
    islands = ""  # HSDP: each rank of an island reduces its gradient shard across islands (by
    # piece between islands of different sizes); the mean is elementwise. With global_batch the
    # island's share is split among its ranks (_accumulate_part).

    def pipelines_rounds(self) -> bool:
        """Whether a round may be applied before its verdict (``pipeline_commit``): only when
        nothing writes the shared state between steps. An integer buffer (a batch counter)
        moves in every forward pass, and with ``global_batch`` the work runs inside the round
        (nothing to overlap), so those keep the waiting path."""
        return not self.model_state.other_buffers and not self.config.global_batch

    def _grads(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient as a plain tensor, zeros where there is none
        (on a rank of an island: the local shard of the DTensor gradient, sharing its storage,
        so that writing into it changes what the optimizer steps with)."""
        sources = self.model_state.sources
        out = []
        for n, p in zip(self.names, self.params, strict=True):
            src = sources.get(n)
            if src is None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(p.grad)
                continue
            if src.grad is None:
                src.grad = torch.zeros_like(src)
            out.append(src.grad.to_local())  # type: ignore[attr-defined]
        return out

    @property
    def takes_batch_fn(self) -> bool:
        """True with ``global_batch``: :meth:`step` takes the loss function (no backward before)."""
        return bool(self.config.global_batch)

    def setup(self) -> None:
        self.last_loss = math.nan
        """With ``global_batch``: the mean loss over the last step's B samples (every peer)."""
        self.last_share: range = range(0)
        """With ``global_batch``: the positions this peer computed in the last committed step."""
        self.work_s = 0.0
        """With ``global_batch``: seconds of computation (forward and backward passes) in the
        last step's committed attempt."""
        self.buffers = SharedBuffers(self.model_state.float_buffers)
        self.share_model([p.data for p in self.params], "model", self.buffers)
        if self.session is not None:
            register_optimizer(self.session, "opt", self.optimizer)
            self._register_counter()

    def _step(self, loss_fn: LossFn | None = None) -> None:
        self.check_faults("step")
        if self.config.global_batch:
            if loss_fn is None:
                raise TypeError(
                    "DDP with global_batch computes the gradients itself: call step(loss_fn) "
                    "with a function from positions to their mean loss, without backward()"
                )
            self._global_batch_step(loss_fn)
        elif self.session is None:
            self.optimizer.step()
        else:
            grads = self._grads()
            items = list(zip(self.names, grads, strict=True))
            reducer, buffers = self.reducer, self.buffers
            snap = island_snapshot(self.session, buffers.snapshot())
            exact = buffers.flat(snap) if buffers else None

            def reduce(rnd: Round) -> Reduced | None:
                ok = not rnd.resynced and (not buffers or buffers.finite(snap))
                pending = start_reduction(
                    reducer, rnd, items, self.placements, contribute=ok, exact=exact
                )
                rnd.check_faults("collective", step=self.step_count)
                return pending.wait()

            options = self.round_options(step_after=self.step_count + 1)
            result = self.session.run_round(reduce, **options)
            # Committed on every peer (or, pipelined, applied until the verdict settles); every peer holds the same result, so takes the same branch.
            if result is not None:
                for grad, g in zip(grads, result.tensors, strict=True):
                    grad.copy_(g)
                self.optimizer.step()
                if result.exact is not None:
                    buffers.land(result.exact)
            # Nothing ran forward since the snapshot: the model takes the copy as it is (with
            # nobody contributing, every peer goes back to the last agreed buffers).
            buffers.restart()
        self.global_step += 1
        self.local_steps += 1

    def _global_batch_step(self, loss_fn: LossFn) -> None:
        big, micro = self.config.global_batch, self.config.micro_batch
        buffers = self.buffers
        if self.session is None:
            self.last_share = step_positions(self.step_count, big)
            self.last_loss = float(accumulate_share(self.params, loss_fn, self.last_share, micro))
            self.optimizer.step()
            return
        session, reducer = self.session, self.reducer
        island = getattr(session, "island", None)
        shares: list[range] = []

        def reduce(rnd: Round) -> Reduced | None:
            # The step is read here, after the round formed: a repaired peer has the run's.
            step = self.step_count
            share = share_positions(step, big, rnd.rank, rnd.world)
            shares.append(share)
            buffers.restart()  # an aborted attempt's forward passes leave no trace
            t0 = time.monotonic()
            if island is None:
                loss = accumulate_share(self.params, loss_fn, share, micro)
            else:
                loss = self._accumulate_part(loss_fn, share, micro, island)
            session.faults.pace(step, time.monotonic() - t0)
            self.work_s = time.monotonic() - t0
            snap = island_snapshot(session, buffers.snapshot())
            ok = len(share) > 0 and bool(torch.isfinite(loss)) and buffers.finite(snap)
            exact = loss.reshape(1) if ok else torch.zeros(1)
            if buffers:
                exact = torch.cat([exact, buffers.flat(snap)])
            # Copies outside the plain mode: its worker may still read an abandoned attempt's
            # tensors when the next attempt zeroes the gradients.
            keep = reducer.mode == "plain"
            items = [
                (n, g if keep else g.clone())
                for n, g in zip(self.names, self._grads(), strict=True)
            ]
            pending = start_reduction(
                reducer, rnd, items, self.placements, contribute=ok, exact=exact, weight=len(share)
            )
            rnd.check_faults("collective", step=step)
            return pending.wait()

        result = session.run_round(reduce)
        self.last_share = shares[-1]
        self.last_loss = math.nan
        if result is not None:
            for grad, g in zip(self._grads(), result.tensors, strict=True):
                grad.copy_(g)
            self.optimizer.step()
            assert result.exact is not None
            self.last_loss = float(result.exact[0])
            if buffers:
                buffers.land(result.exact[1:])
        else:
            log.warning("step %d: no peer contributed a finite gradient; skipped", self.step_count)
        buffers.restart()

    def _accumulate_part(
        self, loss_fn: LossFn, share: range, micro_batch: int, island: Any
    ) -> torch.Tensor:
        """On a rank of ``island``: set the gradients (the island's, as its FSDP2/DDP averages
        them) to the mean gradient over the island's whole ``share`` from this rank's part, with
        as many passes as every other rank (see the module docstring), and return the mean loss
        over the share (fp32, the same on every rank; NaN for an empty share). Every rank of
        the island calls it at the same point. Raises what ``loss_fn`` raises."""
        grads = self._grads()
        for g in grads:
            g.zero_()
        pieces, passes = island_part(share, micro_batch, island.rank, island.size)
        n, total = len(share), 0.0
        for piece in pieces:
            loss = loss_fn(list(piece))
            (loss * (len(piece) * island.size / n)).backward()
            total += float(loss.detach()) * len(piece)
        for _ in range(passes - len(pieces)):
            # a pass the island's collectives need, adding nothing: a sample another rank takes
            # (so a loss that is not finite here is not finite there either)
            kept = self.buffers.snapshot()
            (loss_fn([share.start]) * 0.0).backward()
            with torch.no_grad():
                for b, k in zip(self.buffers.local, kept, strict=True):
                    b.copy_(k)
        mean = sum(island.gather(total)) / n if n else math.nan
        return torch.tensor(mean, dtype=torch.float32)

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        # Nothing of the model is local, but its floating buffers are read from the global copy
        # (loaded with the shared state) only after a round: bring them in now.
        self.buffers.restart()
