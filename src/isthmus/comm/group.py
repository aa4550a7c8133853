"""One epoch's process group: torch collectives with bounded, abortable waits and byte accounting.

isthmus never moves tensor bytes itself. A :class:`Group` wraps a torch ``ProcessGroup`` (Gloo for
CPU tensors, NCCL for CUDA tensors) built for exactly one membership epoch, and adds three things
torch does not give us:

* every wait ends when the transfer stops moving, never because it is long: a wait gives up
  when one of the group's connections holds data that its remote has not acknowledged for
  ``stall_s`` (the path or the remote host is gone; the error names the member at the other
  end), or when no byte moved on any connection for ``late_s`` (a member that never sends);
  a slow link that keeps moving bytes is waited for however long the transfer takes (see
  :mod:`isthmus.comm.progress`). Every wait is also abortable: when the coordinator announces
  that the round failed (a peer was evicted, another member reported a failure), waiting
  collectives raise at once;
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

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from isthmus.comm import stripes as striping
from isthmus.comm.accounting import CommStats, wire_bytes
from isthmus.comm.handle import (
    CollectiveError,
    Exchange,
    Handle,
    Watch,
    backstop_s,
    short,
)
from isthmus.comm.progress import ProgressConfig, State, Verdict
from isthmus.comm.tcpstats import TcpWatch
from isthmus.comm.unacked import Unacked, transfer_info
from isthmus.comm.wires import Wires

__all__ = [
    "CollectiveError",
    "CommStats",
    "Group",
    "Handle",
    "Watch",
    "backstop_s",
    "build_process_group",
    "transfer_info",
    "wire_bytes",
]


log = logging.getLogger("isthmus.group")

#: How often a waiting handle samples the group's connections (seconds).
SAMPLE_PERIOD_S = 0.25

#: A transfer counts as moving (:meth:`Group.moving`) while some connection advanced within
#: this many seconds (or its retransmission timeout, where longer): well inside a heartbeat
#: bound, so that on a short round trip the partners of a member that stopped stop vouching
#: for it before that bound passes.
MOVING_WINDOW_S = 2.0


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

    ``timeout_s`` bounds connecting (the reverse connections); ``stall_s`` and ``late_s`` decide
    when a wait gives up (:meth:`stuck`). With ``wires``, Gloo's own timeout of each operation on
    the group is set far beyond them (:func:`backstop_s`), so that it never ends a transfer that
    moves: the watch decides, and :meth:`abort` ends whatever Gloo still runs by shutting the
    connections down. Without ``wires`` (a group built outside a session, e.g.
    :func:`isthmus.testing.local_groups`) nothing could end an operation Gloo still runs, and a
    process group with work in flight blocks whoever drops it (its destructor waits for that
    work): every wait and every Gloo operation of such a group keeps the fixed bound
    ``timeout_s``. ``watch``: what judges progress instead of a
    :class:`~isthmus.comm.tcpstats.TcpWatch` over ``wires``' connections (tests give a fake).
    ``epoch``: the membership epoch it was built for, which heartbeats name with
    :meth:`silent_members` (None: they name none).
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
        stall_s: float = 10.0,
        late_s: float = 600.0,
        watch: Watch | None = None,
        epoch: int | None = None,
    ) -> None:
        if world > 1 and pg is None:
            raise ValueError("a group of more than one peer needs a process group")
        self.progress = ProgressConfig(stall_s=stall_s, late_s=late_s)  # validates both
        self.stall_s, self.late_s = stall_s, late_s
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
        # Sampled by the waiting handles themselves (at most every SAMPLE_PERIOD_S), so a group
        # costs no thread and nothing has to stop one when the group is retired.
        if watch is None and wires is not None and world > 1:
            watch = TcpWatch(wires.snapshot, self.progress)
        self._watch = watch
        self._sample_lock = threading.Lock()
        self._sampled_at = -SAMPLE_PERIOD_S
        self._said_moving = True  # the last answer of moving(): a change to False is logged
        self.epoch = epoch
        self._unacked = Unacked(watch, wires, rank)
        if wires is not None:
            for g in self.pgs:
                _set_backstop(g, late_s)

    def op_bound_s(self, nbytes: int) -> float:
        """Gloo's own timeout for an operation moving ``nbytes`` on this group, and the bound of
        a wait nothing watches: :func:`backstop_s` when :meth:`abort` can end the operation
        (the group has ``wires``), else the fixed ``timeout_s``."""
        return backstop_s(self.late_s, nbytes) if self.wires is not None else self.timeout_s

    def stuck(self, since: float, nbytes: int = 0) -> Verdict | None:
        """Whether a transfer issued at ``since`` (monotonic seconds) should be given up now:
        the progress watch's verdict over the group's connections when it is stuck, else None.

        Stuck means a connection holds data its remote has not acknowledged for ``stall_s``
        (state silent: the verdict names the remote), or no byte moved on any connection for
        ``late_s`` since ``since`` (its remote takes no data, or this member waits for a member
        that does not send). A group whose connections are not watched is stuck once
        :meth:`op_bound_s` of ``nbytes`` passed since ``since``."""
        now = time.monotonic()
        if self._watch is None:
            limit = self.op_bound_s(nbytes)
            if now - since < limit:
                return None
            why = f"not done {limit:.0f}s after it was issued (nothing watches its connections)"
            return Verdict(State.IDLE, True, now - since, "", why)
        self._sample(now)
        v = self._watch.verdict(since=since)
        if not v.stuck:
            return None
        if v.remote and self.wires is not None:
            # a connection labelled by its address only: name it now, the one time it matters
            name = self.wires.name_of(v.remote)
            if name != v.remote:
                v = dataclasses.replace(v, remote=name, why=v.why.replace(v.remote, name))
        return v

    def _sample(self, now: float) -> None:
        assert self._watch is not None
        with self._sample_lock:
            if now - self._sampled_at >= SAMPLE_PERIOD_S:
                self._sampled_at = now
                self._watch.sample()

    def moving(self) -> bool:
        """True while an operation on this group is in flight and its transfer is not judged
        stopped: some connection of the group advanced (bytes acknowledged or received, or a
        data segment arrived, in order or not) within :data:`MOVING_WINDOW_S`, or within its
        retransmission timeout where that is longer (a round trip behind a slow link's deep
        queue), or a connection holds sent data awaiting its acknowledgement (a live path in
        loss recovery) and is not silent. What a heartbeat reports: the coordinator tolerates
        heartbeats that queue behind this transfer's data, and stops doing so for a partner of
        this member's once this says nothing moves (a stopped member takes no data and sends
        none: this member's data to it is acknowledged by its kernel or waits behind its closed
        window, and nothing more arrives from it). A member that has sent everything and waits
        for the rest still sees the partner's segments arrive, also while one lost segment
        holds back the bytes counted as received. False for a group whose connections are not
        watched, and when nothing is in flight. An answer False after True is logged (INFO,
        each connection's quiet time and retransmission timeout). Safe from any thread."""
        if self._watch is None or self.aborted or not self.busy():
            return False
        self._sample(time.monotonic())
        v = self._watch.verdict()
        moving = v.state is not State.SILENT and (
            self._watch.moved_within(MOVING_WINDOW_S) or self._watch.in_flight()
        )
        if not moving and self._said_moving:
            # what lets the coordinator hold a partner of this member's to the short bound
            describe = getattr(self._watch, "describe", None)
            log.info(
                "%s: nothing moves on the transfer (%s)",
                self.name or "group",
                describe() if describe is not None else v.why,
            )
        self._said_moving = moving
        return moving

    def silent_members(self) -> list[tuple[int, float]]:
        """``(rank, seconds)`` of each member this member's data in flight has not reached
        past the stall rule, also once its operations completed (:class:`Unacked`); empty
        for an aborted group or one of no known epoch. Safe from any thread."""
        if self.aborted or self.epoch is None:
            return []
        return self._unacked.members(self.busy, lambda: self._sample(time.monotonic()))

    # -- lifecycle -----------------------------------------------------------------------------
    def _register(self, h: Handle) -> None:
        with self._lock:
            self._inflight = [x for x in self._inflight if not x.done()]
            self._inflight.append(h)
            self._unacked.issued()

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
            raise CollectiveError(f"{op} failed: {short(e)}") from e

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
        h = Handle(self, work, t, "all_reduce", finish, nbytes=_nbytes(t))
        return h if async_op else h.wait()

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        """Overwrite ``t`` on every rank with rank ``src``'s ``t``."""
        if self.world == 1:
            h = Handle(self, None, t, "broadcast")
            return h if async_op else h.wait()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        # Gloo's broadcast waits for the whole message at once: its bound grows with it
        opts.timeout = datetime.timedelta(seconds=self.op_bound_s(_nbytes(t)))
        work = self._issue("broadcast", lambda: self.pg.broadcast([t], opts))
        self.stats.record(
            "broadcast", wire_bytes("broadcast", _nbytes(t), self.world, self.rank, src)
        )
        h = Handle(self, work, t, "broadcast", nbytes=_nbytes(t))
        return h if async_op else h.wait()

    def all_gather(self, t: torch.Tensor, *, async_op: bool = False) -> Any:
        """Return a list of every rank's ``t`` (same shape on all ranks), in rank order."""
        if self.world == 1:
            h = Handle(self, None, [t.clone()], "all_gather")
            return h if async_op else h.wait()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        work = self._issue("all_gather", lambda: self.pg.allgather([outs], [t]))
        self.stats.record("all_gather", wire_bytes("all_gather", _nbytes(t), self.world))
        h = Handle(self, work, outs, "all_gather", nbytes=_nbytes(t) * self.world)
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
        h = Handle(self, work, out, "all_gather", nbytes=_nbytes(out))
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
        h = Handle(self, work, out, "all_to_all", nbytes=_nbytes(inp) + _nbytes(out))
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
        piece = datetime.timedelta(seconds=self.op_bound_s(_nbytes(rows[0])))
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
                    w.wait(piece)

        self._check("all_to_all")
        self.stats.record("all_to_all", wire_bytes("all_to_all", _nbytes(inp), n))
        h = Handle(self, Exchange(run), out, "all_to_all", nbytes=2 * _nbytes(inp))
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
                    f"exchange: connecting the reverse connections failed: {short(box[0])}"
                ) from box[0]
            self._reverse = box[0]
            if self.wires is not None:
                for g in self._reverse if isinstance(self._reverse, list) else [self._reverse]:
                    _set_backstop(g, self.late_s)
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
        h = Handle(self, work, t, "send", nbytes=_nbytes(t))
        return h if async_op else h.wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Receive into ``t`` from rank ``src``."""
        work = self._issue("recv", lambda: self.pg.recv([t], src, tag))
        h = Handle(self, work, t, "recv", nbytes=_nbytes(t))
        return h if async_op else h.wait()

    def barrier(self) -> None:
        """Wait until every rank reached the barrier (bounded like every other wait)."""
        if self.world == 1:
            return
        work = self._issue("barrier", lambda: self.pg.barrier())
        Handle(self, work, None, "barrier").wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _set_backstop(pg: Any, late_s: float) -> None:
    """Set ``pg``'s timeout for the operations that do not pass their own to ``late_s``: a
    Gloo collective applies it to each piece of a ring step (a few MB), and to the wait for a
    member late to the collective. A process group without the setting keeps its own."""
    set_timeout = getattr(pg, "set_timeout", None)
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=late_s))
