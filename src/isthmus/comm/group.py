"""One epoch's process group: torch collectives with bounded, abortable waits and byte accounting.

isthmus never moves tensor bytes itself. A :class:`Group` wraps a torch ``ProcessGroup`` (Gloo for
CPU tensors, NCCL for CUDA tensors) built for exactly one membership epoch, and adds three things
torch does not give us:

* every wait is bounded (the group timeout) *and* abortable: when the coordinator announces that
  the round failed (a peer died elsewhere), waiting collectives raise at once instead of sitting
  out Gloo's timeout;
* an abandoned group's connections are shut down (see :mod:`isthmus.comm.wires`), so that work
  Gloo would leave waiting on a silent peer fails at once; a group with work still in flight is
  never destroyed (Gloo's destructor would block until that work ends): the session parks it;
* every call records the bytes this peer puts on the wire, using the volumes of Gloo's
  algorithms (see :func:`~isthmus.comm.accounting.wire_bytes`).

A buffer handed to an operation that was abandoned may still be written by Gloo's worker thread
later. Callers must not reuse such buffers; the strategies always reduce into fresh or private
buffers, which is why the collectives here work in place on what they are given.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from isthmus.comm import stripes as striping
from isthmus.comm.accounting import CommStats, wire_bytes
from isthmus.comm.wires import Wires

__all__ = [
    "CollectiveError",
    "CommStats",
    "Group",
    "Handle",
    "build_process_group",
    "wire_bytes",
]


class CollectiveError(RuntimeError):
    """A collective failed: a peer died or went silent, the wait timed out, or the round was
    aborted by the coordinator. The round it belongs to must be aborted and retried."""


class Handle:
    """An in-flight collective. :meth:`wait` returns its result or raises :class:`CollectiveError`.

    The wait is bounded by the group's timeout and ends early when the group is aborted.
    """

    def __init__(
        self,
        group: Group,
        work: Any,
        result: Any,
        op: str,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        self._group = group
        self._work = work
        self._result = result
        self._op = op
        self._finish = finish
        # Two events on purpose: `completed` says torch finished the operation (what busy() and
        # done() report), `wakeup` also fires on an abort. One event for both made an aborted
        # group look idle, and dropping it blocked the training thread in Gloo's destructor.
        self._completed = threading.Event()
        self._wakeup = threading.Event()
        self._finished = False
        # Set by the waiter thread for works without a future (Gloo send/recv): their outcome.
        self._waited: list[BaseException | None] = []
        # When the operation finished (appended on completion): for overlap metrics.
        self.done_at: list[float] = []
        self.issued_at = time.monotonic()
        if work is None:
            self._completed.set()
            self._wakeup.set()
        else:
            # Callbacks run on another thread. They must hold nothing but the events and the
            # outcome list: if one held the last reference to this handle (and so to the group),
            # the process group's destructor would run on its own worker thread and abort the
            # process ("Resource deadlock avoided").
            ev, wake, waited, done_at = self._completed, self._wakeup, self._waited, self.done_at

            def on_done(_f: Any) -> None:
                done_at.append(time.monotonic())
                ev.set()
                wake.set()

            try:
                work.get_future().add_done_callback(on_done)
            except RuntimeError:
                # Gloo's send/recv have no future and never report is_completed() before wait();
                # a daemon thread does the blocking wait (bounded by the group's timeout).
                threading.Thread(
                    target=_wait_in_thread,
                    args=(work, ev, wake, waited, done_at),
                    daemon=True,
                    name="isthmus-wait",
                ).start()
        group._register(self)

    def done(self) -> bool:
        """True when the operation finished inside torch (successfully or not); never blocks."""
        return self._work is None or self._completed.is_set()

    def _wake(self) -> None:
        self._wakeup.set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completes and return its result.

        Raises :class:`CollectiveError` if the collective failed (a peer died), if ``timeout``
        (default: the group's timeout, measured from when the call was issued) passes, or if the
        group was aborted meanwhile. After an error the result buffers must not be reused.
        """
        if self._finished:
            return self._result
        g = self._group
        limit = g.timeout_s if timeout is None else timeout
        deadline = self.issued_at + limit
        t0 = time.monotonic()
        try:
            while not self.done():
                if g.aborted:
                    raise CollectiveError(f"{self._op} abandoned: {g.abort_reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    g.abort(f"{self._op} timed out after {limit:.1f}s")
                    raise CollectiveError(
                        f"{self._op} did not complete within {limit:.1f}s (a peer is silent or "
                        f"the link is too slow for the collective timeout)"
                    )
                self._wakeup.wait(min(remaining, 0.05))
            if g.aborted:
                raise CollectiveError(f"{self._op} abandoned: {g.abort_reason}")
            if self._waited:
                err = self._waited[0]
                if err is not None:
                    g.abort(f"{self._op} failed: {err}")
                    raise CollectiveError(f"{self._op} failed: {_short(err)}") from err
            elif self._work is not None:
                try:
                    self._work.wait()
                except Exception as e:  # Gloo raises RuntimeError with the transport's message
                    g.abort(f"{self._op} failed: {e}")
                    raise CollectiveError(f"{self._op} failed: {_short(e)}") from e
        finally:
            g.stats.wait_s += time.monotonic() - t0
        self._finished = True
        if self._finish is not None:
            self._result = self._finish(self._result)
        return self._result


def _wait_in_thread(
    work: Any,
    ev: threading.Event,
    wake: threading.Event,
    out: list[BaseException | None],
    done_at: list[float],
) -> None:
    try:
        work.wait()
        out.append(None)
    except BaseException as e:
        out.append(e)
    finally:
        done_at.append(time.monotonic())
        ev.set()
        wake.set()


def _short(e: BaseException, limit: int = 300) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s if len(s) <= limit else s[:limit] + "..."


def build_process_group(
    store: dist.Store,
    rank: int,
    world: int,
    *,
    timeout_s: float,
    backend: str = "gloo",
    interface: str | None = None,
    hostname: str | None = None,
) -> Any:
    """Build a torch process group on ``store`` without touching torch's global default group.

    ``interface`` (e.g. ``eth0``) or ``hostname`` (an address of this machine) pick where Gloo
    listens; with neither, Gloo resolves this machine's hostname, which inside network namespaces
    usually resolves to loopback and cannot be reached by other hosts. Blocks until all ``world``
    ranks have connected or ``timeout_s`` passes (then torch raises).
    """
    td = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        if interface:
            dev = dist.ProcessGroupGloo.create_device(interface=interface)
        elif hostname:
            dev = dist.ProcessGroupGloo.create_device(hostname=hostname)
        else:
            dev = dist.ProcessGroupGloo.create_default_device()
        opts._devices = [dev]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, world, opts)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, which this machine does not have")
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, world, nccl_opts)
    raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


#: tags of :meth:`Group.exchange`'s sends and receives, clear of small user tags
_EXCHANGE_TAG = 1 << 30


def forward(src: int, dst: int, world: int) -> bool:
    """Whether data from rank ``src`` to rank ``dst`` travels on the group's own connections
    (True) or on its second, reverse set (False) in :meth:`Group.exchange`: forward when ``dst``
    is less than half the ring ahead of ``src`` (ties broken by rank), so each TCP connection
    carries data one way only, the way a ring's do."""
    d = (dst - src) % world
    return d < world - d or (d == world - d and src < dst)


class _Exchange:
    """The work of one :meth:`Group.exchange`: its steps run, blocking, in :meth:`wait`, which
    :class:`Handle` calls on a thread of its own as soon as the exchange is issued."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def get_future(self) -> Any:
        raise RuntimeError("an exchange has no future; wait() runs it")

    def wait(self) -> None:
        self._run()


class Group:
    """Collectives over one epoch's process group, bounded and accounted.

    ``pg`` may be ``None`` for a world of one, where every collective is a local no-op that
    sends nothing. ``rank`` and ``world`` are positions in this epoch's sorted member list.
    ``connect_reverse``, if given, builds a second Gloo process group over the same members
    (collectively: every member calls it at the same point); :meth:`exchange` builds it on first
    use and sends on it what would otherwise share a connection with data going the other way.
    ``wires``, if given, holds the connections of both (see :func:`isthmus.comm.connect.
    connect_gloo`); :meth:`abort` shuts them down. ``stripes``: more process groups over the same
    members (see :mod:`isthmus.comm.stripes`); all_reduce, all_gather_flat and exchange then
    split their buffers over all of them, and ``connect_reverse`` must build one reverse group
    per group (a list).
    """

    def __init__(
        self,
        pg: Any,
        rank: int,
        world: int,
        *,
        timeout_s: float,
        stats: CommStats | None = None,
        name: str = "",
        connect_reverse: Callable[[], Any] | None = None,
        wires: Wires | None = None,
        stripes: Sequence[Any] = (),
    ) -> None:
        if world > 1 and pg is None:
            raise ValueError("a group of more than one peer needs a process group")
        self.pg = pg
        self.pgs = [pg, *stripes]
        self.wires = wires
        self._connect_reverse = connect_reverse
        self._reverse: Any = None
        self._reverse_lock = threading.Lock()
        self._reverse_thread: threading.Thread | None = None
        self._exchanges = 0
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.stats = stats if stats is not None else CommStats()
        self.name = name
        self.aborted = False
        self.abort_reason = ""
        self._lock = threading.Lock()
        self._inflight: list[Handle] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def _register(self, h: Handle) -> None:
        with self._lock:
            self._inflight = [x for x in self._inflight if not x.done()]
            self._inflight.append(h)

    def abort(self, reason: str) -> None:
        """Make every pending and future wait on this group raise :class:`CollectiveError`.

        Safe to call from any thread (the session calls it when the coordinator announces that
        this epoch's round aborted). With ``wires``, the group's connections are shut down, so
        operations inside Gloo fail within milliseconds (and the members at the other ends see
        the connections close); without, they keep running until they finish or time out. Either
        way their buffers must not be reused.
        """
        with self._lock:
            if not self.aborted:
                self.aborted = True
                self.abort_reason = reason
            pending = list(self._inflight)
        for h in pending:
            h._wake()
        if self.wires is not None:
            self.wires.cut(reason)

    def busy(self) -> bool:
        """True while any operation issued on this group (or the build of its reverse
        connections) may still be running inside torch."""
        with self._lock:
            self._inflight = [x for x in self._inflight if not x.done()]
            if self._inflight:
                return True
        t = self._reverse_thread
        return t is not None and t.is_alive()

    def _check(self, op: str) -> None:
        if self.aborted:
            raise CollectiveError(f"{op} on an abandoned group: {self.abort_reason}")

    def _issue(self, op: str, fn: Callable[[], Any]) -> Any:
        self._check(op)
        try:
            return fn()
        except Exception as e:  # Gloo can fail at issue time when a pair is already closed
            self.abort(f"{op} failed: {e}")
            raise CollectiveError(f"{op} failed: {_short(e)}") from e

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``t`` in place across the group. ``op``: sum, avg, max or min.

        ``avg`` is a sum followed by a division by the world size (Gloo has no AVG).
        """
        if op not in _REDUCE_OPS and op != "avg":
            raise ValueError(f"unknown reduce op {op!r}; use sum, avg, max or min")
        finish = None
        if op == "avg":
            world = self.world

            def finish(x: torch.Tensor) -> torch.Tensor:
                return x.div_(world)

        if self.world == 1:
            h = Handle(self, None, t, "all_reduce", finish)
            return h if async_op else h.wait()
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS["sum" if op == "avg" else op]
        work = self._issue("all_reduce", lambda: striping.all_reduce(self.pgs, t, opts))
        self.stats.record("all_reduce", wire_bytes("all_reduce", _nbytes(t), self.world))
        h = Handle(self, work, t, "all_reduce", finish)
        return h if async_op else h.wait()

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        """Overwrite ``t`` on every rank with rank ``src``'s ``t``."""
        if self.world == 1:
            h = Handle(self, None, t, "broadcast")
            return h if async_op else h.wait()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self._issue("broadcast", lambda: self.pg.broadcast([t], opts))
        self.stats.record(
            "broadcast", wire_bytes("broadcast", _nbytes(t), self.world, self.rank, src)
        )
        h = Handle(self, work, t, "broadcast")
        return h if async_op else h.wait()

    def all_gather(self, t: torch.Tensor, *, async_op: bool = False) -> Any:
        """Return a list of every rank's ``t`` (same shape on all ranks), in rank order."""
        if self.world == 1:
            h = Handle(self, None, [t.clone()], "all_gather")
            return h if async_op else h.wait()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        work = self._issue("all_gather", lambda: self.pg.allgather([outs], [t]))
        self.stats.record("all_gather", wire_bytes("all_gather", _nbytes(t), self.world))
        h = Handle(self, work, outs, "all_gather")
        return h if async_op else h.wait()

    def all_gather_flat(self, t: torch.Tensor, *, async_op: bool = False) -> Any:
        """Return one flat tensor holding every rank's (1-D) ``t`` concatenated in rank order."""
        flat = t.reshape(-1)
        out = torch.empty(flat.numel() * self.world, dtype=flat.dtype, device=flat.device)
        if self.world == 1:
            out.copy_(flat)
            h = Handle(self, None, out, "all_gather")
            return h if async_op else h.wait()
        work = self._issue(
            "all_gather", lambda: striping.all_gather_flat(self.pgs, flat, out, self.world)
        )
        self.stats.record("all_gather", wire_bytes("all_gather", _nbytes(flat), self.world))
        h = Handle(self, work, out, "all_gather")
        return h if async_op else h.wait()

    def all_to_all(
        self,
        inp: torch.Tensor,
        *,
        in_splits: Sequence[int] | None = None,
        out_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Any:
        """Send slice ``i`` of the 1-D ``inp`` to rank ``i``; return the concatenation of the slices
        received, in rank order. Without splits, ``inp`` is cut into ``world`` equal slices (its
        length must divide evenly)."""
        inp = inp.reshape(-1)
        if in_splits is None:
            if inp.numel() % self.world:
                raise ValueError(
                    f"all_to_all without splits needs a length divisible by {self.world}, "
                    f"got {inp.numel()}"
                )
            out_n = inp.numel()
        else:
            if out_splits is None or len(in_splits) != self.world or len(out_splits) != self.world:
                raise ValueError("all_to_all needs in_splits and out_splits of length world")
            out_n = int(sum(out_splits))
        out = torch.empty(out_n, dtype=inp.dtype, device=inp.device)
        if self.world == 1:
            out.copy_(inp)
            h = Handle(self, None, out, "all_to_all")
            return h if async_op else h.wait()
        isplits = list(in_splits) if in_splits is not None else []
        osplits = list(out_splits) if out_splits is not None else []
        work = self._issue(
            "all_to_all",
            lambda: self.pg.alltoall_base(out, inp, osplits, isplits, dist.AllToAllOptions()),
        )
        if in_splits is None:
            sent = wire_bytes("all_to_all", _nbytes(inp), self.world)
        else:
            own = int(in_splits[self.rank]) * inp.element_size()
            sent = _nbytes(inp) - own
        self.stats.record("all_to_all", sent)
        h = Handle(self, work, out, "all_to_all")
        return h if async_op else h.wait()

    def exchange(self, inp: torch.Tensor, *, async_op: bool = False) -> Any:
        """:meth:`all_to_all` with equal slices (same result, same bytes), moved the way a ring
        moves data when the group has a reverse connection set (Gloo groups the session builds).

        Why: Gloo's all_to_all sends to every peer at once over connections that then carry data
        both ways, and on shaped links (the lab's tbf) that moves the bytes markedly slower than a
        ring does (docs/BENCHMARKS.md, "All-reduce time on a quiet machine, before the
        exchange"). Here the ``world - 1`` shifts run one after the other
        (step ``k``: send to ``rank + k``, receive from ``rank - k``), and each direction of a
        pair has its own connection (see :func:`forward`), so every connection carries one flow
        one way, as in a ring.

        Every member must call it in the same order with the same length (a multiple of
        ``world``). Bounded like every collective; if the reverse group cannot be built, the
        group is aborted and :class:`CollectiveError` raised. Without a reverse set (NCCL, or a
        group built without one) this is :meth:`all_to_all`.
        """
        inp = inp.reshape(-1)
        n, r = self.world, self.rank
        if n == 1 or self._connect_reverse is None or inp.is_cuda:
            return self.all_to_all(inp, async_op=async_op)
        if inp.numel() % n:
            raise ValueError(f"exchange needs a length divisible by {n}, got {inp.numel()}")
        rev = self._reverse_group()
        reverse = rev if isinstance(rev, list) else [rev]
        rows = inp.view(n, -1)
        cuts = striping.spans(rows.shape[1], inp.element_size(), len(self.pgs))
        out = torch.empty_like(inp)
        outs = out.view(n, -1)
        outs[r].copy_(rows[r])
        base = _EXCHANGE_TAG + (self._exchanges * n) % (1 << 29)
        self._exchanges += 1

        def run() -> None:
            for k in range(1, n):
                dst, src = (r + k) % n, (r - k) % n
                if self.aborted:
                    raise CollectiveError(f"exchange abandoned: {self.abort_reason}")
                works = []
                # span i of each row on stripe i, all at once
                for i, (lo, hi) in enumerate(cuts):
                    to = self.pgs[i] if forward(r, dst, n) else reverse[i]
                    frm = self.pgs[i] if forward(src, r, n) else reverse[i]
                    works.append(to.send([rows[dst][lo:hi]], dst, base + k))
                    works.append(frm.recv([outs[src][lo:hi]], src, base + k))
                for w in works:
                    w.wait()

        self._check("all_to_all")
        self.stats.record("all_to_all", wire_bytes("all_to_all", _nbytes(inp), n))
        h = Handle(self, _Exchange(run), out, "all_to_all")
        return h if async_op else h.wait()

    def _reverse_group(self) -> Any:
        """The reverse connection set, built on first use. Connecting blocks inside torch, so it
        runs on a thread of its own while this one watches for an abort (the coordinator's, when a
        member died meanwhile) and the timeout; an abandoned build finishes on its own."""
        with self._reverse_lock:
            if self._reverse is not None:
                return self._reverse
            connect = self._connect_reverse
            assert connect is not None
            self._check("exchange")
            box: list[Any] = []

            def build() -> None:
                try:
                    box.append(connect())
                except BaseException as e:  # reported below
                    box.append(e)

            self._reverse_thread = threading.Thread(
                target=build, daemon=True, name="isthmus-reverse"
            )
            self._reverse_thread.start()
            deadline = time.monotonic() + self.timeout_s
            while not box:
                if self.aborted:
                    raise CollectiveError(f"exchange abandoned: {self.abort_reason}")
                if time.monotonic() > deadline:
                    self.abort("connecting the reverse connections timed out")
                    raise CollectiveError(
                        f"exchange: the reverse connections did not connect within "
                        f"{self.timeout_s:.1f}s (a member is silent or unreachable)"
                    )
                time.sleep(0.01)
            if isinstance(box[0], BaseException):
                self.abort(f"connecting the reverse connections failed: {box[0]}")
                raise CollectiveError(
                    f"exchange: connecting the reverse connections failed: {_short(box[0])}"
                ) from box[0]
            self._reverse = box[0]
            return self._reverse

    def send(
        self,
        t: torch.Tensor,
        dst: int,
        tag: int = 0,
        *,
        async_op: bool = False,
        label: str = "send",
    ) -> Any:
        """Send ``t`` to rank ``dst`` (matched by a :meth:`recv` with the same tag). Its bytes
        count under ``label`` in :attr:`stats` (``by_op``)."""
        work = self._issue("send", lambda: self.pg.send([t], dst, tag))
        self.stats.record(label, _nbytes(t))
        h = Handle(self, work, t, "send")
        return h if async_op else h.wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Receive into ``t`` from rank ``src``."""
        work = self._issue("recv", lambda: self.pg.recv([t], src, tag))
        h = Handle(self, work, t, "recv")
        return h if async_op else h.wait()

    def barrier(self) -> None:
        """Wait until every rank reached the barrier (bounded like every other wait)."""
        if self.world == 1:
            return
        work = self._issue("barrier", lambda: self.pg.barrier())
        Handle(self, work, None, "barrier").wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
