"""What every room of the coordinator shares: the membership under its lock, the clock, the run
id, the wake-up of waiting requests, and the peers' heartbeat sockets.

The server's handlers, the gate, the admin API, the rendezvous store and the dashboard each hold
the one :class:`Hub` of their coordinator and use only its public methods; none of them reaches
into another. Changes to the membership happen on the event loop, under :attr:`Hub.lock` (the
lock also guards reads from other threads: :meth:`Coordinator.status` of an embedded
coordinator); after a change the changer calls :meth:`Hub.mutated`, which sends the pushes the
membership queued and wakes every long-poll and watcher when the membership's
:meth:`~.state.RunState.stamp` moved (a change that answers no waiting request differently, a
peer's begin or commit in the middle of a round, wakes nobody: with a thousand peers waiting,
waking all of them at each of their thousand requests is what would cost).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import WSMsgType, web

from isthmus.coordinator.membership import Membership

__all__ = ["Hub"]

_timeout: Any = getattr(asyncio, "timeout", None)
"""``asyncio.timeout`` where this Python has it (3.11 and later)."""


class Hub:
    """One coordinator's shared state (see the module doc). Create it off the loop; call
    :meth:`open` on the loop before serving."""

    def __init__(self, membership: Membership, run_id: str) -> None:
        self.membership = membership
        self.run_id = run_id
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.started_at = time.time()  # wall clock of t0: events' "t" + started_at = Unix time
        self.sockets: dict[int, web.WebSocketResponse] = {}
        """Peer id -> its heartbeat websocket (the server's websocket handler keeps it)."""
        self._changed: asyncio.Event | None = None
        self._stamp: tuple[int, ...] | None = None  # the membership's stamp at the last wake-up
        self._tasks: set[asyncio.Future[Any]] = set()

    def now(self) -> float:
        """Seconds since the coordinator started (the membership's clock)."""
        return time.monotonic() - self.t0

    def open(self) -> None:
        """Bind the wake-up to the running event loop (call once, on it, before serving)."""
        self._changed = asyncio.Event()

    # -- changes --------------------------------------------------------------------------------
    def mutated(self) -> None:
        """Deliver the membership's queued pushes, and wake every long-poll and watcher if the
        membership's stamp moved since the last wake-up. Call on the loop after a change,
        without the lock."""
        assert self._changed is not None, "Hub.open was not called"
        with self.lock:
            notices = self.membership.take_notices()
            stamp = self.membership.stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            ev, self._changed = self._changed, asyncio.Event()
            ev.set()
        for members, msg in notices:
            for pid in members:
                ws = self.sockets.get(pid)
                if ws is not None and not ws.closed:
                    # Keep a reference: the loop holds tasks weakly.
                    task = asyncio.ensure_future(self.send(ws, msg))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def changed(self, timeout: float) -> None:
        """Return at the next :meth:`mutated`, or after ``timeout`` seconds."""
        if self._changed is None:  # not serving yet
            await asyncio.sleep(min(timeout, 0.05))
            return
        with contextlib.suppress(asyncio.TimeoutError):
            if _timeout is None:  # Python 3.10
                await asyncio.wait_for(self._changed.wait(), timeout)
                return
            # a thousand held requests wait here at once: a deadline on the waiting task itself
            # rather than wait_for's extra task per wait
            async with _timeout(timeout):
                await self._changed.wait()

    async def tick_forever(self, tick_s: float) -> None:
        """Apply the membership's timeouts every ``tick_s`` seconds (until cancelled), waking
        waiters whenever that changed something."""
        m = self.membership
        while True:
            await asyncio.sleep(tick_s)
            with self.lock:
                before = (m.revision, m.epoch, m.events_total)
                m.tick(self.now())
                after = (m.revision, m.epoch, m.events_total)
            if before != after or m.notices:
                self.mutated()

    # -- questions ------------------------------------------------------------------------------
    def stale_run(self, run: object) -> str | None:
        """Why a request that names run ``run`` belongs to another incarnation of this
        coordinator, or None. Peer ids start again at 0 after a coordinator restart, so an old id
        alone could name a different, newly registered peer; the run id tells them apart.
        Requests that name no run (curl) are taken at their word."""
        if run is None or run == self.run_id:
            return None
        return (
            f"this coordinator runs run {self.run_id}, not {run} (it was restarted); register again"
        )

    def live_peers(self, among: Iterable[int] | None = None) -> int:
        """How many peers (of ``among``, or of all) are active."""
        with self.lock:
            live = self.membership.roster.live
            return len(live) if among is None else sum(1 for pid in among if pid in live)

    def peer_ids(self) -> set[int]:
        """Every peer id the membership knows (active or not)."""
        with self.lock:
            return set(self.membership.peers)

    # -- sockets --------------------------------------------------------------------------------
    @staticmethod
    async def send(ws: web.WebSocketResponse, msg: dict[str, Any]) -> None:
        """Send ``msg`` on ``ws``; a peer that has gone is not an error."""
        with contextlib.suppress(Exception):
            await ws.send_json(msg)

    @staticmethod
    async def send_text(ws: web.WebSocketResponse, text: str) -> None:
        """Send the frame ``text`` on ``ws``; a peer that has gone is not an error."""
        # a thousand members' answers a round: a plain try costs less than a suppress context
        try:  # noqa: SIM105
            await ws.send_str(text)
        except Exception:
            pass

    @staticmethod
    async def send_utf8(ws: web.WebSocketResponse, data: bytes) -> None:
        """Send the text frame whose UTF-8 is ``data`` on ``ws`` (no text to encode per
        send); a peer that has gone is not an error."""
        try:
            send = getattr(ws, "send_frame", None)  # aiohttp 3.11 and later
            if send is None:
                await ws.send_str(data.decode())
            else:
                await send(data, WSMsgType.TEXT)
        except Exception:
            pass

    async def disconnect(self, pid: int, msg: dict[str, Any]) -> None:
        """Send ``msg`` to peer ``pid``'s heartbeat socket, if open, and close it (bounded: a
        vanished peer never answers the close)."""
        ws = self.sockets.get(pid)
        if ws is None or ws.closed:
            return
        await self.send(ws, msg)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(), 1.0)

    async def close_sockets(self) -> None:
        """Close every heartbeat socket at once, bounded (on shutdown)."""
        closing = [ws.close() for ws in list(self.sockets.values())]
        if closing:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), 1.0)
