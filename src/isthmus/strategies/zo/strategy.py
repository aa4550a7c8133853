"""Zeroth-order training with shared randomness: a few bytes per peer per step.

Malladi et al., "Fine-Tuning Language Models with Just Forward Passes" (MeZO), NeurIPS 2023,
arXiv:2305.17333; Zelikman et al., "Just One Byte (per gradient): A Note on Low-Bandwidth
Decentralized Language Model Finetuning Using Shared Randomness", arXiv:2306.10015 (2023).

MeZO estimates the gradient with two forward passes and no backward pass (SPSA): draw ``z ~ N(0,
I)`` from a seed, measure ``L+ = L(theta + eps z)`` and ``L- = L(theta - eps z)`` on one batch,
and step along ``z`` by the projected gradient ``g = (L+ - L-) / (2 eps)``. Since ``z`` is
regenerated from its seed, a peer only has to send ``g``: one byte once quantized. Every peer
regenerates every member's ``z`` and applies all the updates, so the models stay identical.

One ``step(loss_fn)`` is one round (``loss_fn()`` returns the loss of the current parameters on
this step's batch; it is called ``2 * perturbations`` times under ``torch.no_grad()``):

1. Each member draws perturbation ``k`` from the seed ``perturbation_seed(seed, round, rank, k)``
   (:mod:`isthmus.strategies.zo.math`): the round's members are ranked by peer name, so every peer
   knows every member's seeds and none travels (the rank, not the name itself: a round's plan
   lists peer ids, not names; a peer's perturbation thus depends on the round's membership,
   which is the same for every member). Members whose work must not count (resynced at
   the start of the round: a joiner, a repaired peer) send *absent* codes without running
   forward passes.
2. MeZO's in-place perturbation: ``theta += eps z``, ``L+``; ``theta -= 2 eps z``, ``L-``; then
   ``theta`` is restored *from a copy* (MeZO adds ``eps z`` back, which is not exact in floating
   point and would let each member's parameters drift by its own rounding). The forward passes
   see the same dropout masks (the RNG state is replayed for ``L-``, as MeZO resets its seed), and
   whatever they do to the model's buffers is undone.
3. ``g`` is quantized to ``bits`` bits (:class:`~isthmus.strategies.zo.math.ScalarCodec`: sign and
   a logarithmic magnitude between ``g_min`` and ``g_max``, flushed to zero below, clipped
   above; ``bits=32`` sends the float32 itself) and the packed codes, ``ceil(bits *
   perturbations / 8)`` bytes, are all-gathered in the round.
4. After the commit every peer decodes every member's codes and applies, in rank order then
   perturbation order, ``theta <- (1 - lr wd) theta - (lr / N) sum_m g_m z_m`` over the ``N``
   present estimates (:func:`~isthmus.strategies.zo.math.apply_update` spells out the operations).
   Weight decay applies to parameters of two or more dimensions.

With ``session=None`` the same happens with one member (rank 0, round = the step counter): one
MeZO step with the quantized ``g``; a one-peer run equals it bit for bit.

Bytes per step per peer: the all-gather's payload is ``ceil(bits * perturbations / 8)`` bytes
(1 with the defaults), and isthmus's accounting counts ``(world - 1)`` times that for a ring
all-gather (:func:`isthmus.comm.accounting.wire_bytes`): 3 bytes per step per peer with 4 peers.

MeZO's defaults (OPT fine-tuning): eps 1e-3, lr 1e-6 to 1e-7, one perturbation per step, batch
16, weight decay 0, and many more steps than backpropagation needs (tens of thousands). They are
this config's defaults, and they are for models of billions of parameters: the demo's small GPT
needs a much larger ``lr``. ``isthmus demo --strategy zo`` fine-tunes a pre-trained model
(:mod:`isthmus.run.pretrain`) with ``lr=1e-3`` and two perturbations per peer.

Joining by replay: every peer keeps the last ``log_rounds`` committed rounds (number, world and
codes: ``12 + world * payload`` bytes each). A stale peer (a joiner holding the run's initial
model, a peer back from an eviction, one resumed from a checkpoint) is caught up from one
source either by the state's tensors or by the log of the rounds since its own revision,
replayed on copies of its parameters; ``catch_up`` chooses (``auto``: whichever costs less time
at ``link_mbps``, counting the regeneration of every ``z`` at the source's measured seconds per
estimate). Either way every tensor is verified against the run's hashes, and a replay that
does not reproduce them is followed by the tensors (:mod:`isthmus.comm.transfer`).

Perturbation parallelism (DistZO2, "High-Throughput and Memory-Efficient Zeroth-Order
Fine-tuning LLMs with Distributed Parallel Computing"): with
``pairing="perturbation"`` the two passes of a perturbation run on two peers (see
:attr:`ZOConfig.pairing`): a step takes one forward pass per perturbation per peer instead of
two, and the run makes ``ceil(world / 2)`` estimates per step instead of ``world``.

Islands: every rank perturbs its shards with their slices of each whole ``z`` (drawn whole
from the seed: the generator cannot skip ahead, so each rank draws the whole tensor once per
perturbation and keeps its rows), the island's ranks run the forward passes together through
FSDP2 (resharded before each pass, since FSDP2 keeps the root's parameters gathered after a
forward pass without backward), and the island's losses are the mean of its ranks' (each on
its own batch); the codes computed from them are the same on every rank, the islands
all-gather them (:mod:`isthmus.strategies.island_messages`) and every rank applies the update
to its shards. That is an unsharded peer's update to the bit for the same losses (an unsharded
peer's loss on the island's batches together equals the mean of the ranks' to fp32 rounding).
``pairing="perturbation"`` is refused on islands (ValueError), and an island is resynced by
state transfer, never by replay.

Shared state: the model's trainable parameters (``model/<name>``), its frozen parameters and
integer buffers (``model/<name>``), a copy of its floating buffers (``global/<name>``) and the
step counter. No optimizer state: the optimizer passed in is not used and gradients are never
read. Buffers: the forward passes of zeroth-order steps are evaluations at perturbed points, so
they do not train buffers: every step puts the model's buffers back as they were (floating ones
from the shared copy), and BatchNorm's running statistics stay those of the start of the run
(MeZO fine-tunes transformers, whose LayerNorm has none).

Memory: the parameters, one copy of them (the exact restore), one parameter's ``z`` at a time
(in float64 on the CPU, then in the parameter's dtype) and one forward pass's activations; no
gradients, no optimizer state. Parameters are updated in their own dtype: with bf16 or fp16
parameters, steps of ``lr * g * z`` far below the parameters' precision round away (there is no
fp32 master copy, unlike the DiLoCo family's global state).

On failure: if a collective fails (a member died), the round is retried by the survivors; a
member whose rank or round did not change reuses its codes, one whose rank changed draws new
perturbations and runs its forward passes again. A non-finite loss makes that estimate absent
(logged): every peer skips it and divides by the estimates present; a round with none present
leaves the state unchanged. An exception from ``loss_fn`` restores the parameters and buffers,
fails the round for everyone and is re-raised. Calling :meth:`ZO.step` without ``loss_fn``
raises TypeError (the usual ``loss.backward(); strategy.step()`` loop does not apply). Nothing
is applied before the round commits, so a member lost after the all-gather costs the round a
retry, never a divergence. Byzantine peers: every estimate is applied as sent, and the clip at
``g_max`` bounds what one estimate can move (``lr * g_max * |z| / N``); the reducer's vector
attacks and robust rules do not act on zo.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isthmus.comm.session import Round
from isthmus.strategies.base import Strategy
from isthmus.strategies.island_messages import IslandGather, island_of
from isthmus.strategies.model_state import SharedBuffers
from isthmus.strategies.zo.catch_up import Replayer
from isthmus.strategies.zo.math import (
    ScalarCodec,
    Span,
    distinct,
    perturb_,
    perturbation,
    perturbation_seed,
    projected_gradient,
)
from isthmus.strategies.zo.pairs import paired_codes
from isthmus.strategies.zo.replay import (
    LoggedRound,
    RoundLog,
    apply_round,
    nonzero_estimates,
)

__all__ = ["ZO", "ZOConfig"]

log = logging.getLogger("isthmus.zo")

LossFn = Callable[[], torch.Tensor | float]


@dataclass(kw_only=True)
class ZOConfig:
    """Options of :class:`ZO`; the defaults are MeZO's (see the module docstring)."""

    eps: float = 1e-3
    """Perturbation scale (MeZO: 1e-3)."""
    lr: float = 1e-6
    """Learning rate of the zeroth-order SGD step (MeZO: 1e-6 to 1e-7 for OPT fine-tuning).
    A small model trained from scratch barely moves at such rates and needs a much larger one."""
    perturbations: int = 1
    """Perturbations per peer per step (MeZO's n-SPSA; MeZO: 1). Each costs two forward passes
    and ``bits`` bits on the wire."""
    bits: int = 8
    """Bits per projected gradient: 3 to 16 (sign and logarithmic magnitude) or 32 (float32,
    unquantized). 8 is Just One Byte's one byte."""
    g_min: float = 1e-3
    """Smallest magnitude the code represents; below about ``g_min / 1.06`` (8 bits) a projected
    gradient is sent as 0."""
    g_max: float = 1e3
    """Largest magnitude: larger projected gradients are clipped to it (keeping their sign)."""
    weight_decay: float = 0.0
    """Decoupled weight decay per step, ``theta *= 1 - lr * weight_decay``, on parameters of two
    or more dimensions (MeZO: 0)."""
    seed: int = 0
    """The run's perturbation seed; every peer of a run must use the same."""
    catch_up: str = "auto"
    """How this peer wants to be caught up when it is stale (a joiner, a peer back from an
    eviction or a checkpoint): ``replay`` the rounds it missed from the source's log, take a
    state ``transfer``, or ``auto``: replay when that costs less time (see ``link_mbps``). A
    replay that does not reproduce the run's hashes falls back to a transfer."""
    link_mbps: float = 100.0
    """Link rate (Mbit/s) the ``auto`` choice assumes between two peers: a transfer takes the
    state's bytes over it, a replay the log's bytes plus regenerating every ``z`` of the log."""
    pairing: str = "none"
    """``none``: every member runs both passes of its own perturbations on its own batch.
    ``perturbation`` (DistZO2's perturbation parallelism, combined with data parallelism over
    the pairs): ranks ``2p`` and ``2p + 1`` form pair ``p``; for each perturbation (seeded by the
    rank ``2p``) the even member runs the ``+eps`` pass and the odd one the ``-eps`` pass, on
    the pair's data shard ``p`` of ``ceil(world / 2)``; the odd member sends its float32 losses
    to the even one (4 bytes per perturbation, point to point), which encodes the pair's
    estimates while the odd member sends absent codes. With an odd world the last member runs
    both passes alone. ``loss_fn`` is then called as ``loss_fn(shard, shards)`` and must
    return the loss on that data shard's batch. A pair member lost in the round aborts it.
    With dropout, a pair's two passes draw their masks from two peers' RNGs (one peer replays
    the same RNG state for both passes)."""
    log_rounds: int = 100_000
    """Committed rounds each peer keeps for replays (``12 + world * bits * perturbations / 8``
    bytes each: about 1.6 MB for 100,000 rounds of 4 peers at one byte)."""

    def __post_init__(self) -> None:
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be positive and finite, got {self.eps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if not 1 <= self.perturbations <= 4096:
            raise ValueError(f"perturbations must be 1 to 4096, got {self.perturbations}")
        if not (self.weight_decay >= 0 and self.lr * self.weight_decay < 1):
            raise ValueError(
                f"weight_decay must be >= 0 with lr * weight_decay < 1, got {self.weight_decay}"
            )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.catch_up not in ("auto", "replay", "transfer"):
            raise ValueError(
                f"catch_up must be 'auto', 'replay' or 'transfer', got {self.catch_up!r}"
            )
        if self.pairing not in ("none", "perturbation"):
            raise ValueError(f"pairing must be 'none' or 'perturbation', got {self.pairing!r}")
        if not (self.link_mbps > 0 and math.isfinite(self.link_mbps)):
            raise ValueError(f"link_mbps must be positive and finite, got {self.link_mbps}")
        if self.log_rounds < 0:
            raise ValueError(f"log_rounds must be >= 0, got {self.log_rounds}")
        # the codec checks bits, g_min and g_max (and names them)
        ScalarCodec(self.bits, self.g_min, self.g_max)

    def codec(self) -> ScalarCodec:
        return ScalarCodec(self.bits, self.g_min, self.g_max)


def _rng_state(devices: set[torch.device]) -> list[tuple[torch.device, torch.Tensor]]:
    # the RNG of every device the model computes on: dropout draws from it
    out = [(torch.device("cpu"), torch.get_rng_state())]
    for d in devices:
        if d.type == "cuda":
            out.append((d, torch.cuda.get_rng_state(d)))
    return out


def _set_rng_state(states: list[tuple[torch.device, torch.Tensor]]) -> None:
    for d, s in states:
        if d.type == "cpu":
            torch.set_rng_state(s)
        else:
            torch.cuda.set_rng_state(s, d)


class ZO(Strategy):
    """Zeroth-order SGD (MeZO) with shared randomness: each peer sends its quantized projected
    gradients, every peer regenerates every perturbation. Call ``step(loss_fn)``, no backward.

    With ``session=None`` this is one MeZO step per call (with the quantized projected
    gradient). Refuses ``compression=`` and ``aggregator=`` (ValueError): what travels is already
    a few quantized scalars, and no robust rule applies to them.
    """

    name = "zo"
    islands: ClassVar[str] = ""  # shards perturbed by their slices of z, the island's mean loss
    Config = ZOConfig
    config: ZOConfig
    first_round_uses_work = True  # the forward passes run inside the round, on its batch
    takes_loss_fn: ClassVar[bool] = True
    """``step()`` takes the loss as a function instead of following ``loss.backward()``: a
    training loop (isthmus's job) reads this to call ``strategy.step(loss_fn)``."""

    def setup(self) -> None:
        if self.reducer.compressor is not None or self.reducer.aggregator is not None:
            raise ValueError(
                "zo sends quantized projected gradients (a few bytes) and applies every one: "
                "drop compression= and aggregator= (choose the bits with the bits option)"
            )
        self.codec = self.config.codec()
        self.island = island_of(self.session)
        if self.island is not None and self.config.pairing != "none":
            raise ValueError(
                "zo on islands: pairing='perturbation' splits a perturbation's two passes "
                "between two peers, point to point; it is not built for islands: use "
                "pairing='none'"
            )
        self.keep = distinct(self.params)
        # on a rank of an island each parameter is a shard: z is drawn whole and sliced
        self.spans: list[Span | None] = [
            None if x is None else (x.full_shape, x.start, x.stop) for x in self.placements
        ]
        self._device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = SharedBuffers(self.model_state.float_buffers)
        self.share_model([p.data for p in self.params], "model", self.buffers)
        self._register_counter()
        self.last_loss = math.nan
        """Mean of ``(L+ + L-) / 2`` over this peer's perturbations of the last step (an
        estimate of the loss at theta, exact to O(eps^2)); NaN if it sent no estimate."""
        self.applied = 0
        """Projected gradients applied so far (every member's)."""
        self.absent_seen = 0
        """Absent estimates seen in committed rounds (resynced members, non-finite losses)."""
        self.flushed = 0
        """This peer's estimates sent as 0 (below ``g_min``)."""
        self.clipped = 0
        """This peer's estimates clipped to ``g_max``."""
        self._cache: tuple[int, int, list[int], float] | None = None  # round, rank, codes, loss
        self.log = RoundLog(self.config.log_rounds)
        """Committed rounds this peer can serve replays of (:mod:`isthmus.strategies.zo.replay`)."""
        self.replays = 0
        """Times this peer caught up by replaying rounds (not by a state transfer)."""
        self.replayed_rounds = 0
        self.replay_bytes = 0
        """Bytes of round log this peer received for its replays."""
        self._seconds_per_estimate: float | None = None  # measured while applying rounds
        if self.session is not None and self.island is None:  # islands resync by transfer
            self.session.state.catch_up = Replayer(self)

    @property
    def payload_bytes(self) -> int:
        """Bytes this peer contributes to each round's all-gather."""
        return self.codec.payload_bytes(self.config.perturbations)

    # -- one step ---------------------------------------------------------------------------------
    def _step(self, loss_fn: LossFn | None = None) -> None:
        if loss_fn is None:
            raise TypeError(
                "zo takes the loss as a function: call strategy.step(lambda: model(x, y)[1]) "
                "instead of loss.backward(); strategy.step()"
            )
        self.check_faults("step")
        per = self.config.perturbations
        with torch.no_grad():
            if self.session is None:
                number = self.step_count
                codes = self._codes(loss_fn, number, 0)
                entry = LoggedRound(number, 1, bytes(self.codec.pack(codes).tolist()))
            else:
                codec = self.codec

                def exchange(rnd: Round) -> LoggedRound:
                    if self.config.pairing == "perturbation" and rnd.world > 1:
                        codes = paired_codes(self, loss_fn, rnd)
                    elif rnd.resynced:
                        codes = [codec.absent] * per
                        self.last_loss = math.nan
                    else:
                        codes = self._codes(loss_fn, rnd.number, rnd.rank)
                    rnd.check_faults("collective", step=self.step_count)
                    # on the parameters' device: NCCL moves only accelerator tensors
                    mine = codec.pack(codes).to(self._device)
                    if self.island is not None:  # the island's codes, sent by its leader
                        flat = IslandGather(self.island, rnd, mine).wait()
                    else:
                        flat = rnd.group.all_gather_flat(mine)
                    raw = bytes(flat.to(device="cpu").reshape(-1).tolist())
                    return LoggedRound(rnd.number, rnd.world, raw)

                entry = self.session.run_round(exchange)
                self.log.append(entry)
            self._apply(entry)
            # the last pass left FSDP2's root gathered at a perturbed point: a forward after
            # this step (an evaluation, the user's) must gather the updated shards
            self._let_go()
        self._cache = None
        self.global_step += 1
        self.local_steps += 1

    def _codes(self, loss_fn: LossFn, number: int, rank: int) -> list[int]:
        """This member's codes for round ``number`` at ``rank`` (computed once per pair)."""
        c = self._cache
        if c is not None and c[0] == number and c[1] == rank:
            self.last_loss = c[3]
            return list(c[2])
        codes, loss = self._estimate(loss_fn, number, rank)
        self._cache = (number, rank, codes, loss)
        self.last_loss = loss
        return list(codes)

    def _estimate(self, loss_fn: LossFn, number: int, rank: int) -> tuple[list[int], float]:
        """Two forward passes per perturbation; returns the codes and the mean loss. The
        parameters and buffers are as before on return, also when ``loss_fn`` raises."""
        cfg, codec, params, keep = self.config, self.codec, self.params, self.keep
        backup = [params[i].detach().clone() for i in keep]
        others = [b.detach().clone() for _, b in self.model_state.other_buffers]
        devices = {p.device for p in params}
        codes: list[int] = []
        losses: list[float] = []
        measured: list[float] = []
        try:
            for k in range(cfg.perturbations):
                seed = perturbation_seed(cfg.seed, number, rank, k)
                rng = _rng_state(devices)
                perturb_(params, keep, seed, cfg.eps, self.spans)
                measured.append(self._loss(loss_fn))
                _set_rng_state(rng)  # the same dropout masks for both passes
                perturb_(params, keep, seed, -2.0 * cfg.eps, self.spans)
                measured.append(self._loss(loss_fn))
                self._restore(backup)
            if self.island is not None:
                # the island's losses: the mean over its ranks' batches (every rank ran the same
                # passes together), the same bits on every rank, so the codes are the island's
                mean = self.island.mean([torch.tensor(measured, dtype=torch.float64)])[0]
                measured = [float(x) for x in mean.tolist()]
            for k in range(cfg.perturbations):
                plus, minus = measured[2 * k], measured[2 * k + 1]
                g = projected_gradient(plus, minus, cfg.eps)
                code = codec.encode(g)
                if not math.isfinite(g):
                    log.warning(
                        "round %d: non-finite loss (%s, %s): estimate absent", number, plus, minus
                    )
                elif codec.bits != 32 and code == 0 and g != 0:
                    self.flushed += 1
                elif codec.bits != 32 and abs(code) == codec.levels and abs(g) > cfg.g_max:
                    self.clipped += 1
                codes.append(code)
                losses.append((plus + minus) / 2)
        finally:
            self._restore(backup)
            self.buffers.restart()
            for (_, b), saved in zip(self.model_state.other_buffers, others, strict=True):
                b.copy_(saved)
        finite = [x for x in losses if math.isfinite(x)]
        return codes, (sum(finite) / len(finite) if finite else math.nan)

    def _let_go(self) -> None:
        # every pass gathers the shards as perturbed (or updated) since: FSDP2 keeps the
        # root's parameters gathered after a forward pass without backward
        self.let_go_gathered()

    def _loss(self, loss_fn: LossFn) -> float:
        self._let_go()
        return float(loss_fn())

    def _restore(self, backup: list[torch.Tensor]) -> None:
        for i, saved in zip(self.keep, backup, strict=True):
            self.params[i].copy_(saved)

    def _apply(self, entry: LoggedRound) -> None:
        """Apply a committed round, identically on every peer (and in a replay)."""
        t0 = time.perf_counter()
        n, total = self._apply_to(self.params, entry)
        nonzero = nonzero_estimates([entry], self.codec, self.config.perturbations)
        if nonzero:
            self._seconds_per_estimate = (time.perf_counter() - t0) / nonzero
        self.applied += n
        self.absent_seen += total - n

    def _apply_to(self, params: list[torch.Tensor], entry: LoggedRound) -> tuple[int, int]:
        cfg = self.config
        return apply_round(
            params,
            self.keep,
            entry,
            self.codec,
            per=cfg.perturbations,
            seed=cfg.seed,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            spans=self.spans,
        )

    def seconds_per_estimate(self) -> float:
        """Seconds this peer takes to regenerate and apply one ``z`` (the last round's figure;
        measured once on the spot before any round applied one)."""
        if self._seconds_per_estimate is None:
            t0 = time.perf_counter()
            for j, i in enumerate(self.keep):
                perturbation(0, j, self.params[i])
            self._seconds_per_estimate = time.perf_counter() - t0
        return self._seconds_per_estimate

    # -- checkpoints and metrics ------------------------------------------------------------------
    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        # the floating buffers are read from the shared copy (loaded with the shared state)
        self.buffers.restart()

    def metrics(self) -> dict[str, Any]:
        return {
            **super().metrics(),
            "zo_bits": self.codec.bits,
            "zo_payload_bytes": self.payload_bytes,
            "zo_applied": self.applied,
            "zo_absent": self.absent_seen,
            "zo_flushed": self.flushed,
            "zo_clipped": self.clipped,
            "zo_replays": self.replays,
            "zo_replayed_rounds": self.replayed_rounds,
            "zo_replay_bytes": self.replay_bytes,
            "zo_log_rounds": len(self.log),
        }
