"""A peer's begin and commit, whichever way they came: an HTTP request (``POST /v1/begin``,
``POST /v1/commit``) or a frame on the peer's heartbeat websocket (:mod:`.frames`).

Both transports hand the decoded message to :class:`Rounds`, which applies it to the membership
under the hub's lock, holds the answer while it is ``wait`` (until the run changes, at most
``poll_s``: the long poll) and returns the :class:`~.protocol.Decision`; :meth:`Rounds.text`
encodes it, a round's ``go`` once for all its members. The rules themselves are
:mod:`.membership`'s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator import wire
from isthmus.coordinator.hub import Hub

__all__ = ["Rounds"]


class Rounds:
    """Begin and commit against ``hub``'s membership, each held at most ``poll_s`` seconds."""

    def __init__(self, hub: Hub, poll_s: float) -> None:
        self.hub = hub
        self.poll_s = poll_s
        self._go: tuple[msgs.RoundPlan, tuple[str, str], str] | None = None  # the last go, encoded

    async def _hold(self, poll: Any, explain: Any) -> msgs.Decision:
        return await self.hub.hold(poll, self.poll_s, explain)

    async def begin(self, msg: msgs.Begin) -> msgs.Decision:
        """Peer ``msg.peer`` is ready for the next round. With a vote (``msg.prev``) the vote is
        recorded first, as a ``commit(ok)``: a round that aborted, an eviction or a vote still
        undecided when the poll ends is the answer, and the begin is not looked at; a committed
        one goes on to the begin, whose answer says ``prev="committed"``. A request naming
        another run is answered evicted."""
        if (stale := self.hub.stale_run(msg.run)) is not None:
            return msgs.Evicted(reason=stale)
        pid, nonce = msg.peer, msg.nonce
        if msg.prev is not None:  # the vote on the last round, exactly as a commit(ok) is
            vote = msgs.Commit(
                peer=pid, epoch=msg.prev.epoch, round=msg.prev.round, ok=True, run=msg.run
            )
            v = await self._vote(vote)
            if not isinstance(v, msgs.Committed):
                return v  # aborted, evicted, or still undecided (wait): no begin
        m = self.hub.membership
        with self.hub.lock:
            d = m.begin(
                pid,
                self.hub.now(),
                nonce=nonce,
                revision=msg.revision,
                hashes=msg.hashes,
                schema=None if msg.schema is None else list(msg.schema),
                explain=False,
            )
        self.hub.mutated()
        if isinstance(d, msgs.Wait):
            d = await self._hold(
                lambda: m.poll_begin(pid, nonce, explain=False),
                lambda: m.poll_begin(pid, nonce, now=self.hub.now()),
            )
        return d if msg.prev is None else dataclasses.replace(d, prev="committed")

    async def commit(self, msg: msgs.Commit) -> msgs.Decision:
        """A member's report of a round, held until the round is decided (or the poll ends: a
        wait). A request naming another run is answered evicted."""
        if (stale := self.hub.stale_run(msg.run)) is not None:
            return msgs.Evicted(reason=stale)
        return await self._vote(msg)

    async def _vote(self, msg: msgs.Commit) -> msgs.Decision:
        epoch, rnd = msg.epoch, msg.round
        m = self.hub.membership
        with self.hub.lock:
            d = m.commit(
                msg.peer,
                self.hub.now(),
                epoch=epoch,
                round=rnd,
                ok=msg.ok,
                error=msg.error[:2000],
                unreached=msg.unreached[:64],
                explain=False,
            )
        self.hub.mutated()
        if isinstance(d, msgs.Wait):
            d = await self._hold(
                lambda: m.poll_commit(epoch, rnd, explain=False),
                lambda: m.poll_commit(epoch, rnd),
            )
        return d

    def text(self, d: msgs.Decision) -> str:
        """``d`` as JSON text. Every member is sent the same plan, which names every member:
        a ``go`` is encoded once per round (and ``prev``) rather than once per member."""
        if isinstance(d, msgs.Go) and d.plan is not None:
            cached = self._go
            key = (d.reason, d.prev)
            if cached is None or cached[0] is not d.plan or cached[1] != key:
                cached = self._go = (d.plan, key, json.dumps(wire.encode(d)))
            return cached[2]
        return json.dumps(wire.encode(d))
