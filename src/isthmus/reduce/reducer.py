"""How a strategy turns every peer's update into the one update all peers apply.

Three modes behind one interface, :meth:`Reducer.start` (and its blocking form :meth:`mean`):

* **plain** (default): the update is flattened into fp32 buckets (at most ``bucket_mb`` each),
  each with a trailing count element (1 for a contributing peer, 0 otherwise); the buckets are
  summed by concurrent all-reduces and divided by the reduced count.
* **compressed** (``compression="int8"``, ``"topk:0.01+ef21"``, ``"powersgd:rank=2"``, ...; see
  :func:`isthmus.reduce.compress.make_compressor`): the compressor sums the named tensors
  (PowerSGD needs their matrix shapes); the count travels in a small exact all-reduce. Compressor
  state (error feedback, warm starts) is staged: an aborted attempt's changes are discarded
  when the round is retried, and :meth:`commit` keeps them once the round committed (called by
  the session's commit hook, see :meth:`Reducer.attach`). At every new
  epoch the compressor's *shared* state is reset on every member, so a joiner and the members
  restart it from identical (empty) state instead of shipping it around; error feedback kept per
  peer (local state) survives membership changes.
* **robust** (``aggregator="krum"``, ``"nnm+multi_krum"``, ...; see
  :func:`isthmus.reduce.aggregate.make_aggregator`): the flattened update goes through the
  sharded aggregator with ``byzantine_f`` tolerated faulty peers. A non-contributing peer submits
  a vector of NaN, which every aggregator excludes (and reports). Rules that start from the
  previous aggregate (centered clipping) get the last committed one of the same epoch (none in an
  epoch's first round, so that a joiner and the members agree). When the rule cannot run (too few
  usable vectors for ``byzantine_f``), every peer alike applies nothing that round (logged).

``exact`` values (e.g. a step count) are always summed without compression or robust rules and
averaged over the contributors.

**Weights.** ``start(..., weight=w)`` makes a peer count ``w`` times (``w >= 0``; default 1): its
tensors and exact values are multiplied by ``w`` before the sum and the count element carries
``w``, so the result is ``sum_i w_i x_i / sum_i w_i``. With ``x_i`` the mean gradient over a
peer's ``w_i`` samples this is the gradient of all the samples whatever the split (DDP's fixed
global batch); with ``w_i`` the tokens of a phase it is DiLoCo's token-weighted outer gradient.
A weight of exactly 1 leaves the bits as they were. Robust rules take one vote per peer and
refuse weights other than 1. In every mode the result has identical bits on every peer. A
non-finite update is never sent: this peer contributes nothing that round (logged) and the
others' result is applied.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from isthmus.comm.group import Handle
from isthmus.comm.session import Round, Session
from isthmus.reduce.aggregate import AggregationError, make_aggregator
from isthmus.reduce.compress import Compressor, NonFiniteError, make_compressor
from isthmus.reduce.compress.compressor import all_finite

__all__ = ["OverlapTiming", "PendingMean", "Reduced", "Reducer"]

log = logging.getLogger("isthmus.reducer")

Items = list[tuple[str, torch.Tensor]]


@dataclass
class Reduced:
    """The agreed update: one tensor per input (shaped like it), the mean of the ``exact``
    values, and how many peers contributed."""

    tensors: list[torch.Tensor]
    exact: torch.Tensor | None
    contributors: int
    """The summed count: the number of contributing peers, or their summed weights."""


class PendingMean:
    """A reduction in flight, run to its end by the reducer's worker thread: the network part
    and the post-processing (finiteness check, division by the count, unflattening) both happen
    there, so the training thread pays nothing when it waits late. :meth:`wait` returns a
    :class:`Reduced` (None if nobody contributed) or raises
    :class:`~isthmus.comm.group.CollectiveError`; it is bounded by the collectives' own timeout
    and by aborts."""

    def __init__(self, future: Future[Reduced | None], timing: OverlapTiming | None = None) -> None:
        self._future: Future[Reduced | None] | None = future
        self._timing = timing
        self.issued_at = time.monotonic()
        done_at: list[float] = []
        self._done_at = done_at
        future.add_done_callback(lambda _f: done_at.append(time.monotonic()))

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> Reduced | None:
        """The reduction's result; call it once (a second call raises RuntimeError)."""
        if self._future is None:
            raise RuntimeError("this reduction was already waited for")
        t0 = time.monotonic()
        try:
            return self._future.result()
        finally:
            # Let go of the future. If it holds an error, the traceback being raised refers to
            # this frame and so to this object; keeping the future (and with it the error) would
            # close a reference cycle through the failed round's process group, and a group left
            # to the cyclic collector can be destroyed on one of Gloo's own threads, which aborts
            # the process.
            self._future = None
            if self._timing is not None:
                t1 = time.monotonic()
                finished = self._done_at[0] if self._done_at else t1
                self._timing.add(comm=max(0.0, finished - self.issued_at), blocked=t1 - t0)


class OverlapTiming:
    """How much communication time was hidden behind compute.

    For every reduction: ``comm`` is the time from issuing it to its completion, ``blocked`` the
    time the training thread spent waiting for it. ``overlap_fraction`` is the share of
    communication time the training thread did not wait for: 0 for a strategy that waits at once,
    close to 1 when reductions finish while the next steps compute.
    """

    def __init__(self) -> None:
        self.comm_s = 0.0
        self.blocked_s = 0.0
        self.reductions = 0

    def add(self, *, comm: float, blocked: float) -> None:
        self.comm_s += comm
        self.blocked_s += min(blocked, comm)
        self.reductions += 1

    @property
    def overlap_fraction(self) -> float:
        return 0.0 if self.comm_s <= 0 else max(0.0, 1.0 - self.blocked_s / self.comm_s)


class Reducer:
    """Reduce named update tensors across a round's group (see the module docstring)."""

    def __init__(
        self,
        *,
        compression: Any = None,
        aggregator: Any = None,
        byzantine_f: int = 0,
        bucket_mb: float = 25.0,
        attack: Any = None,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if byzantine_f < 0:
            raise ValueError(f"byzantine_f must be >= 0, got {byzantine_f}")
        self.bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        self.compressor: Any = None
        self.aggregator: Any = None
        if compression not in (None, "", "none"):
            self.compressor = (
                compression if isinstance(compression, Compressor) else make_compressor(compression)
            )
        if aggregator not in (None, "", "mean"):
            self.aggregator = make_aggregator(aggregator)
        if self.compressor is not None and self.aggregator is not None:
            raise ValueError(
                "compression and a robust aggregator cannot be combined: robust rules need every "
                "peer's full vector; pick one"
            )
        self.byzantine_f = byzantine_f
        # Byzantine peers only (lab and tests): ``attack(flat, round=, world=, f=)`` turns this
        # peer's honest flat update into the vector it sends; its optional ``observe(aggregate)``
        # learns each committed aggregate. See isthmus.reduce.aggregate.attacks.PeerAttack.
        self.attack = attack
        # flat aggregate of the latest attempt (epoch, vector), and of the last committed round:
        # the attacker's public knowledge and centered clipping's start
        self._staged: tuple[int, torch.Tensor] | None = None
        self._committed: tuple[int, torch.Tensor] | None = None
        self.timing = OverlapTiming()
        self.last_report: Any = None
        self.nonfinite_skips = 0  # rounds this peer's own update was non-finite (not sent)
        self.rejected_sums = 0  # rounds whose reduced update was non-finite (not applied)
        self._epoch: int | None = None
        self._attempt: weakref.ref[Round] | None = None  # the round the compressor last served
        self._worker: ThreadPoolExecutor | None = None
        self._served = False  # a reduction started since the last commit

    @property
    def mode(self) -> str:
        return "compressed" if self.compressor else "robust" if self.aggregator else "plain"

    def describe(self) -> str:
        if self.compressor is not None:
            return str(self.compressor.name)
        if self.aggregator is not None:
            return f"{self.aggregator.spec} (f={self.byzantine_f})"
        return "none"

    # -- the reduction ----------------------------------------------------------------------------
    def start(
        self,
        rnd: Round,
        items: Items,
        *,
        contribute: bool,
        exact: torch.Tensor | None = None,
        weight: float = 1.0,
    ) -> PendingMean:
        """Start reducing ``items`` (and ``exact``) across ``rnd``'s group; return at once.
        ``weight`` is how much this peer counts (see the module docstring). Raises ValueError
        for a negative or non-finite weight, or a weight other than 1 with a robust aggregator
        on a contributing peer.

        Every peer of the round must call this with the same names, shapes and ``exact`` length,
        in the same order. The plain mode issues async all-reduces from this thread and leaves
        waiting for them and finishing the result to one worker thread; the other modes run
        entirely on that worker so that their several collectives stay in order.
        """
        if not (weight >= 0 and weight < float("inf")):
            raise ValueError(f"a peer's weight must be a finite number >= 0, got {weight}")
        if weight != 1.0 and self.aggregator is not None and contribute:
            # (a peer that contributes nothing, e.g. a catch-up round's, has no vote to weigh)
            raise ValueError("robust aggregators take one vote per peer: weights do not apply")
        self._served = True
        contribute = self._check(rnd, items, contribute) and weight > 0
        if weight != 1.0 and contribute:
            items = [(n, t * weight) for n, t in items]
            exact = exact * weight if exact is not None else None
        self._staged = None
        if self.attack is not None and contribute:
            # A byzantine peer skips the honest checks: its forged vector goes out as it is.
            items = self._attacked(rnd, items)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isthmus-reduce")
        if self.mode == "plain":
            return self._plain(rnd, items, contribute, exact, weight)
        fn = self._compressed if self.compressor is not None else self._robust
        return PendingMean(
            self._worker.submit(fn, rnd, items, contribute, exact, weight), self.timing
        )

    def _attacked(self, rnd: Round, items: Items) -> Items:
        assert self.attack is not None
        tensors = [t for _, t in items]
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        bad = self.attack(flat, round=rnd.number, world=rnd.world, f=self.byzantine_f)
        return [(n, t) for (n, _), t in zip(items, _split(bad, tensors), strict=True)]

    def mean(
        self,
        rnd: Round,
        items: Items,
        *,
        contribute: bool,
        exact: torch.Tensor | None = None,
        weight: float = 1.0,
    ) -> Reduced | None:
        """Blocking form of :meth:`start`."""
        return self.start(rnd, items, contribute=contribute, exact=exact, weight=weight).wait()

    def background(self, finish: Callable[[], Reduced | None]) -> PendingMean:
        """Run a strategy's own reduction to its end (``finish``: wait for the collectives it
        issued from the training thread, decode, sum) on this reducer's worker thread, after the
        reductions started before it, timed in :attr:`timing` like the reducer's own. What
        ``finish`` raises, :meth:`PendingMean.wait` raises."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isthmus-reduce")
        return PendingMean(self._worker.submit(finish), self.timing)

    def _check(self, rnd: Round, items: Items, contribute: bool) -> bool:
        # Compressed mode checks what the compressor will see (fp32): a finite fp64 value beyond
        # the fp32 range would make the compressor refuse this peer's input mid-round.
        def finite(t: torch.Tensor) -> bool:
            if self.compressor is not None and t.dtype == torch.float64:
                t = t.float()
            return all_finite(t)  # max/min propagate NaN: no full-size boolean temporary

        if contribute and not all(finite(t) for _, t in items):
            self.nonfinite_skips += 1
            log.warning(
                "non-finite values in this peer's update in round %d: contributing nothing",
                rnd.number,
            )
            return False
        return contribute

    def _plain(
        self,
        rnd: Round,
        items: Items,
        contribute: bool,
        exact: torch.Tensor | None,
        weight: float = 1.0,
    ) -> PendingMean:
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for _, t in items:
            if buckets[-1] and size + t.numel() > self.bucket_elems:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel()
        if exact is not None:
            buckets[-1].append(exact)
        handles = [
            rnd.group.all_reduce(_flat(b, contribute, weight=weight), async_op=True)
            for b in buckets
        ]

        def finish(bufs: list[torch.Tensor]) -> Reduced | None:
            n = float(bufs[0][-1])
            if n <= 0:
                return None
            if not all(bool(torch.isfinite(buf).all()) for buf in bufs):
                # Someone sent NaN/Inf (an honest peer never does). Every peer holds the same
                # bits, so every peer rejects this round's update alike.
                self.rejected_sums += 1
                log.warning(
                    "round %d: the summed update is not finite; not applying it", rnd.number
                )
                return None
            out: list[torch.Tensor] = []
            for b, buf in zip(buckets, bufs, strict=True):
                out.extend(_split(buf[:-1].div_(n), b))
            ex = out.pop() if exact is not None else None
            if self.attack is not None:
                self._staged = (rnd.epoch, torch.cat([t.reshape(-1) for t in out]))
            return Reduced(out, ex, round(n))

        # The all-reduces are issued from this thread (their order is the same on every peer);
        # waiting for them and finishing the result runs on the worker.
        assert self._worker is not None
        return PendingMean(
            self._worker.submit(lambda: finish([h.wait() for h in handles])), self.timing
        )

    def _exact(
        self,
        rnd: Round,
        contribute: bool,
        exact: torch.Tensor | None,
        device: torch.device,
        weight: float = 1.0,
    ) -> Handle:
        extra = [] if exact is None else [exact]
        # on the items' device: NCCL groups refuse CPU tensors
        return rnd.group.all_reduce(_flat(extra, contribute, device, weight=weight), async_op=True)

    def _finish_exact(
        self, buf: torch.Tensor, exact: torch.Tensor | None
    ) -> tuple[float, torch.Tensor | None]:
        n = float(buf[-1])
        ex = buf[:-1].div_(n).view(exact.shape) if exact is not None and n > 0 else None
        return n, ex

    def _compressed(
        self,
        rnd: Round,
        items: Items,
        contribute: bool,
        exact: torch.Tensor | None,
        weight: float = 1.0,
    ) -> Reduced | None:
        self._prepare_compressor(rnd)
        # The exact all-reduce is issued before the compressor's collectives and all of them
        # from this one worker thread, so every peer issues the same sequence (Gloo matches
        # concurrent collectives by issue order; NCCL runs them in stream order).
        h = self._exact(rnd, contribute, exact, _device_of(items), weight)
        try:
            sums = self.compressor.reduce_sum_many(rnd.group, items, contribute=contribute)
        except NonFiniteError as e:
            # raised on every peer alike when the reduced sum is not finite; the update is not
            # applied, so neither is the state it staged (every peer rolls back alike)
            self.compressor.rollback()
            h.wait()
            self.rejected_sums += 1
            log.warning("round %d: %s; not applying this update", rnd.number, e)
            return None
        n, ex = self._finish_exact(h.wait(), exact)
        if n <= 0:
            return None
        return Reduced([s.div_(n) for s in sums], ex, round(n))

    def _prepare_compressor(self, rnd: Round) -> None:
        """Compressor state at the start of an attempt (runs on the worker thread, after any
        task of an abandoned attempt has finished, so nothing it stages can outlive this).

        * First reduction of a new attempt (a new :class:`Round` object): discard what an
          earlier, aborted attempt staged. Further reductions in the same round keep what the
          earlier ones staged; :meth:`commit` keeps all of it.
        * First reduction of a new epoch: the membership changed, so every member restarts the
          compressor's shared state from empty (a joiner cannot receive it) and lets the
          compressor drop state that sums over peers (EF21/EControl)."""
        attempt = self._attempt() if self._attempt is not None else None
        if attempt is rnd:
            return
        self._attempt = weakref.ref(rnd)
        self.compressor.rollback()
        if self._epoch != rnd.epoch:
            self._epoch = rnd.epoch
            self.compressor.membership_changed()
            self.compressor.reset_shared()

    def _robust(
        self,
        rnd: Round,
        items: Items,
        contribute: bool,
        exact: torch.Tensor | None,
        weight: float = 1.0,  # always 1: start() refuses other weights for robust rules
    ) -> Reduced | None:
        h = self._exact(rnd, contribute, exact, _device_of(items))
        tensors = [t for _, t in items]
        if contribute:
            vec = _flat(tensors, True)[:-1]
        else:
            vec = torch.full(
                (sum(t.numel() for t in tensors),), float("nan"), device=_device_of(items)
            )
        n, ex = self._finish_exact(h.wait(), exact)
        if n <= 0:
            return None  # nobody contributed (the same count on every peer): nothing to aggregate
        prev = self._committed
        start = prev[1] if self.aggregator.uses_start and prev and prev[0] == rnd.epoch else None
        try:
            result = self.aggregator.distributed(rnd.group, vec, self.byzantine_f, start=start)
        except AggregationError as e:
            # Raised on every peer alike (decided from the same gathered bytes), e.g. too few
            # usable vectors for byzantine_f after peers left: every peer skips this update.
            self.rejected_sums += 1
            log.warning("round %d: robust aggregation failed (%s); not applying it", rnd.number, e)
            return None
        self.last_report = result.report
        self._staged = (rnd.epoch, result.vector)
        return Reduced(_split(result.vector.to(torch.float32), tensors), ex, round(n))

    # -- state across attempts --------------------------------------------------------------------
    def attach(self, session: Session) -> None:
        """Commit this reducer's staged state (:meth:`commit`) whenever a round of ``session``
        commits in which it started a reduction, through the session's commit hook: a strategy
        never commits the reducer itself. Rounds that reduce without it change nothing here."""
        session.add_commit_hook(self._on_commit)

    def _on_commit(self, plan: object) -> None:
        if self._served:
            self.commit()

    # what it keeps is read at the next reduction only: it may run once a pipelined round's
    # verdict is known (Session.add_commit_hook)
    _on_commit.deferrable = True  # type: ignore[attr-defined]

    def commit(self) -> None:
        """The round committed: keep the state its reduction staged."""
        self._served = False
        if self.compressor is not None:
            self.compressor.commit()
        self._committed, self._staged = self._staged, None
        observe = getattr(self.attack, "observe", None)
        if observe is not None:
            observe(None if self._committed is None else self._committed[1])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)


def _device_of(items: Items) -> torch.device:
    return items[0][1].device if items else torch.device("cpu")


def _flat(
    tensors: list[torch.Tensor],
    contribute: bool,
    device: torch.device | str = "cpu",
    *,
    weight: float = 1.0,
) -> torch.Tensor:
    """A fresh fp32 buffer: the tensors back to back plus the count element (``weight``; all
    zeros when not contributing), on the tensors' device (``device`` when there are none). The
    tensors come already multiplied by the weight. Fresh on purpose: an abandoned collective may
    still write into its buffer."""
    n = sum(t.numel() for t in tensors)
    out = torch.zeros(n + 1, dtype=torch.float32, device=tensors[0].device if tensors else device)
    if contribute:
        off = 0
        for t in tensors:
            out[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        out[-1] = weight
    return out


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    off = 0
    for t in like:
        out.append(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()
    return out
