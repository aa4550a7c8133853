"""Waiting for one collective of a :class:`~isthmus.comm.group.Group`: :class:`Handle`, and the
error every failed wait raises (:class:`CollectiveError`).

A wait ends when torch finishes the operation, when the group is aborted (the coordinator
aborted the round), or when the group's connections say the transfer is stuck
(:meth:`Group.stuck <isthmus.comm.group.Group.stuck>`: a silent connection after ``stall_s``, no
byte moving after ``late_s``). It never ends because the transfer is long. Gloo's own timeout of
an operation is only a backstop (:func:`backstop_s`), sized so that it does not fire first.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from isthmus.comm import stripes as striping
from isthmus.comm.accounting import CommStats
from isthmus.comm.progress import State, Verdict

__all__ = [
    "MIN_RATE_BPS",
    "CollectiveError",
    "Exchange",
    "Handle",
    "Owner",
    "Watch",
    "backstop_s",
    "short",
]


class Exchange:
    """The work of one :meth:`Group.exchange`: its steps run, blocking, in :meth:`wait`, which
    :class:`Handle` calls on a thread of its own as soon as the exchange is issued."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def get_future(self) -> Any:
        raise RuntimeError("an exchange has no future; wait() runs it")

    def wait(self) -> None:
        self._run()


#: How often a waiting handle looks at its group (aborted? stuck?) while torch works, seconds.
POLL_S = 0.05

#: The slowest link the Gloo backstops are sized for (bits per second): an operation's own Gloo
#: timeout allows ``late_s`` plus its bytes at this rate, so it never fires first while the
#: progress watch runs.
MIN_RATE_BPS = 1_000_000


class CollectiveError(RuntimeError):
    """A collective failed: a peer died or went silent, the transfer stopped moving, or the round
    was aborted by the coordinator. The round it belongs to must be aborted and retried.

    ``unreached``: the members this peer could not reach, when the failure names them (a
    connection that went silent: ``rank 1 at 10.0.0.2:41234``); empty when it names nobody."""

    def __init__(self, message: str, *, unreached: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unreached: tuple[str, ...] = tuple(unreached)


class Watch(Protocol):
    """What :meth:`Group.stuck` asks: :meth:`sample` the connections now, then the
    :meth:`verdict` for a transfer issued at ``since``."""

    def sample(self) -> None: ...

    def verdict(self, *, since: float | None = None) -> Verdict: ...

    def in_flight(self) -> bool: ...

    def moved_within(self, floor_s: float) -> bool: ...


class Owner(Protocol):
    """What a :class:`Handle` needs of its group (:class:`~isthmus.comm.group.Group`)."""

    aborted: bool
    abort_reason: str
    late_s: float
    stats: CommStats

    def abort(self, reason: str) -> None: ...

    def stuck(self, since: float, nbytes: int = 0) -> Verdict | None: ...

    def op_bound_s(self, nbytes: int) -> float: ...

    def _register(self, h: Handle) -> None: ...


def backstop_s(late_s: float, nbytes: int) -> float:
    """The bound of an operation that nothing watches (and Gloo's own timeout of one that is
    watched): ``late_s`` plus ``nbytes`` at :data:`MIN_RATE_BPS`."""
    return late_s + nbytes * 8 / MIN_RATE_BPS


class Handle:
    """An in-flight collective. :meth:`wait` returns its result or raises :class:`CollectiveError`.

    The wait ends when the group's connections stop moving bytes (see :meth:`Group.stuck`) or
    the group is aborted. ``nbytes``: what the operation moves, for the bound of a group whose
    connections cannot be watched.
    """

    def __init__(
        self,
        group: Owner,
        work: Any,
        result: Any,
        op: str,
        finish: Callable[[Any], Any] | None = None,
        *,
        nbytes: int = 0,
    ) -> None:
        self._group = group
        self._nbytes = nbytes
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
                # a daemon thread does the blocking wait (bounded by the group's op_bound_s).
                td = datetime.timedelta(seconds=group.op_bound_s(nbytes))
                threading.Thread(
                    target=_wait_in_thread,
                    args=(work, ev, wake, waited, done_at, td),
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

        Raises :class:`CollectiveError` if the collective failed (a peer died), if the group's
        connections stopped moving (:meth:`Group.stuck`: a silent connection after ``stall_s``,
        naming its remote in ``unreached``; no byte moving at all after ``late_s``), if an
        explicit ``timeout`` (seconds from when the call was issued) passes, or if the group was
        aborted meanwhile. After an error the result buffers must not be reused.
        """
        if self._finished:
            return self._result
        g = self._group
        deadline = None if timeout is None else self.issued_at + timeout
        t0 = time.monotonic()
        try:
            while not self.done():
                if g.aborted:
                    raise CollectiveError(f"{self._op} abandoned: {g.abort_reason}")
                if deadline is not None and time.monotonic() >= deadline:
                    g.abort(f"{self._op} timed out after {timeout:.1f}s")
                    raise CollectiveError(
                        f"{self._op} did not complete within {timeout:.1f}s (the caller's bound)"
                    )
                v = g.stuck(self.issued_at, self._nbytes)
                if v is not None:
                    why = f"{self._op} made no progress: {v.why}"
                    g.abort(why)
                    unreached = (v.remote,) if v.state is State.SILENT and v.remote else ()
                    raise CollectiveError(why, unreached=unreached)
                self._wakeup.wait(POLL_S)
            if g.aborted:
                raise CollectiveError(f"{self._op} abandoned: {g.abort_reason}")
            if self._waited:
                err = self._waited[0]
                if err is not None:
                    g.abort(f"{self._op} failed: {err}")
                    raise CollectiveError(f"{self._op} failed: {short(err)}") from err
            elif self._work is not None:
                try:
                    self._work.wait()
                except Exception as e:  # Gloo raises RuntimeError with the transport's message
                    g.abort(f"{self._op} failed: {e}")
                    raise CollectiveError(f"{self._op} failed: {short(e)}") from e
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
    timeout: datetime.timedelta,
) -> None:
    try:
        if isinstance(work, (striping.Works, Exchange)):
            work.wait()  # ours: each piece inside is bounded by its own timeout
        else:
            work.wait(timeout)
        out.append(None)
    except BaseException as e:
        out.append(e)
    finally:
        done_at.append(time.monotonic())
        ev.set()
        wake.set()


def short(e: BaseException, limit: int = 300) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s if len(s) <= limit else s[:limit] + "..."
