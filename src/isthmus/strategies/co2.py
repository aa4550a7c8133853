"""CO2: local updating with an asynchronous all-reduce fully overlapped with computation.

Sun, Qin, Sun, Li, Li, Shen, Qiao, Zhong, "CO2: Efficient Distributed Training with Full
Communication-Computation Overlap", ICLR 2024, arXiv:2401.16265.

Every peer runs ``sync_every`` (tau) local steps; the all-reduce of a round's result runs
asynchronously while the next tau local steps compute, and the outer update that uses it happens
one round later (one-step staleness). Two additions keep the stale outer update stable:

* a **staleness gap penalty**: the stale outer gradient is divided by ``gap_penalty``;
* **outer momentum clipping**: the outer momentum is clamped element-wise to ``[-clip, clip]``.

Per boundary (every tau local steps), on every peer, with ``x_old`` the shared global parameters:

1. ``d_i = x_old(t) - x_i``: this round's progress, measured from the global parameters the round
   started from (isthmus reduces this outer gradient rather than the parameters themselves: the
   mean is the same, ``x_old(t) - mean_i(x_i)``, but differences compress far better);
2. settle round t-1, whose mean ``D = x_old(t-1) - mean_i(x_i(t-1))`` is CO2's
   ``x_old - x`` for that round, and apply::

       m <- beta * m + D / gap_penalty
       m <- clamp(m, -clip, clip)          # really clamped (the public code discards the result)
       x_old <- x_old - outer_lr * m

3. begin round t and start reducing ``d_i``;
4. restart locally: ``x_i <- x_old``.

Defaults: ``outer_lr`` 1.0 (the public code's), ``outer_momentum`` (beta) 0.2, the low end of the
code's 0.2-0.6 ("less for fewer workers"), and a constant ``gap_penalty`` of 2.0, the best of a
search (docs/BENCHMARKS.md; docs/STRATEGIES.md has the ablation and the paper-vs-isthmus table).
A constant penalty ``p`` is the same as ``outer_lr / p`` while the clip does not bite. An outer
step ``outer_lr / (gap_penalty (1 - beta))`` far above the default's sits next to a cliff, so the
defaults stay mid-plateau. The paper's penalty is an adaptive, layer-wise measure of the staleness
gap; that rule is not implemented here. ``clip`` defaults to 1.0 (the public code's threshold);
``clip=None`` disables it.

Shared state: ``x_old`` (registered as ``global/*``), the buffers' global copy, the frozen
parameters and integer buffers, the outer momentum ``m`` and the step counter (``x_old`` and
``m`` in fp32 for bf16/fp16 models). Local: the inner optimizer and the local parameters and
buffers. Buffers as for eager DiLoCo: the mean of each boundary's snapshot is applied when its
round settles, one boundary later (see :class:`~isthmus.strategies.delayed.DelayedOuter`).

Joining and failures: as for eager DiLoCo (see :mod:`isthmus.strategies.pipeline`): a joiner is
admitted when a round begins, after the previous result was applied, and receives the result of
the round in flight with the members; a failure during an in-flight all-reduce aborts that round
for everyone, and the survivors reduce the snapshot taken when it was issued again (the local steps
taken meanwhile are kept). A peer whose update is not finite contributes nothing that round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reduced
from isthmus.strategies.delayed import DelayedOuter
from isthmus.strategies.outer_home import OuterDevice, check_outer_device
from isthmus.strategies.sharded import register_shard

__all__ = ["CO2", "CO2Config"]


@dataclass(kw_only=True)
class CO2Config:
    sync_every: int = 20
    """tau: local steps per round (the paper's code uses 20-48)."""
    outer_lr: float = 1.0
    """Outer learning rate (public code: 1.0)."""
    outer_momentum: float = 0.2
    """beta, the outer momentum: 0.2-0.6 in the paper's code (0.5 by default there, for large
    clusters), less for fewer workers; 0.2 suits a handful of peers."""
    gap_penalty: float = 2.0
    """Divides the one-round-stale outer gradient (a constant, as in the public code, whose
    value is 1.0; see the module docstring for this default)."""
    clip: float | None = 1.0
    """Clamp the outer momentum element-wise to [-clip, clip]; None: no clipping."""
    outer_state_device: OuterDevice = "auto"
    """Where x_old, the phase's start and the outer momentum live: ``cpu`` (host memory),
    ``same`` (beside the model) or ``auto`` (``cpu``, or ``same`` when the session's backend is
    ``nccl``), as DiLoCo's option (:mod:`isthmus.strategies.outer_home`)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (tau) must be >= 1, got {self.sync_every}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum (beta) must be in [0, 1), got {self.outer_momentum}")
        if not self.gap_penalty > 0:
            raise ValueError(
                f"gap_penalty must be positive (1.0 applies the stale update as it is), "
                f"got {self.gap_penalty}"
            )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive, or None to disable clipping; got {self.clip}")
        check_outer_device(self.outer_state_device)


class CO2(DelayedOuter):
    """CO2 around the user's inner optimizer. Call :meth:`step` after every backward and
    :meth:`finish` once at the end (it settles the last round so that every peer ends on x_old)."""

    name = "co2"
    Config = CO2Config
    config: CO2Config
    islands = ""  # momentum, penalty and clamp are elementwise: each rank on its shards

    def init_outer(self) -> None:
        self.momentum = [torch.zeros_like(g) for g in self.global_params]
        # elements clamped so far (identical on all peers; on an island, of this rank's shards)
        self.clipped = 0

    def register_outer(self, session: Session) -> None:
        for n, m, place in zip(self.names, self.momentum, self.placements, strict=True):
            register_shard(session, f"co2/momentum/{n}", m, place)

    def apply_outer(self, result: Reduced | None) -> None:
        if result is None:
            return
        cfg = self.config
        with torch.no_grad():
            for x_old, m, d in zip(self.global_params, self.momentum, result.tensors, strict=True):
                m.mul_(cfg.outer_momentum).add_(d, alpha=1.0 / cfg.gap_penalty)
                if cfg.clip is not None:
                    self.clipped += int((m.abs() > cfg.clip).sum())
                    m.clamp_(-cfg.clip, cfg.clip)
                x_old.add_(m, alpha=-cfg.outer_lr)

    def restart(self, delta: list[torch.Tensor] | None, contributors: int) -> None:
        for s, g in zip(self.start, self.global_params, strict=True):
            s.copy_(g)

    def metrics(self) -> dict[str, Any]:
        return {**super().metrics(), "clipped_elements": self.clipped}
