"""A peer's websocket (``GET /v1/ws?peer=<id>&run=<run_id>&protocol=<version>``): heartbeats in,
pushes out, and, where the peer sends them, its begins and commits as frames (:mod:`.frames`).

The gate let the socket in for peer ``peer`` (its token may act for it). Every frame is read
with :func:`.frames.read_uplink`:

* a heartbeat goes to the membership (and its ``timing`` to the straggler detector); a
  malformed one is not counted as one. A heartbeat whose text repeats the socket's last
  recorded one word for word (no probes in it, no other info recorded for the peer since:
  :meth:`~.membership.Membership.same_beat`) is only a sign of life: it is not decoded again,
  since recording the same info again would change nothing else;
* a begin or commit frame must name the socket's peer (else 403) and is charged to the
  identity's request bucket like an HTTP request (429 when empty, the socket stays open); it is
  handed to :class:`~.rounds.Rounds`, exactly as the HTTP request would be, and answered with a
  :class:`~.frames.RoundReply` naming its id, at once or, when held, as the run changes (the
  rounds' one waker answers every held frame; no task per frame). A frame that is not
  JSON, names an unknown ``type`` or has a field missing or mistyped is answered 400 naming
  the field (and the id it gave, or -1); the socket stays open.

A frame that is not text, or more frames than the socket's message bucket allows (heartbeats
and malformed frames), closes the socket. A closed socket evicts the peer at once (its
process exited or crashed: a live one keeps it for its whole life); the socket's begins and
commits still held are dropped with it.

:meth:`PeerSockets.record` also records the heartbeat's info a begin carries
(:attr:`~.protocol.Begin.info`, :data:`~.protocol.INFO_IN_BEGIN`), for either transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from aiohttp import WSMsgType, web

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator import wire
from isthmus.coordinator.auth import Identity
from isthmus.coordinator.frames import (
    BadFrame,
    BeginFrame,
    CommitFrame,
    read_uplink,
    reply_frame,
    reply_text,
)
from isthmus.coordinator.gate import BadRequest, Gate
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.limits import Limits
from isthmus.coordinator.rounds import Rounds
from isthmus.coordinator.stragglers import StragglerDetector

__all__ = ["PeerSockets"]

log = logging.getLogger("isthmus.coordinator")

_INTERNAL = "internal error (see the coordinator log)"
_REMOVED = "removed by the coordinator"


def _fits(transport: asyncio.BaseTransport | None, size: int) -> bool:
    """Whether writing a frame of ``size`` bytes on ``transport`` leaves it below its pause
    mark, so that aiohttp's send cannot wait for the peer: the write buffer is empty (not
    paused) and the frame with its header fits under the high-water mark."""
    if transport is None or transport.is_closing():
        return True  # the send fails at once
    try:
        if transport.get_write_buffer_size() != 0:  # type: ignore[attr-defined]
            return False
        high = transport.get_write_buffer_limits()[1]  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):
        return False
    return size + 14 <= high


class PeerSockets:
    """The websocket route of one coordinator (see the module doc)."""

    def __init__(
        self,
        *,
        hub: Hub,
        gate: Gate,
        rounds: Rounds,
        stragglers: StragglerDetector,
        limits: Limits,
    ) -> None:
        self.hub = hub
        self.gate = gate
        self.rounds = rounds
        self.stragglers = stragglers
        self.limits = limits
        self._departures = -1  # peers dropped so far, when the detector last forgot the gone
        self._sending: set[asyncio.Future[Any]] = set()  # answers sent on tasks of their own

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one peer's websocket until it closes; then evict the peer."""
        try:
            pid = int(request.query.get("peer", ""))
            protocol = int(request.query.get("protocol", wire.UNVERSIONED))
        except ValueError:
            raise BadRequest("query parameters 'peer' and 'protocol' must be integers") from None
        who = self.gate.who(request)
        name = who.name if isinstance(who, Identity) else "?"
        ws = web.WebSocketResponse(heartbeat=None, max_msg_size=self.limits.max_ws_message_bytes)
        bucket = self.gate.ws_bucket()
        await ws.prepare(request)
        hub = self.hub
        refusal = hub.stale_run(request.query.get("run"))
        if refusal is None:
            refusal = wire.refusal(protocol, them="peer", us="coordinator")
        if refusal is None:
            with hub.lock:
                if not hub.membership.heartbeat(pid, hub.now()):
                    refusal = "unknown or removed peer"
        if refusal is not None:
            await ws.send_json(wire.encode(msgs.EvictedPush(refusal)))
            await ws.close()
            return ws
        old = hub.sockets.get(pid)
        hub.sockets[pid] = ws
        if old is not None and not old.closed:
            await old.close()
        transport = request.transport
        asks: set[Any] = set()  # this socket's begins and commits in progress
        # the text of this socket's last heartbeat recorded in full, and the peer's count of
        # recorded infos after it: the same text again, with no other info recorded since,
        # says nothing new but that the peer lives
        last: tuple[str, int] | None = None
        try:
            async for raw in ws:
                if raw.type != WSMsgType.TEXT:
                    break  # not a frame of this protocol: the peer is dropped
                if last is not None and raw.data == last[0]:
                    if not bucket.take(time.monotonic()):
                        break
                    with hub.lock:
                        same = hub.membership.same_beat(pid, hub.now(), last[1])
                    if same is False:  # no longer active
                        await hub.send(ws, wire.encode(msgs.EvictedPush(_REMOVED)))
                        break
                    if same:
                        continue
                try:
                    frame = read_uplink(raw.data)
                except BadFrame as e:
                    if not bucket.take(time.monotonic()):
                        break  # a flood of them
                    if e.type != "hb":  # a malformed heartbeat is only not counted
                        await hub.send_text(ws, reply_text(e.id, status=400, error=str(e)))
                    continue
                if isinstance(frame, msgs.Heartbeat):
                    if not bucket.take(time.monotonic()):
                        break  # a flood of heartbeats: the peer is dropped
                    alive, plain = self._record(pid, frame.info)
                    if not alive:
                        await hub.send(ws, wire.encode(msgs.EvictedPush(_REMOVED)))
                        break
                    last = (raw.data, self._beats(pid)) if plain else None
                    continue
                refused = self._round(ws, transport, pid, name, frame, asks)
                if refused is not None:
                    await refused
                await self.rounds.flush()  # the answers this frame settled (its own, others')
        finally:
            for ask in list(asks):
                self.rounds.abandon(ask)
            if hub.sockets.get(pid) is ws:
                del hub.sockets[pid]
                # The peer's heartbeat connection is gone: its process exited or crashed (a live
                # process keeps it open for its whole life). Evict now rather than after a timeout.
                with hub.lock:
                    hub.membership.remove(
                        pid, hub.now(), "heartbeat connection closed (process exited or crashed)"
                    )
                hub.mutated()
        return ws

    def record(self, pid: int, info: dict[str, Any]) -> bool:
        """Record ``info`` as a heartbeat of peer ``pid`` (a heartbeat frame's, or the one a
        begin carries: :attr:`~.protocol.Begin.info`); False when the peer is no longer
        active. Malformed ``probes`` make it no heartbeat (nothing is recorded)."""
        return self._record(pid, info)[0]

    def _record(self, pid: int, info: dict[str, Any]) -> tuple[bool, bool]:
        """:meth:`record`, and whether ``info`` was recorded in full with no probes (the same
        text again would say nothing new)."""
        probes: tuple[msgs.ProbeOutcome, ...] = ()
        if "probes" in info:  # probes the coordinator asked for ride on heartbeats (isolation.py)
            info = dict(info)
            try:
                probes = wire.decode(
                    tuple[msgs.ProbeOutcome, ...], info.pop("probes"), "info.probes"
                )
            except ValueError:  # not counted as a heartbeat
                return True, False
        hub = self.hub
        with hub.lock:
            alive = hub.membership.heartbeat(pid, hub.now(), info, probes=probes)
            evicted = alive and self._watch_timing(pid, info)
        if evicted or probes:
            hub.mutated()
        return alive, not probes and not evicted

    def _beats(self, pid: int) -> int:
        with self.hub.lock:
            p = self.hub.membership.peers.get(pid)
            return -1 if p is None else p.beats

    def _round(
        self,
        ws: web.WebSocketResponse,
        transport: asyncio.BaseTransport | None,
        pid: int,
        name: str,
        frame: BeginFrame | CommitFrame,
        asks: set[Any],
    ) -> Awaitable[None] | None:
        """Hand one begin or commit frame to the rounds, its reply to be sent when it is
        decided (a socket that closed meanwhile is not an error: the peer learns the outcome
        when it asks again). A frame refused at once (403, 429) returns its reply to await."""
        msg = frame.begin if isinstance(frame, BeginFrame) else frame.commit
        if msg.peer != pid:
            why = f"this socket is peer {pid}'s; the frame names peer {msg.peer}"
            return self.hub.send_text(ws, reply_text(frame.id, status=403, error=why))
        if not self.gate.requests.take(name, time.monotonic()):
            why = f"{name} is over its request rate; slow down"
            return self.hub.send_text(ws, reply_text(frame.id, status=429, error=why))
        fid, kind = frame.id, type(frame).__name__
        ask: Any = None

        def answer(d: msgs.Decision) -> Awaitable[None] | None:
            asks.discard(ask)
            try:
                data = reply_frame(fid, self.rounds.utf8(d))
            except Exception:  # an answer that does not encode is a bug: the peer is told
                log.exception("error answering a %s frame of peer %d", kind, pid)
                data = reply_text(fid, status=500, error=_INTERNAL).encode()
            return self._send(ws, transport, data)

        def fail(e: BaseException) -> None:
            asks.discard(ask)
            log.error("error handling a %s frame of peer %d", kind, pid, exc_info=e)
            self._spawn(self.hub.send_text(ws, reply_text(fid, status=500, error=_INTERNAL)))

        if isinstance(frame, BeginFrame):
            ask = self.rounds.submit_begin(frame.begin, answer, fail)
        else:
            ask = self.rounds.submit_commit(frame.commit, answer, fail)
        if not ask.gone:  # held: answered later, unless the socket closes first
            asks.add(ask)
        return None

    def _send(
        self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None, data: bytes
    ) -> Awaitable[None] | None:
        """The sending of the text frame ``data`` (UTF-8) on ``ws``: to await in turn with
        other answers where the write cannot wait for the peer to read (the frame fits the
        socket's empty write buffer below its pause mark), else on a task of its own (a peer
        that does not read holds up only its own answers)."""
        if _fits(transport, len(data)):
            return self.hub.send_utf8(ws, data)
        self._spawn(self.hub.send_utf8(ws, data))
        return None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._sending.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._sending.discard)

    def _watch_timing(self, pid: int, info: dict[str, Any]) -> bool:
        """Feed a heartbeat's ``timing`` to the straggler detector (under the lock); record its
        events and, with the ``evict`` policy, remove a flagged peer. True if one was removed."""
        timing = info.get("timing")
        if not isinstance(timing, dict):
            return False
        m, now = self.hub.membership, self.hub.now()
        departures = sum(m.counters[k] for k in ("evictions", "leaves", "refusals"))
        if departures != self._departures:  # only a drop makes a peer inactive
            self._departures = departures
            for gone in [q for q in self.stragglers.peers if not m.is_active(q)]:
                self.stragglers.forget(gone)  # departed peers are nobody's reference
        removed = False
        for kind, detail in self.stragglers.observe(pid, m.peers[pid].name, timing):
            m.note(now, kind, **detail)
            if kind == "straggler" and self.stragglers.config.policy == "evict":
                m.remove(pid, now, f"straggler: {detail['ratio']}x the others' work time")
                self.stragglers.forget(pid)
                removed = True
        return removed
