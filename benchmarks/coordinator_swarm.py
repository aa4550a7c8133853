"""Protocol-only peers: many cheap asyncio clients that speak to a coordinator exactly as real
peers do, without torch, without tensors.

Each :class:`ProtoPeer` registers (``POST /v1/register`` with a :class:`~protocol.Register`),
keeps a heartbeat websocket (``GET /v1/ws``, a :class:`~protocol.Heartbeat` every interval
with the info a training peer sends: revision, byte counters, step, loss and its step's
timing), and runs rounds: ``POST /v1/begin`` (schema on its first begin, hashes on parity
rounds, again when asked with ``hashes``), then ``POST /v1/commit`` with ``ok``, each long-poll
asked again while the answer is ``wait``; with :attr:`SwarmConfig.frames` (and a coordinator
that lists ``ws-rounds``) begin and commit go as frames on the heartbeat websocket instead
(``coordinator/frames.py``), as a real peer's client sends them; with :attr:`SwarmConfig.vote_in_begin` (and a
coordinator that lists ``vote-in-begin``) the ``ok`` rides in the next begin instead (one
request per round, as a peer with ``pipeline_commit`` sends it), every message encoded and decoded with the shared
codec (``coordinator/wire.py``). With :attr:`SwarmConfig.info_in_begin` (and a coordinator that
lists ``info-in-begin``) a begin frame sent half an interval or more after the last heartbeat
carries the heartbeat's info, and the next heartbeat goes one interval after it, as a real
peer's client does. With :attr:`SwarmConfig.hash_digest` (and a coordinator that lists
``hash-digest``) a begin carries the digest of its hashes in their place, and the list only
when that attempt is answered ``hashes``, as a real peer's client does. The peers of one process share the decoding of a round's reply: every
member gets the same decision text, which hundreds of peers on one loop would otherwise decode
hundreds of times (on a thousand machines each would decode it once, in parallel). Every peer of a swarm holds the same "state" (the same hashes),
so parity always agrees. One process holds hundreds of them on one event loop and one HTTP
connection pool.

This module imports only the coordinator's protocol and codec (and aiohttp). A script whose
processes must not import torch makes ``isthmus`` an empty package before importing it
(``coordinator_scale.py`` does): ``import isthmus.coordinator.protocol`` would otherwise run the
package's ``__init__``, which imports the whole public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.wire import PROTOCOL_VERSION, decode, encode

__all__ = ["ProtoPeer", "RoundTimes", "SwarmConfig", "open_session"]

WS_ROUNDS = "ws-rounds"
"""``coordinator/frames.py``'s feature, named here so that these clients also run against the
source of a release from before frames (the benchmark's "before" rows)."""


INFO_IN_BEGIN = "info-in-begin"
"""``coordinator/protocol.py``'s feature, named here for the same reason."""

HASH_DIGEST = "hash-digest"
"""``coordinator/protocol.py``'s feature, named here for the same reason."""

_REPLY = re.compile(r'\{"type":"reply","id":(-?\d+),"status":200,"decision":')
"""The head of a reply the coordinator wrote with a decision (``frames.reply_text``)."""

_DECIDED: dict[str, msgs.Decision] = {}
"""Decision text -> its decoded decision, shared by the peers of this process (a few kept)."""


_DIGESTS: dict[tuple[tuple[str, str], ...], str] = {}
"""A list of hashes -> its digest (every peer of a swarm holds the same list)."""


def _digest(hashes: dict[str, str]) -> str:
    """``parity.state_digest`` of ``hashes``, worked out once per list for this process."""
    from isthmus.coordinator.parity import state_digest

    key = tuple(hashes.items())
    d = _DIGESTS.get(key)
    if d is None:
        d = _DIGESTS[key] = state_digest(hashes)
    return d


def _decision(text: str) -> msgs.Decision:
    """The decision ``text`` (JSON), decoded once for every peer of this process."""
    d = _DECIDED.get(text)
    if d is None:
        if len(_DECIDED) > 64:
            _DECIDED.clear()
        d = _DECIDED[text] = decode(msgs.Decision, json.loads(text))
    return d


@dataclass(kw_only=True)
class SwarmConfig:
    """What every protocol-only peer of a swarm does."""

    tensors: int = 32
    """Shared tensors each peer declares (one hash each in a begin)."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats (the coordinator's default)."""
    parity_every: int = 1
    """Send hashes with begin every this many rounds (the coordinator's default: every one)."""
    read_timeout: float = 30.0
    """Bound of one HTTP request (a long-poll is answered within the coordinator's poll_s)."""
    vote_in_begin: bool = False
    """Carry each round's ``ok`` in the next begin (``Begin.prev``: one request per round, as a
    pipelining peer does) where the coordinator lists the feature; else commit, then begin.
    The last round of :meth:`ProtoPeer.run_until` is always reported with a commit (there is
    no next begin to carry it)."""
    frames: bool = True
    """Send begin and commit as frames on the heartbeat websocket where the coordinator lists
    ``ws-rounds`` (else, or with False, as HTTP requests)."""
    info_in_begin: bool = True
    """Carry the heartbeat's info in a begin frame where the coordinator lists
    ``info-in-begin`` and half an interval passed since the last info (the next heartbeat
    then goes one interval after the begin), as a real peer's client does."""
    hash_digest: bool = True
    """Send the digest of the hashes in their place where the coordinator lists
    ``hash-digest`` (the list when that attempt is answered ``hashes``), as a real peer's
    client does."""

    def schema(self) -> tuple[msgs.TensorSpec, ...]:
        return tuple(
            msgs.TensorSpec(f"layers.{i}.weight", (64, 64), "float32") for i in range(self.tensors)
        )

    def hashes(self) -> dict[str, str]:
        return {f"layers.{i}.weight": f"{i * 7919:016x}" for i in range(self.tensors)}


@dataclass
class RoundTimes:
    """One attempt of one peer, on this machine's monotonic clock (comparable across processes
    of one host)."""

    round: int
    epoch: int
    world: int
    begin_sent: float
    go: float
    commit_sent: float
    done: float
    outcome: str


def open_session() -> aiohttp.ClientSession:
    """One HTTP client for a whole swarm: an unbounded pool (every peer holds a long-poll)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=None),
    )


class ProtocolError(RuntimeError):
    """The coordinator answered something a healthy round never gets (evicted, refused ...)."""


@dataclass
class ProtoPeer:
    """One protocol-only peer (see the module doc). ``token``: the admin token or its own
    join token."""

    base: str
    token: str
    name: str
    session: aiohttp.ClientSession
    config: SwarmConfig = field(default_factory=SwarmConfig)
    peer_id: int = -1
    run_id: str = ""
    revision: int = 0
    heartbeats: int = 0
    evictions: int = 0
    failures: int = 0
    pushes: list[msgs.Push] = field(default_factory=list)
    rounds: list[RoundTimes] = field(default_factory=list)
    votes: list[tuple[str, int, int]] = field(default_factory=list)
    """Every vote sent: (``"commit"`` or ``"begin"`` where it rode in a begin, epoch, round)."""
    deadline: float = float("inf")
    """Monotonic time after which a request still waiting raises :class:`TimeoutError`."""
    features: tuple[str, ...] = ()
    """What the coordinator listed when this peer registered."""
    _fresh: bool = True
    _voted: tuple[msgs.RoundPlan, float, float, float] | None = None
    """The round this peer finished whose ``ok`` rides in its next begin: its plan, when its
    begin was sent, when its go arrived, and when the carrying begin was sent."""
    _formed_at: tuple[float, float] = (0.0, 0.0)
    frames_sent: int = 0
    """Begins and commits sent as websocket frames."""
    failure_kinds: dict[str, int] = field(default_factory=dict)
    """How many of :attr:`failures` each kind of error was."""
    _ws: aiohttp.ClientWebSocketResponse | None = None
    _hb_task: asyncio.Task[None] | None = None
    _replies: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    _next_id: int = 0
    _info_at: float = -math.inf
    """Monotonic time at which the last info went (a heartbeat, or a begin carrying it)."""
    infos_in_begins: int = 0
    """Heartbeat infos sent inside begins."""
    lists_sent: int = 0
    """Begins that carried the full list of hashes (not its digest)."""
    _full_for: str = ""
    """The begin attempt (nonce) whose digest was answered ``hashes``: it sends the list."""

    async def _ask_begin(self, msg: msgs.Begin) -> msgs.Decision:
        """A begin, its hashes as their digest where the coordinator takes it (as
        ``coordinator/client.py`` sends them)."""
        digested = (
            self.config.hash_digest
            and HASH_DIGEST in self.features
            and msg.hashes is not None
            and msg.schema is None
            and msg.nonce != self._full_for
        )
        if digested:
            assert msg.hashes is not None
            msg = dataclasses.replace(msg, hashes=None, digest=_digest(msg.hashes))
        elif msg.hashes is not None:
            self.lists_sent += 1
        d = await self._ask("/v1/begin", msg)
        if digested and isinstance(d, msgs.SendHashes):
            self._full_for = msg.nonce
        return d

    async def _post(self, path: str, message: Any) -> dict[str, Any]:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"{self.name}: out of time asking {path}")
        async with self.session.post(
            self.base + path,
            json=encode(message),
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=self.config.read_timeout),
        ) as r:
            if r.status != 200:
                raise ProtocolError(f"{self.name}: {path} answered {r.status}: {await r.text()}")
            return dict(await r.json())

    async def _post_decision(self, path: str, message: Any) -> msgs.Decision:
        return decode(msgs.Decision, await self._post(path, message))

    def framed(self) -> bool:
        """Whether begin and commit go as websocket frames (asked, offered, socket open)."""
        return (
            self.config.frames
            and WS_ROUNDS in self.features
            and self._ws is not None
            and not self._ws.closed
        )

    async def _ask(self, path: str, message: msgs.Begin | msgs.Commit) -> msgs.Decision:
        """A begin or commit, as a frame when :meth:`framed`, else over HTTP; the decision.
        A frame's reply other than a decision raises :class:`ProtocolError`; a socket that
        closes before the reply, :class:`ConnectionError`."""
        if not self.framed():
            return await self._post_decision(path, message)
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"{self.name}: out of time asking {path}")
        assert self._ws is not None
        kind = "begin" if path == "/v1/begin" else "commit"
        self._next_id += 1
        fid = self._next_id
        fut = asyncio.get_running_loop().create_future()
        self._replies[fid] = fut
        body = encode(message)
        now = time.monotonic()
        if (
            kind == "begin"
            and self.config.info_in_begin
            and INFO_IN_BEGIN in self.features
            and now - self._info_at >= self.config.heartbeat_interval / 2
        ):
            body["info"] = self.info()
            self._info_at = now
            self.infos_in_begins += 1
        try:
            await self._ws.send_json({"type": kind, "id": fid, kind: body})
            self.frames_sent += 1
            raw = await asyncio.wait_for(fut, self.config.read_timeout)
        finally:
            self._replies.pop(fid, None)
        if isinstance(raw, msgs.Decision):
            return raw
        if raw.get("status") == 200 and isinstance(raw.get("decision"), dict):
            return decode(msgs.Decision, raw["decision"])
        raise ProtocolError(f"{self.name}: {kind} frame answered {raw!r:.500}")

    async def register(self) -> None:
        reply = decode(
            msgs.Registered,
            await self._post("/v1/register", msgs.Register(self.name, {}, PROTOCOL_VERSION)),
        )
        self.peer_id, self.run_id = reply.peer_id, reply.run_id
        self.features = tuple(reply.features)

    async def connect(self) -> None:
        """Open the heartbeat websocket and start sending heartbeats on it."""
        url = f"{self.base}/v1/ws?peer={self.peer_id}&protocol={PROTOCOL_VERSION}&run={self.run_id}"
        self._ws = await self.session.ws_connect(
            url, heartbeat=None, headers={"Authorization": f"Bearer {self.token}"}
        )
        self._hb_task = asyncio.ensure_future(self._heartbeat())

    def info(self) -> dict[str, Any]:
        """What a training peer reports with each heartbeat (run/job.py, comm/session.py)."""
        step = self.revision
        return {
            "revision": self.revision,
            "bytes_sent": 1000 * step,
            "bytes_by_op": {"all_reduce": 1000 * step},
            "parked_groups": 0,
            "step": step,
            "loss": 3.0,
            "timing": {"work_s": 0.01, "sync_s": 0.002, "step": step},
        }

    async def _heartbeat(self) -> None:
        ws = self._ws
        assert ws is not None

        async def reader() -> None:
            try:
                async for raw in ws:
                    if raw.type == aiohttp.WSMsgType.TEXT:
                        head = _REPLY.match(raw.data)
                        if head is not None and raw.data.endswith("}"):
                            fut = self._replies.get(int(head.group(1)))
                            if fut is not None and not fut.done():
                                fut.set_result(_decision(raw.data[head.end() : -1]))
                            continue
                        frame = raw.json()
                        if frame.get("type") == "reply":
                            fut = self._replies.get(frame.get("id"))
                            if fut is not None and not fut.done():
                                fut.set_result(frame)
                        else:
                            self.pushes.append(decode(msgs.Push, frame))
            finally:
                for fut in self._replies.values():
                    if not fut.done():
                        fut.set_exception(ConnectionError("the heartbeat socket closed"))

        rtask = asyncio.ensure_future(reader())
        try:
            # spread the first heartbeats of a swarm over one interval, as peers that started
            # at different moments do
            await asyncio.sleep(self.config.heartbeat_interval * (hash(self.name) % 997) / 997)
            while not ws.closed and not rtask.done():
                # one interval after the last info, which a begin may have carried
                due = self._info_at + self.config.heartbeat_interval - time.monotonic()
                if due > 0:
                    await asyncio.sleep(due)
                    continue
                await ws.send_json(encode(msgs.Heartbeat(self.info())))
                self._info_at = time.monotonic()
                self.heartbeats += 1
        except (ConnectionError, aiohttp.ClientError):
            pass
        finally:
            rtask.cancel()

    async def rejoin(self) -> None:
        """Evicted (the coordinator fell behind our heartbeats, say): register again under the
        same name and reconnect, keeping the revision, as a real peer does."""
        self.evictions += 1
        self._voted = None
        await self.close()
        self._fresh = True
        await self.register()
        await self.connect()

    def carries(self) -> bool:
        """Whether this peer's votes ride in its begins (asked, and the coordinator can)."""
        return self.config.vote_in_begin and msgs.VOTE_IN_BEGIN in self.features

    def _settled(self, outcome: str) -> None:
        """The round whose vote rode in the last begin is decided: record it (its ``done`` is
        when the answer arrived)."""
        assert self._voted is not None
        plan, begun, go, sent = self._voted
        self._voted = None
        if outcome == "committed":
            self.revision = plan.round + 1
        times = RoundTimes(
            plan.round, plan.epoch, len(plan.members), begun, go, sent, time.monotonic(), outcome
        )
        self.rounds.append(times)

    async def begin(self) -> msgs.RoundPlan:
        """Ask for the next round until it forms with this peer; returns its plan. With a vote
        pending (:attr:`_voted`) the first request carries it: the answer settles that round
        (``prev == "committed"``, or ``aborted``/``evicted`` for the vote) before it is the
        begin's."""
        revision = self.revision if self._voted is None else self._voted[0].round + 1
        parity = self._fresh or revision % self.config.parity_every == 0
        msg = msgs.Begin(
            peer=self.peer_id,
            run=self.run_id,
            nonce=uuid.uuid4().hex,
            revision=revision,
            schema=self.config.schema() if self._fresh else None,
            hashes=self.config.hashes() if parity else None,
        )
        t0 = time.monotonic()
        if self._voted is not None:
            self._voted = (*self._voted[:3], t0)
            plan = self._voted[0]
            hashes = msg.hashes
            msg = dataclasses.replace(msg, prev=msgs.Vote(epoch=plan.epoch, round=plan.round))
            while True:
                self.votes.append(("begin", plan.epoch, plan.round))
                d = await self._ask_begin(msg)
                if d.prev == "committed":
                    self._settled("committed")
                    if isinstance(d, msgs.Go) and d.plan is not None:
                        self._fresh = False
                        return self._formed(d.plan, t0)
                    # formed later: ask again without the vote (with the hashes if asked)
                    asked = isinstance(d, msgs.SendHashes)
                    msg = dataclasses.replace(msg, prev=None, hashes=hashes if asked else None)
                    break
                if isinstance(d, msgs.Wait):
                    continue  # the vote is still undecided: the same request again
                self._settled("aborted")  # no begin was taken: a new attempt at that revision
                if isinstance(d, msgs.Evicted):
                    await self.rejoin()
                elif not isinstance(d, msgs.Aborted):
                    raise ProtocolError(f"{self.name}: begin with a vote answered {d}")
                return await self.begin()
        while True:
            d = await self._ask_begin(msg)
            msg = dataclasses.replace(msg, schema=None, hashes=None)
            if isinstance(d, msgs.SendHashes):
                msg = dataclasses.replace(msg, hashes=self.config.hashes())
            elif isinstance(d, msgs.Go) and d.plan is not None:
                self._fresh = False
                return self._formed(d.plan, t0)
            elif isinstance(d, msgs.Evicted):
                await self.rejoin()
                return await self.begin()
            elif not isinstance(d, msgs.Wait):
                raise ProtocolError(f"{self.name}: begin answered {d}")

    def _formed(self, plan: msgs.RoundPlan, begun: float) -> msgs.RoundPlan:
        self._formed_at = (begun, time.monotonic())
        return plan

    async def commit(self, plan: msgs.RoundPlan, ok: bool = True) -> bool:
        """Report the round's outcome until it is decided; True when it committed."""
        msg = msgs.Commit(
            peer=self.peer_id, run=self.run_id, epoch=plan.epoch, round=plan.round, ok=ok
        )
        while True:
            self.votes.append(("commit", plan.epoch, plan.round))
            d = await self._ask("/v1/commit", msg)
            if isinstance(d, msgs.Committed):
                self.revision = plan.round + 1
                return True
            if isinstance(d, msgs.Aborted | msgs.Evicted):
                return False
            if not isinstance(d, msgs.Wait):
                raise ProtocolError(f"{self.name}: commit answered {d}")

    async def run_round(self, last: bool = False) -> RoundTimes | None:
        """One attempt: begin, then commit at once (no work between: the coordinator's cost
        alone is measured). Carrying votes (:meth:`carries`) and not ``last``, the commit is
        left to the next begin and None is returned (the round is recorded when it settles)."""
        plan = await self.begin()
        t0, t1 = self._formed_at
        if self.carries() and not last:
            self._voted = (plan, t0, t1, t1)
            return None
        committed = await self.commit(plan)
        t2 = time.monotonic()
        times = RoundTimes(
            plan.round,
            plan.epoch,
            len(plan.members),
            t0,
            t1,
            t1,
            t2,
            "committed" if committed else "aborted",
        )
        self.rounds.append(times)
        return times

    async def run_until(self, revision: int, deadline: float = float("inf")) -> None:
        """Run rounds until this peer holds ``revision`` committed rounds, or until
        ``deadline`` (monotonic) has passed."""
        self.deadline = deadline
        while self.revision < revision and time.monotonic() < deadline:
            # the round that would reach ``revision`` is reported with a commit: no begin follows
            pending = self._voted is not None
            last = self.revision + (2 if pending else 1) >= revision
            try:
                await self.run_round(last=last)
            except (asyncio.TimeoutError, aiohttp.ClientError, ProtocolError, ConnectionError) as e:
                # an overloaded coordinator: a request past read_timeout, a dropped
                # connection; a real peer retries, and so does this one (counted)
                self.failures += 1
                self.failure_kinds[type(e).__name__] = (
                    self.failure_kinds.get(type(e).__name__, 0) + 1
                )
                if self._ws is None or self._ws.closed:
                    with contextlib.suppress(
                        asyncio.TimeoutError, aiohttp.ClientError, ProtocolError, ConnectionError
                    ):
                        await self.rejoin()

    async def close(self) -> None:
        """Close the heartbeat websocket (the coordinator evicts the peer at once)."""
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._hb_task
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws.close(), 2.0)
