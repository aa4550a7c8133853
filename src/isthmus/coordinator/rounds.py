"""A peer's begin and commit, whichever way they came: an HTTP request (``POST /v1/begin``,
``POST /v1/commit``) or a frame on the peer's heartbeat websocket (:mod:`.frames`).

Both transports hand the decoded message to :class:`Rounds`, which applies it to the membership
under the hub's lock and answers it with the :class:`~.protocol.Decision`; an answer that is
``wait`` is *held* (until the run changes, at most ``poll_s``: the long poll). :meth:`Rounds.text`
encodes a decision, a round's ``go`` once for all its members. The rules themselves are
:mod:`.membership`'s.

Held requests do not each wait on their own: they sit in one table, in the order of their
deadlines, and one task (the *waker*) asks every held question again when the hub says the run
changed, answers those that are no longer ``wait`` and, at a deadline, answers ``wait`` with its
reason. With a thousand members, a round ends a thousand held questions with one pass over the
table; questions that are the same for every member (where round ``r`` of epoch ``e`` stands)
are asked once per pass. :meth:`Rounds.submit_begin` and :meth:`Rounds.submit_commit` take a
callback for the answer (the websocket's frames); :meth:`Rounds.begin` and :meth:`Rounds.commit`
are the same as coroutines (the HTTP handlers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator import wire
from isthmus.coordinator.hub import Hub

__all__ = ["Answer", "HeldTable", "Rounds"]

log = logging.getLogger("isthmus.coordinator")

Answer = Callable[[msgs.Decision], "Awaitable[None] | None"]
"""Takes a request's decision. It may return an awaitable (a frame to send): whoever caused the
answer awaits it through :meth:`Rounds.flush`."""


def _spent(_: object) -> None:
    """What an answered ask's ``answer`` and ``fail`` become (see :meth:`Rounds._finish`)."""


class _Ask:
    """One begin or commit in progress: what takes its answer, where it is held (if it is), and
    whether its asker has gone (a cancelled HTTP request, a closed socket)."""

    __slots__ = ("answer", "fail", "gone", "slot")

    def __init__(self, answer: Answer, fail: Callable[[BaseException], None]) -> None:
        self.answer = answer
        self.fail = fail
        self.slot = -1  # its entry in the held table, or -1
        self.gone = False


class _Held:
    """A held question: ``poll`` (under the lock) until it is not ``wait``, then ``then``;
    at ``deadline`` (the loop's clock) the answer is ``explain()``, the wait with its reason.
    Entries with the same ``key`` ask the same question."""

    __slots__ = ("ask", "deadline", "explain", "key", "poll", "then")

    def __init__(
        self,
        key: Hashable,
        poll: Callable[[], msgs.Decision],
        explain: Callable[[], msgs.Decision],
        deadline: float,
        ask: _Ask,
        then: Callable[[msgs.Decision], None],
    ) -> None:
        self.key, self.poll, self.explain = key, poll, explain
        self.deadline, self.ask, self.then = deadline, ask, then


class HeldTable:
    """The held questions, in the order they were put (their deadlines are put time plus one
    constant, so that is also deadline order). Pure bookkeeping: no clock, no lock."""

    def __init__(self) -> None:
        self._entries: dict[int, _Held] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, held: _Held) -> int:
        """Hold ``held``; its slot number (later deadlines get larger ones)."""
        n = self._next
        self._next += 1
        self._entries[n] = held
        return n

    def drop(self, slot: int) -> None:
        """Forget slot ``slot`` (answered or abandoned); one that is not held is ignored."""
        self._entries.pop(slot, None)

    def first_deadline(self) -> float | None:
        """The earliest deadline held, or None when nothing is."""
        for held in self._entries.values():
            return held.deadline
        return None

    def decide(self, now: float) -> list[tuple[_Held, msgs.Decision]]:
        """Ask every held question once (the caller holds the lock): those no longer ``wait``,
        and those whose deadline is ``now`` or earlier (answered with their reason), leave the
        table and are returned with their answers, in slot order. A question shared by several
        entries (the same key) is asked once."""
        done: list[tuple[_Held, msgs.Decision]] = []
        seen: dict[Hashable, msgs.Decision] = {}
        gone: list[int] = []
        for slot, held in self._entries.items():
            d = seen.get(held.key)
            if d is None:
                d = seen[held.key] = held.poll()
            if d.kind == "wait":
                if held.deadline > now:
                    continue
                d = held.explain()
            gone.append(slot)
            done.append((held, d))
        for slot in gone:
            del self._entries[slot]
        return done


class Rounds:
    """Begin and commit against ``hub``'s membership, each held at most ``poll_s`` seconds."""

    def __init__(self, hub: Hub, poll_s: float) -> None:
        self.hub = hub
        self.poll_s = poll_s
        # the last go, encoded (as text and as UTF-8)
        self._go: tuple[msgs.RoundPlan, tuple[str, str], str, bytes] | None = None
        self._voted_go: tuple[msgs.Decision, msgs.Decision] | None = None  # a go, with prev
        self._held = HeldTable()
        self._sends: list[Awaitable[None]] = []  # answers' frames not yet sent
        self._waker: asyncio.Task[None] | None = None
        self._changed = False  # an answer changed the membership during the waker's pass
        self._passing = False  # the waker's pass is answering held questions
        self._pass_mutated = False  # and one of its answers changed the membership
        self.on_info: Callable[[int, dict[str, Any]], object] | None = None
        """Records a begin's :attr:`~.protocol.Begin.info` as peer ``peer``'s heartbeat (the
        server sets it to its sockets' recorder); without it the info is ignored."""

    # -- the coroutine form (HTTP) ----------------------------------------------------------------
    async def begin(self, msg: msgs.Begin) -> msgs.Decision:
        """:meth:`submit_begin`, answered as the coroutine's result."""
        return await self._await(lambda ask: self._begin(msg, ask))

    async def commit(self, msg: msgs.Commit) -> msgs.Decision:
        """:meth:`submit_commit`, answered as the coroutine's result."""
        return await self._await(lambda ask: self._commit(msg, ask))

    async def _await(self, start: Callable[[_Ask], None]) -> msgs.Decision:
        fut: asyncio.Future[msgs.Decision] = asyncio.get_running_loop().create_future()

        def answer(d: msgs.Decision) -> None:
            if not fut.done():
                fut.set_result(d)

        def fail(e: BaseException) -> None:
            if not fut.done():
                fut.set_exception(e)

        ask = _Ask(answer, fail)
        self._run(ask, start)
        try:
            return await fut
        finally:
            self.abandon(ask)  # cancelled (the client went away): held no longer

    # -- the callback form (frames) ---------------------------------------------------------------
    def submit_begin(
        self, msg: msgs.Begin, answer: Answer, fail: Callable[[BaseException], None]
    ) -> _Ask:
        """Peer ``msg.peer`` is ready for the next round; ``answer`` gets the decision, now or
        when it is decided (``fail`` gets an error raised while deciding it). With a vote
        (``msg.prev``) the vote is recorded first, as a ``commit(ok)``: a round that aborted,
        an eviction or a vote still undecided when the poll ends is the answer, and the begin
        is not looked at; a committed one goes on to the begin, whose answer says
        ``prev="committed"``. A request naming another run is answered evicted. Returns the
        request's handle for :meth:`abandon`; await :meth:`flush` after it."""
        ask = _Ask(answer, fail)
        self._run(ask, lambda a: self._begin(msg, a))
        return ask

    def submit_commit(
        self, msg: msgs.Commit, answer: Answer, fail: Callable[[BaseException], None]
    ) -> _Ask:
        """A member's report of a round, answered when the round is decided (or the poll ends:
        a wait); as :meth:`submit_begin`."""
        ask = _Ask(answer, fail)
        self._run(ask, lambda a: self._commit(msg, a))
        return ask

    def abandon(self, ask: _Ask) -> None:
        """The asker has gone: ``ask`` is held no longer and gets no answer."""
        ask.gone = True
        if ask.slot >= 0:
            self._held.drop(ask.slot)
            ask.slot = -1

    async def flush(self) -> None:
        """Send the answers' frames produced so far (by this caller or any other)."""
        while self._sends:
            batch, self._sends = self._sends, []
            for send in batch:
                await send

    # -- the rules' order -------------------------------------------------------------------------
    def _run(self, ask: _Ask, step: Callable[[_Ask], None]) -> None:
        try:
            step(ask)
        except Exception as e:  # a bug in the rules: the asker is told, the coordinator goes on
            ask.fail(e)

    def _finish(self, ask: _Ask, d: msgs.Decision) -> None:
        if ask.gone:
            return
        ask.gone = True  # answered once
        sent = ask.answer(d)
        # The asker's closures may hold the ask itself (a frame's answer forgets its ask): a
        # cycle that only the garbage collector would free, a thousand of them a round
        ask.answer, ask.fail = _spent, _spent
        if sent is not None:
            self._sends.append(sent)

    def _begin(self, msg: msgs.Begin, ask: _Ask) -> None:
        if (stale := self.hub.stale_run(msg.run)) is not None:
            self._finish(ask, msgs.Evicted(reason=stale))
            return
        if msg.info is not None and self.on_info is not None:
            self.on_info(msg.peer, msg.info)  # the heartbeat it stands for, before the rest
        if msg.prev is None:
            self._begin_now(msg, ask)
            return

        def voted(v: msgs.Decision) -> None:
            if isinstance(v, msgs.Committed):
                self._begin_now(msg, ask)
            else:
                self._finish(ask, v)  # aborted, evicted, or still undecided (wait): no begin

        self._vote(msg.peer, msg.prev.epoch, msg.prev.round, True, "", (), ask, voted)

    def _begin_now(self, msg: msgs.Begin, ask: _Ask) -> None:
        pid, nonce, hub = msg.peer, msg.nonce, self.hub
        m = hub.membership
        with hub.lock:
            d = m.begin(
                pid,
                hub.now(),
                nonce=nonce,
                revision=msg.revision,
                hashes=msg.hashes,
                schema=None if msg.schema is None else list(msg.schema),
                digest=msg.digest,
                explain=False,
            )
        self._mutated()

        def done(d: msgs.Decision) -> None:
            self._finish(ask, d if msg.prev is None else self._voted_answer(d))

        if d.kind != "wait":
            done(d)
            return
        self._hold(
            ("b", pid, nonce),
            lambda: m.poll_begin(pid, nonce, explain=False),
            lambda: m.poll_begin(pid, nonce, now=hub.now()),
            ask,
            done,
        )

    def _voted_answer(self, d: msgs.Decision) -> msgs.Decision:
        """``d`` answering a begin whose vote committed (``prev="committed"``); the round's
        ``go``, the same decision for every member, is made so once."""
        cached = self._voted_go
        if cached is not None and cached[0] is d:
            return cached[1]
        out = dataclasses.replace(d, prev="committed")
        if isinstance(d, msgs.Go):
            self._voted_go = (d, out)
        return out

    def _commit(self, msg: msgs.Commit, ask: _Ask) -> None:
        if (stale := self.hub.stale_run(msg.run)) is not None:
            self._finish(ask, msgs.Evicted(reason=stale))
            return
        self._vote(
            msg.peer,
            msg.epoch,
            msg.round,
            msg.ok,
            msg.error,
            msg.unreached,
            ask,
            lambda d: self._finish(ask, d),
        )

    def _vote(
        self,
        peer: int,
        epoch: int,
        rnd: int,
        ok: bool,
        error: str,
        unreached: tuple[msgs.Unreached, ...],
        ask: _Ask,
        then: Callable[[msgs.Decision], None],
    ) -> None:
        """Peer ``peer``'s commit of round ``rnd`` of ``epoch`` (a commit's fields, or a
        begin's vote), then ``then`` with its decision, now or when held no longer."""
        hub = self.hub
        m = hub.membership
        with hub.lock:
            d = m.commit(
                peer,
                hub.now(),
                epoch=epoch,
                round=rnd,
                ok=ok,
                error=error[:2000],
                unreached=unreached[:64],
                explain=False,
            )
        self._mutated()
        if d.kind != "wait":
            then(d)
            return
        self._hold(
            ("c", epoch, rnd),
            lambda: m.poll_commit(epoch, rnd, explain=False),
            lambda: m.poll_commit(epoch, rnd),
            ask,
            then,
        )

    def _mutated(self) -> None:
        self._changed = True
        if self._passing:  # the pass tells the hub once, at its end
            self._pass_mutated = True
        else:
            self.hub.mutated()

    # -- holding ----------------------------------------------------------------------------------
    def _hold(
        self,
        key: Hashable,
        poll: Callable[[], msgs.Decision],
        explain: Callable[[], msgs.Decision],
        ask: _Ask,
        then: Callable[[msgs.Decision], None],
    ) -> None:
        if ask.gone:
            return
        loop = asyncio.get_running_loop()
        held = _Held(key, poll, explain, loop.time() + self.poll_s, ask, then)
        ask.slot = self._held.put(held)
        if self._waker is None or self._waker.done():
            self._waker = asyncio.ensure_future(self._wake())

    async def _wake(self) -> None:
        """Answer held questions as the run changes and as their deadlines pass, while any are
        held. A pass is followed by another at once when answering changed the membership (a
        vote that committed went on to its begin): questions asked earlier in the pass may
        have another answer by then."""
        loop = asyncio.get_running_loop()
        while True:
            self._changed = True
            while self._changed:  # until a pass changes nothing
                self._changed = False
                self._pass(loop.time())
            await self.flush()
            first = self._held.first_deadline()
            if first is None:
                return
            # nothing can change between the pass and this wait: both run without yielding
            await self.hub.changed(max(0.0, first - loop.time()))

    def _pass(self, now: float) -> None:
        """Answer the held questions decided at ``now``. The answers' changes to the membership
        (a committed vote going on to its begin, a thousand of them when a round commits) are
        told to the hub once, after the pass: nothing else runs on the loop in between."""
        with self.hub.lock:
            done = self._held.decide(now)
        self._passing, self._pass_mutated = True, False
        try:
            for held, d in done:
                held.ask.slot = -1
                try:
                    held.then(d)
                except Exception as e:  # as in _run
                    log.exception("error answering a held request")
                    held.ask.fail(e)
        finally:
            self._passing = False
            if self._pass_mutated:
                self.hub.mutated()

    # -- encoding ---------------------------------------------------------------------------------
    def text(self, d: msgs.Decision) -> str:
        """``d`` as JSON text. Every member is sent the same plan, which names every member:
        a ``go`` is encoded once per round (and ``prev``) rather than once per member."""
        go = self._go_encoded(d)
        return json.dumps(wire.encode(d)) if go is None else go[0]

    def utf8(self, d: msgs.Decision) -> bytes:
        """:meth:`text` as UTF-8 (a round's ``go`` encoded once, as :meth:`text`)."""
        go = self._go_encoded(d)
        return json.dumps(wire.encode(d)).encode() if go is None else go[1]

    def _go_encoded(self, d: msgs.Decision) -> tuple[str, bytes] | None:
        """``d``'s text and bytes where it is a ``go`` with a plan, encoded at its first ask;
        else None."""
        if isinstance(d, msgs.Go) and d.plan is not None:
            cached = self._go
            key = (d.reason, d.prev)
            if cached is None or cached[0] is not d.plan or cached[1] != key:
                text = json.dumps(wire.encode(d))
                cached = self._go = (d.plan, key, text, text.encode())
            return cached[2], cached[3]
        return None
