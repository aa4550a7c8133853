"""The thread that writes checkpoints: one kept between saves, handed each write as a job.

Starting a thread per checkpoint costs the training thread more than it seems:
``Thread.start()`` returns only once the new thread has run, so on a machine whose cores are
busy (several peers, their writers and a data loader on a few cores) the caller waits for the
scheduler. Handing a job to a thread that already waits costs a queue put, and a
checkpointer starts its thread when it is built (:meth:`BackgroundWriter.start`), so not even
the first checkpoint pays for a start. The thread ends after ``idle_s`` without a job, so a
checkpointer that is dropped leaves nothing behind for long, and the next job starts a new one.

On failure: a job that raises is logged with its traceback and the thread goes on with the
next; its :class:`Job` is marked done either way, so nobody waits for it forever.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundWriter", "Job"]

log = logging.getLogger("isthmus.checkpoint")


class Job:
    """One write handed to the thread: :meth:`wait` for it, :attr:`done` once it ended."""

    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ended (at most ``timeout`` s if given); True once it has."""
        return self._done.wait(timeout)

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except Exception:
            log.exception("a checkpoint write failed")
        finally:
            self._done.set()


class BackgroundWriter:
    """Runs jobs one after another on one daemon thread, started on the first job and ended
    after ``idle_s`` without one."""

    def __init__(self, *, name: str = "isthmus-checkpoint", idle_s: float = 600.0) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.name, self.idle_s = name, idle_s
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread now unless one is running, so that the next job does not wait for
        it to start (it still ends after ``idle_s`` without a job)."""
        with self._lock:
            self._start_locked()

    def submit(self, fn: Callable[..., None], *args: Any) -> Job:
        """Queue ``fn(*args)`` behind the jobs before it; return its :class:`Job` at once
        (starting the thread only when none waits for jobs)."""
        job = Job(fn, args)
        with self._lock:
            self._jobs.put(job)
            self._start_locked()
        return job

    @property
    def running(self) -> bool:
        """Whether a thread is there to take the next job."""
        return self._thread is not None

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # a job put meanwhile is taken by this thread, not lost
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            job.run()
