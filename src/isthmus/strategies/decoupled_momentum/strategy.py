"""DeMo (``decoupled_momentum``): each step, each peer sends the top DCT components of its momentum.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (2024);
reference optimizer bloc97/DeMo (Nous Research).

Every step is one round. Each peer, per parameter, with its local momentum ``m`` (fp32):

1. ``theta <- theta * (1 - lr * weight_decay)`` (decoupled; applied with the update, step 5);
2. ``m <- decay * m + lr * g`` (g: this step's gradient);
3. compresses ``m`` (:class:`~isthmus.strategies.decoupled_momentum.math.DCTCodec`): a 2-D
   orthonormal DCT over tiles of at most ``chunk`` x ``chunk``, the ``top_k`` largest
   coefficients per tile;
4. keeps the residual: ``m <- m - q`` (``q``: the inverse DCT of what it sends);
5. all-gathers the messages, sums the present ones' coefficients in rank order, inverts the DCT
   and applies ``theta <- theta - lr * sign(sum)`` (``sign=False``: ``lr * sum / R`` over the
   ``R`` peers present).

The reference's defaults are this config's: ``decay`` 0.999, ``chunk`` 64, ``top_k`` 32, sign on,
kept after a search (docs/BENCHMARKS.md, "Defaults from a search"). Fewer coefficients per tile
cut the bytes in proportion and cost short runs more than long ones. The learning rate is the
optimizer's, and the sign step may want another one than AdamW: tune it per model and run length.
The chunk is a second knob for the same trade: a tile is at most ``chunk`` on a side but no wider
than its matrix, so on a small model the chunk changes the density. One departure: the reference
averages each coefficient over the peers that *sent* it, so a coefficient one peer picked weighs as
much as one every peer picked; isthmus sums them (the mean over the peers present, times their
count, which the sign ignores), so each coefficient weighs by how many peers picked it. The two
updates differ where the peers' selections differ.

Like the reference (a subclass of SGD), DeMo replaces the user's optimizer's update: isthmus
reads each parameter's ``lr`` and ``weight_decay`` from the optimizer's param group at every
step (so a learning-rate scheduler works), and never calls ``optimizer.step()``; the
optimizer's own state is not used. Those values are the user's, not shared state, so every peer
must hold the same ones at the same step (a scheduler driven by :attr:`DeMo.step_count`, which
a joiner receives, does; one counting the peer's own steps does not): peers whose ``lr`` differ
apply different updates, and the parity check then finds them apart and resyncs them. CPU
only for now: a model on an accelerator is refused.

Bytes per step per peer: :attr:`DeMo.payload_bytes` (6 bytes per kept coefficient plus the
header), ``(world - 1)`` times that over a ring all-gather.

Shared state: the model's parameters (``model/<name>``), the floating buffers' copy
(``global/<name>``, averaged over the peers present each step, as DDP does) and the step
counter. Local: the momenta ``m`` (in checkpoints).

Faults, joins and the momentum: a step's message is built once and ``m`` changes only after the
round commits, so an aborted attempt (a peer died) is retried by the survivors with the same
message and counted once. A **dead peer's residual** (its ``m``, never sent) is lost with it. A
**joiner** starts with ``m = 0``; in its first round it is resynced (receives theta) and sends an
absent message, and that step's gradient is dropped. A resynced peer likewise sends nothing and
keeps its ``m``; a peer whose momentum or buffers are not finite sends nothing (logged).

Islands (:mod:`isthmus.strategies.island_messages`): each rank keeps its shards of the momenta
and adds its shard of the island's gradient (FSDP2's mean over the island's ranks); the
island's leader gathers the whole momenta, encodes the message as an unsharded peer would (the
tiles of whole tensors, which a shard's rows may cut) and gives it to its ranks; the islands
all-gather their messages (cut across the ranks between islands of one size, through the
leaders otherwise); every rank inverts the summed coefficients of each whole tensor (one at
a time) and applies, and subtracts from its momenta, the part that falls in its shards. The
result is an unsharded peer's to the bit, for islands of any sizes. The inverse transform runs
on every rank over whole tensors: its compute is not divided by the island's size.

Bit parity: every peer applies the same bytes in the same order with the same operations (see
:mod:`isthmus.strategies.decoupled_momentum.math` on CPU kinds). Refuses ``compression=`` and
``aggregator=``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isthmus.reduce.compress.compressor import all_finite
from isthmus.strategies.base import Strategy
from isthmus.strategies.decoupled_momentum.math import DCTCodec
from isthmus.strategies.island_messages import (
    island_of,
    leader_message,
    whole_on_leader,
    windows,
)
from isthmus.strategies.model_state import SharedBuffers, load_tensors
from isthmus.strategies.sharded import island_snapshot
from isthmus.strategies.sparseloco import gather_messages

__all__ = ["DeMo", "DeMoConfig"]

log = logging.getLogger("isthmus.decoupled_momentum")


@dataclass(kw_only=True)
class DeMoConfig:
    """Options of :class:`DeMo`; the defaults are the reference optimizer's."""

    decay: float = 0.999
    """Momentum decay (the reference's ``compression_decay``)."""
    chunk: int = 64
    """Largest tile side of the DCT (the reference's ``compression_chunk``), at most 181."""
    top_k: int = 32
    """Coefficients kept per tile (the reference's ``compression_topk``). Fewer cut the bytes in
    proportion; short runs lose more to them than long ones."""
    sign: bool = True
    """Step along the sign of the summed components (the reference); False: their mean."""

    def __post_init__(self) -> None:
        if not 0 <= self.decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {self.decay}")
        DCTCodec([], self.chunk, self.top_k)  # names a bad chunk or top_k


class DeMo(Strategy):
    """DeMo: call :meth:`step` after every backward (instead of ``optimizer.step()``)."""

    name = "decoupled_momentum"
    islands: ClassVar[str] = ""  # whole momenta encoded on the island's leader (see _step)
    Config = DeMoConfig
    config: DeMoConfig
    first_round_uses_work = True  # the first step trains on its batch, as DDP's

    def setup(self) -> None:
        self.require_own_messages("momenta (top_k, chunk options)", "momenta and messages")
        groups: dict[int, dict[str, Any]] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                groups[id(p)] = g
        # on a rank of an island the optimizer holds the sharded (DTensor) parameters
        self.sources = [
            self.model_state.sources.get(n, p) for n, p in zip(self.names, self.params, strict=True)
        ]
        missing = [n for n, p in zip(self.names, self.sources, strict=True) if id(p) not in groups]
        if missing:
            raise ValueError(
                f"decoupled_momentum reads each parameter's lr from the optimizer, which does "
                f"not hold {missing[:3]}: pass an optimizer over all trainable parameters"
            )
        self.groups = [groups[id(p)] for p in self.sources]
        self.buffers = SharedBuffers(self.model_state.float_buffers)
        # on a rank of an island: its shards of the momenta; the codec over whole tensors
        self.momentum = [torch.zeros(p.numel(), dtype=torch.float32) for p in self.params]
        shapes = [p.shape if x is None else torch.Size(x.full_shape)
                  for p, x in zip(self.params, self.placements, strict=True)]  # fmt: skip
        self.codec = DCTCodec(
            shapes, self.config.chunk, self.config.top_k, exact=self.buffers.numel
        )
        self.island = island_of(self.session)
        self.windows = windows(self.placements, [t.rows * t.cols for t in self.codec.tilings])
        self.absent = torch.zeros(self.codec.payload_bytes, dtype=torch.uint8)
        self.absent_rounds = 0
        self.share_model([p.data for p in self.params], "model", self.buffers)
        self._register_counter()

    @property
    def payload_bytes(self) -> int:
        """Bytes of this peer's message in every step."""
        return self.codec.payload_bytes

    def _hyper(self, i: int) -> tuple[float, float]:
        g = self.groups[i]
        lr = g["lr"]
        return float(lr), float(g.get("weight_decay", 0.0))

    def _grad(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s gradient as a plain tensor (a DTensor's local shard on an island)."""
        g = self.sources[i].grad
        if g is None:
            return None
        return g.to_local() if hasattr(g, "to_local") else g  # type: ignore[no-any-return]

    def _part(self, whole: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's elements of whole tensor ``i`` (all of them on a plain peer)."""
        a, b = self.windows[i]
        return whole if (a, b) == (0, whole.numel()) else whole[a:b]

    def _step(self) -> None:
        self.check_faults("step")
        cfg, codec, island = self.config, self.codec, self.island
        snap = island_snapshot(self.session, self.buffers.snapshot())
        accumulated = []
        for i, m in enumerate(self.momentum):
            lr, _ = self._hyper(i)
            a = m.mul(cfg.decay)
            grad = self._grad(i)
            if grad is not None:
                a.add_(grad.detach().reshape(-1).to(torch.float32), alpha=lr)
            accumulated.append(a)
        message: torch.Tensor | None = None
        # on an island the leader encodes the whole momenta as an unsharded peer would
        whole = (
            accumulated if island is None else whole_on_leader(island, accumulated, self.placements)
        )
        if whole is not None:
            finite = all(map(all_finite, whole))
            if not finite:
                self.reducer.nonfinite_skips += 1
                log.warning("non-finite values in this peer's momentum: sending nothing")
            if finite and self.buffers.finite(snap):
                message = codec.encode(whole, self.buffers.flat(snap) if self.buffers else None)
        if island is not None:
            message = leader_message(island, message, codec.payload_bytes)
        messages, present = gather_messages(
            self.session, message, self.absent, lambda: self.step_count
        )
        if present:
            assert message is not None
            sent = codec.coefficients(codec.decode(message))
            for i, (m, a, q) in enumerate(zip(self.momentum, accumulated, sent, strict=True)):
                m.copy_(a.sub_(self._part(codec.inverse(q, i), i)))
        else:
            self.absent_rounds += 1
        sums, exact, n = codec.sum(messages)
        if n:
            self._apply(sums, n)
            if self.buffers:
                self.buffers.land(exact.div_(n))
        self.buffers.restart()
        self.global_step += 1
        self.local_steps += 1

    def _apply(self, sums: list[torch.Tensor], n: int) -> None:
        """theta <- theta (1 - lr wd) - lr sign(idct(sum)) (or the mean), on every peer alike."""
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(self.params, sums, strict=True)):
                lr, wd = self._hyper(i)
                update = self._part(self.codec.inverse(s, i), i)
                update = update.sign_() if self.config.sign else update.div_(n)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(update.view(p.shape).to(p.dtype), alpha=-lr)

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _local_tensors(self) -> dict[str, Any]:
        return {"momentum": dict(zip(self.names, self.momentum, strict=True))}

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        if "momentum" not in state:
            raise ValueError("local state has no 'momentum' (DeMo's residual momenta)")
        load_tensors(
            "momentum", dict(zip(self.names, self.momentum, strict=True)), state["momentum"]
        )
        self.buffers.restart()

    def metrics(self) -> dict[str, Any]:
        return {
            **super().metrics(),
            "payload_bytes": self.payload_bytes,
            "density": round(self.codec.density, 6),
            "absent_rounds": self.absent_rounds,
        }
