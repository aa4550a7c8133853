"""SparseLoCo: DiLoCo with sparse, 1- or 2-bit outer gradients and error feedback, no momentum.

Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
arXiv:2508.15706 (2025); reference code tplr-ai/SparseLoCo.

Every peer runs ``sync_every`` (H) inner steps from the global parameters theta, as in DiLoCo,
and measures its outer gradient ``delta_r = theta - theta_r``. There is no outer momentum: each
peer keeps an **error-feedback accumulator** ``e_r`` (fp32, local) and, per round,

1. ``e_r <- error_decay * e_r + delta_r``;
2. compresses it (:class:`~isthmus.strategies.sparseloco.math.SparseCodec`): in every chunk of
   ``chunk`` elements the ``top_k`` of largest magnitude, quantized to ``bits`` bits;
3. all-gathers the messages (a fixed size per fragment, the same on every peer; the largest
   is :attr:`SparseLoCo.payload_bytes`): sparse vectors do
   not sum in place, so every peer receives every message and sums the present ones **in rank
   order**, which makes the result bit-identical on every peer;
4. keeps the residual: ``e_r <- e_r - sent_r`` (what its message decodes to);
5. applies ``theta <- theta - outer_lr * (sum_r sent_r) / R`` over the ``R`` peers present.

With ``session=None`` the message of the one peer is decoded and applied the same way.

**Fragments and overlap** (``fragments`` = P, ``overlap`` = tau, ``pattern``): the rounds run on
Streaming DiLoCo's skeleton (:mod:`isthmus.strategies.streaming`): the model is cut into P
fragments, one synced every H/P steps on the committed round's schedule (``round % P``), each
with its own accumulators (those of its parameters) and its own message (the fragment's
tensors and a header with the step and all the floating buffers, the Streaming rule), so one
round sends about 1/P of the bytes (:attr:`SparseLoCo.fragment_payload_bytes`). With tau > 0 a
fragment's message is built and its all-gather started tau inner steps before the result is
applied (tau < H/P; P = 1 puts the whole model's round in flight). The defaults (P = 1, tau =
0) are the paper's SparseLoCo, its rounds those of DiLoCo. These are options of ``sparseloco``
rather than an outer rule of ``streaming``: the codec's options and SparseLoCo's own defaults
(H = 10, outer_lr 2.5, no momentum) belong here, and on ``streaming`` they would be options that
mean nothing for its default Nesterov step. Streaming's ``alpha`` must stay 0 (ValueError
naming it): mixing would keep part of a fragment's unsent progress in the local model while
its accumulator also holds it, counting it twice; each synced fragment restarts from theta, and
so the tau steps overlapped with its round are dropped for that fragment (Streaming's alpha 0).
Eager DiLoCo's whole-phase delay (tau = H) is another skeleton and is not composed here: the
config refuses tau >= H/P.

Defaults: 64 of every 4096 elements (the paper's denser setting) at 1 bit (the paper's is 2),
H = 10, ``outer_lr`` 2.5 and ``error_decay`` 0.99, the best of a search (docs/BENCHMARKS.md,
"Defaults from a search", which also has the paper's values and DiLoCo for comparison). Without
outer momentum an outer step of 1.0 is plain averaging, and a larger outer step stands in for the
momentum DiLoCo's Nesterov step gives; a slower decay keeps more of the unsent progress. One bit
encodes each value's side of the mean, each side decoded to its mean
(:mod:`isthmus.strategies.sparseloco.math`); a kept entry's 16-bit index dominates the bytes, so 1
bit instead of 2 saves far less than half. The reference tiles matrices into 64 x 64 blocks;
isthmus chunks the flattened tensor. Bytes per round per peer: one fragment's message (the whole
model's with P = 1), the all-gather sending ``(world - 1)`` times that over a ring.

Shared state (Streaming's and DiLoCo's names): theta (``global/*``), the buffers' global copy,
the step counter; no outer optimizer state. Local: the inner optimizer, the local parameters,
``e_r`` (``error``, one per parameter whatever P: a fragment's accumulators are its
parameters') and a round in flight (its outer gradient snapshot: re-issued after loading, its
message rebuilt from the same ``e_r`` and snapshot, so the same bytes), all in checkpoints.

Faults, joins and the accumulator (per fragment, each round alike):

* A round's message is built once, when the round is planned (:class:`SparseRound`); an aborted
  attempt (a peer died, also while the all-gather was in flight behind inner steps) is retried
  by the survivors with the same message, and ``e_r`` changes only after a commit, so an
  aborted round leaves every accumulator as it was and is counted once.
* A **dead peer's residual** is lost with it: the part of its outer gradients it never sent is
  never applied (as a dead DiLoCo peer's last H inner steps). The survivors' accumulators are
  unaffected; the mean is taken over the peers present in the committed round.
* A **joiner** starts with ``e_r = 0``: it has no unsent progress. Its first step is the
  catch-up round (DiLoCo's, Streaming's), in which it sends an absent message and receives theta.
* A peer resynced at a round's begin (evicted, then repaired), or by a retry after the round was
  issued, sends an absent message: its outer gradient did not start from theta and is dropped,
  while its accumulators keep the residual of earlier rounds (unsent progress on theta, sent
  in later rounds).
* A peer whose accumulator or buffers are not finite sends an absent message (logged), and its
  accumulator stays as before the round.

**Islands** (:mod:`isthmus.strategies.island_messages`): each rank keeps its shards of the
accumulators and computes ``e <- beta e + delta`` on them (elementwise); the island's leader
gathers them into whole tensors, encodes the message exactly as an unsharded peer holding them
would (the same chunks, the same quantizer statistics over the whole tensor's kept values) and
gives it to its ranks; the islands all-gather their messages (cut across the ranks between
islands of one size, through the leaders otherwise); every rank sums
them over its own shards' elements and keeps its part of the residual. The result is an
unsharded peer's to the bit, for islands of any sizes; the whole accumulators of one fragment
exist on the leader, once per round (the state stays sharded).

Refuses ``compression=`` and ``aggregator=`` (ValueError): the message is already compressed,
and robust rules do not apply to sparse sums. Not composed with DiLoCo's time budget
(``inner_budget="time"`` is refused) or its token weighting (``step(tokens=n)`` is accepted,
every present message counts once).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isthmus.comm.layout import Placement
from isthmus.comm.session import Round, Session
from isthmus.reduce.compress.compressor import all_finite
from isthmus.reduce.reducer import PendingMean, Reduced, Reducer
from isthmus.strategies.island_messages import (
    IslandGather,
    Later,
    island_of,
    leader_message,
    whole_on_leader,
    windows,
)
from isthmus.strategies.model_state import load_tensors
from isthmus.strategies.pipeline import Planned
from isthmus.strategies.sparseloco.math import SparseCodec, sum_messages
from isthmus.strategies.streaming import StreamingConfig, StreamingDiLoCo

__all__ = ["SparseGroup", "SparseLoCo", "SparseLoCoConfig", "SparseRound", "gather_messages"]

log = logging.getLogger("isthmus.sparseloco")


@dataclass(kw_only=True)
class SparseLoCoConfig(StreamingConfig):
    """Options of :class:`SparseLoCo` (see the module docstring for the defaults' sources). It
    extends Streaming DiLoCo's (and so DiLoCo's); ``outer_momentum`` and ``alpha`` must stay 0
    (the accumulator replaces the momentum; mixing would count unsent progress twice) and the
    time budget is not implemented (``inner_budget="steps"`` only)."""

    sync_every: int = 10
    """H: inner steps between rounds (of each fragment); a larger H sends fewer bytes and ends
    further from DDP's loss."""
    fragments: int = 1
    """P: fragments synced in turn, one every H/P steps, each with its own accumulators and
    message (Streaming DiLoCo's); 1: the whole model every H steps (the paper)."""
    overlap: int = 0
    """tau: inner steps a round's all-gather runs behind before its result is applied (< H/P)."""
    outer_lr: float = 2.5
    """theta <- theta - outer_lr * mean of the sent accumulators (the paper's alpha; Streaming's
    mixing ``alpha`` is another option, and must be 0 here); 1.0 is plain averaging of the sent
    parts."""
    outer_momentum: float = 0.0
    """Must be 0: SparseLoCo has no outer momentum."""
    nesterov: bool = False
    error_decay: float = 0.99
    """beta: e <- beta * e + delta before each compression."""
    chunk: int = 4096
    """Elements per chunk of the flattened tensors (at most 32768)."""
    top_k: int = 64
    """Entries kept per chunk."""
    bits: int = 1
    """Bits per kept value: 1, 2 (the paper's), 4, 8, or 32 (float32, unquantized)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outer_momentum != 0:
            raise ValueError(
                f"sparseloco has no outer momentum (its error feedback replaces it): "
                f"outer_momentum must be 0, got {self.outer_momentum}"
            )
        if self.alpha != 0:
            raise ValueError(
                f"sparseloco restarts each synced fragment from theta: alpha must be 0, got "
                f"{self.alpha} (mixing would keep unsent progress in the local model while the "
                f"accumulator holds it too, counting it twice)"
            )
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"error_decay must be in [0, 1], got {self.error_decay}")
        if not 1 <= self.top_k <= self.chunk:
            raise ValueError(f"top_k must be 1 to chunk ({self.chunk}), got {self.top_k}")
        SparseCodec([], self.chunk, self.top_k, self.bits)  # names a bad chunk or bits


def gather_messages(
    session: Session | None,
    message: torch.Tensor | None,
    absent: torch.Tensor,
    step: Callable[[], int],
) -> tuple[list[torch.Tensor], bool]:
    """Run one round that all-gathers fixed-size messages; returns (every member's message in
    rank order, whether this peer's own message was present in the committed attempt).

    ``message`` None, or a round that resynced this peer at its begin, sends ``absent`` (the
    same size). A failed collective is retried by :meth:`Session.run_round` with the same
    message; nothing is returned before a commit. Without a session the one message is returned.
    On a rank of an island ``message`` is the island's (the same on every rank, see
    :func:`~isthmus.strategies.island_messages.leader_message`): its ranks exchange it
    together (:class:`~isthmus.strategies.island_messages.IslandGather`) and every rank
    returns the same messages.
    """
    if session is None:
        return [message if message is not None else absent], message is not None
    used: dict[str, bool] = {}

    island = island_of(session)

    def exchange(rnd: Round) -> list[torch.Tensor]:
        mine = absent if message is None or rnd.resynced else message
        used["present"] = mine is message
        rnd.check_faults("collective", step=step())
        if island is not None:  # the island's one message, exchanged by its ranks together
            return list(IslandGather(island, rnd, mine).wait())
        flat = rnd.group.all_gather_flat(mine)
        return list(flat.view(rnd.world, -1))

    messages = session.run_round(exchange)
    return messages, used["present"]


class SparseGroup:
    """The error-feedback accumulators of one group of parameters (the whole model, or one
    fragment) and the codec of their message; :meth:`round` plans one round of them."""

    def __init__(
        self,
        error: list[torch.Tensor],
        shapes: Sequence[torch.Size],
        config: SparseLoCoConfig,
        exact: int,
        *,
        placements: Sequence[Placement | None] = (),
        island: Any = None,
    ) -> None:
        """``shapes`` are the whole tensors'; on a rank of an ``island``, ``error`` holds this
        rank's shards of the accumulators, ``placements`` where they lie in the whole ones."""
        self.error = error  # the strategy's own tensors (flat fp32), updated in place
        self.decay = config.error_decay
        self.codec = SparseCodec(shapes, config.chunk, config.top_k, config.bits, exact=exact)
        self.absent = torch.zeros(self.codec.payload_bytes, dtype=torch.uint8)
        self.absent_rounds = 0  # committed rounds this peer took part in without a message
        self.island = island
        self.placements = list(placements) or [None] * len(error)
        self.windows = windows(self.placements, [lay.numel for lay in self.codec.layouts])

    def round(
        self,
        deltas: Sequence[torch.Tensor],
        exact: torch.Tensor | None,
        contribute: bool,
        reducer: Reducer,
    ) -> SparseRound:
        return SparseRound(self, deltas, exact, contribute, reducer)

    def mean(self, messages: Sequence[torch.Tensor]) -> Reduced | None:
        """The round's result from every member's message, in rank order (None: none present)."""
        sums, exact, n = sum_messages(self.codec, messages, self.windows)
        if not n:
            return None
        return Reduced([s.div_(n) for s in sums], exact.div_(n), n)


class SparseRound:
    """One round of one :class:`SparseGroup` (an :class:`~isthmus.strategies.pipeline.Exchange`):
    ``e <- decay e + delta`` and its message, built once when the round is planned, so that a
    retried attempt sends the same bytes; the accumulators change only in :meth:`commit`.

    A non-finite accumulator is not sent (``reducer.nonfinite_skips``, logged): the round sends
    an absent message and the accumulators stay as they were.

    On a rank of an island the accumulators are shards: their whole tensors are gathered on the
    island's leader, which encodes the message (an unsharded peer's bytes for the same whole
    accumulators) and gives it to every rank
    (:mod:`~isthmus.strategies.island_messages`); each rank keeps its shards' part of the
    residual and of the result."""

    def __init__(
        self,
        group: SparseGroup,
        deltas: Sequence[torch.Tensor],
        exact: torch.Tensor | None,
        contribute: bool,
        reducer: Reducer,
    ) -> None:
        self.group, self.reducer = group, reducer
        self.accumulated: list[torch.Tensor] = []
        self.message: torch.Tensor | None = None
        self.sent = False  # whether the latest attempt sent the message (not the absent one)
        if not contribute:
            return  # nothing is computed for a round that cannot count
        acc = [
            e.mul(group.decay).add_(d.reshape(-1).to(torch.float32))
            for e, d in zip(group.error, deltas, strict=True)
        ]
        island = group.island
        whole = acc if island is None else whole_on_leader(island, acc, group.placements)
        if whole is not None:  # a plain peer, or the island's leader
            if all(map(all_finite, whole)):
                self.message = group.codec.encode(whole, exact)
            else:
                reducer.nonfinite_skips += 1
                log.warning("non-finite values in this peer's accumulator: sending nothing")
        if island is not None:
            self.message = leader_message(island, self.message, group.codec.payload_bytes)
        if self.message is not None:
            self.accumulated = acc

    def _mine(self, contribute: bool) -> torch.Tensor:
        self.sent = contribute and self.message is not None
        return self.message if self.message is not None and self.sent else self.group.absent

    def start(self, rnd: Round, contribute: bool) -> PendingMean:
        """All-gather this attempt's message (from the training thread, so every member issues
        its collectives in one order); decoding and summing run on the reducer's worker. On a
        rank of an island the all-gather across islands runs in the background, and sharing its
        result inside the island, the decoding and the sum run when the round is waited for,
        on the training thread (the island's collectives keep one order on every rank)."""
        world = rnd.world
        group = self.group
        if group.island is not None:  # waited for on the training thread (see above)
            gathered = IslandGather(group.island, rnd, self._mine(contribute))
            return Later(lambda: group.mean(list(gathered.wait())))  # type: ignore[return-value]
        handle = rnd.group.all_gather_flat(self._mine(contribute), async_op=True)
        return self.reducer.background(lambda: group.mean(list(handle.wait().view(world, -1))))

    def alone(self, contribute: bool) -> Reduced | None:
        return self.group.mean([self._mine(contribute)])

    def commit(self) -> None:
        """The residual: ``e <- accumulated - sent`` if the committed attempt sent the message;
        otherwise the accumulators stay as they were."""
        if not self.sent or self.message is None:
            self.group.absent_rounds += 1
            return
        codec = self.group.codec
        sent = codec.dense(codec.decode(self.message), self.group.windows)
        for e, a, s in zip(self.group.error, self.accumulated, sent, strict=True):
            e.copy_(a.sub_(s))


class SparseLoCo(StreamingDiLoCo):
    """SparseLoCo around the user's inner optimizer. Call :meth:`step` after every backward and
    :meth:`finish` once at the end (it settles the round in flight and syncs each other fragment
    once; see :meth:`StreamingDiLoCo.final_round` for the steps a round in flight leaves out)."""

    name = "sparseloco"
    islands: ClassVar[str] = ""  # whole accumulators encoded on the leader (SparseRound)
    Config = SparseLoCoConfig
    config: SparseLoCoConfig

    def setup(self) -> None:
        self.require_own_messages(
            "outer gradients (top_k, chunk, bits options)", "accumulators and messages"
        )
        # Streaming's state (theta, buffers, counters, fragments; its outer SGD has no momentum
        # and no state, and is not used: _outer_update is this class's)
        super().setup()
        # on a rank of an island: its shards of the accumulators, the codec over whole tensors
        self.error = [torch.zeros(p.numel(), dtype=torch.float32) for p in self.params]
        shapes = [p.shape if x is None else torch.Size(x.full_shape)
                  for p, x in zip(self.params, self.placements, strict=True)]  # fmt: skip
        exact = 1 + self.buffers.numel  # the step and every floating buffer ride in the header
        self.groups = [
            SparseGroup(
                [self.error[i] for i in idx],
                [shapes[i] for i in idx],
                self.config,
                exact,
                placements=[self.placements[i] for i in idx],
                island=island_of(self.session),
            )
            for idx in self.fragments
        ]

    @property
    def fragment_payload_bytes(self) -> list[int]:
        """Bytes of this peer's message in a round of each fragment."""
        return [g.codec.payload_bytes for g in self.groups]

    @property
    def payload_bytes(self) -> int:
        """Bytes of this peer's message in the largest round (every round with one fragment)."""
        return max(self.fragment_payload_bytes)

    @property
    def absent_rounds(self) -> int:
        """Committed rounds this peer took part in without a message."""
        return sum(g.absent_rounds for g in self.groups)

    def _step(self, tokens: float = 1.0) -> None:
        """One inner step; ``tokens`` is accepted (and checked) but does not weigh anything:
        every present message counts once. Raises ValueError for a negative or non-finite
        count."""
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens}")
        super()._step()

    def _planned(self, fragment: int, plan: Planned) -> Planned:
        rnd = self.groups[fragment].round(
            [t for _, t in plan.items], plan.exact, plan.contribute, self.reducer
        )
        plan.exchange = rnd
        plan.contribute = rnd.message is not None
        return plan

    def _outer_update(self, idx: Sequence[int], mean: Sequence[torch.Tensor]) -> None:
        """theta_f <- theta_f - outer_lr * mean (flat fp32 tensors); the step counter, the
        buffers and the restart from theta are Streaming's."""
        with torch.no_grad():
            for i, d in zip(idx, mean, strict=True):
                g = self.global_params[i]
                g.add_(d.view(g.shape).to(g.dtype), alpha=-self.config.outer_lr)

    # -- local state (checkpoints) ----------------------------------------------------------------
    def _local_tensors(self) -> dict[str, Any]:
        return {**super()._local_tensors(), "error": dict(zip(self.names, self.error, strict=True))}

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state.get("error"), Mapping):
            raise ValueError("local state has no 'error' (SparseLoCo's accumulators)")
        # checked (and staged) before Streaming loads its part: a misshapen accumulator must
        # leave everything as it was, not half the state loaded
        staged = {n: torch.empty_like(e) for n, e in zip(self.names, self.error, strict=True)}
        load_tensors("error", staged, state["error"])
        super()._load_local_tensors(state)
        with torch.no_grad():
            for e, t in zip(self.error, staged.values(), strict=True):
                e.copy_(t)

    def metrics(self) -> dict[str, Any]:
        kept = sum(lay.kept for g in self.groups for lay in g.codec.layouts)
        whole = sum(lay.numel for g in self.groups for lay in g.codec.layouts)
        return {
            **super().metrics(),
            "payload_bytes": self.payload_bytes,
            "fragment_payload_bytes": self.fragment_payload_bytes,
            "density": round(kept / max(1, whole), 6),
            "absent_rounds": self.absent_rounds,
        }
