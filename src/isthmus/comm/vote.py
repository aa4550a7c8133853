"""A round's commit vote sent in the background, and the undo copy that makes it safe.

With ``SessionConfig.pipeline_commit`` a round whose collectives succeeded does not wait for the
coordinator's verdict on the training thread. The session instead:

1. copies every shared tensor into an :class:`UndoCopy` (buffers reused from round to round);
2. starts a :class:`PendingVote`: a thread that, once the strategy applied the result, sends
   the ``begin`` of round *r + 1* carrying this peer's ``ok`` for *r* (``Begin.prev``: one
   request, to a coordinator that lists ``vote-in-begin``), or else reports ``commit(ok)`` and,
   once the coordinator answers ``committed``, sends that ``begin``;
3. returns the round's result, which the strategy applies *tentatively* while the next step
   computes.

A round the caller knows to be its last (:meth:`VoteAhead.applied` with ``last=True``: the
strategy's step budget is reached), and a vote settled outside a ``begin`` (the end of the run,
leaving), sends the vote alone (``commit``) and no ``begin``: no round forms for a peer that
will not take part in it.

Before the next round runs anything that leaves the peer (or before a checkpoint, the end of
the run, leaving), the session *settles* the vote: ``committed`` raises its revision; anything
else (``aborted``, ``evicted``, a coordinator that cannot be reached or restarted) restores the
undo copy, so the shared state is revision *r* again bit for bit, and marks this peer's local
work since then as void (it started from a state that never became final). A peer therefore
never reports, checkpoints or hands out a revision it has not been told is committed; the hashes
sent with the next ``begin`` are taken from the tentative state, and the coordinator looks at
them only once that state's round committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from isthmus.comm.group import CollectiveError
from isthmus.comm.state import SharedState
from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.client import CoordinatorClient
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["PendingVote", "UndoCopy", "VoteAhead", "round_record"]

log = logging.getLogger("isthmus.session")

READ_TIMEOUT = 30.0
"""Seconds one long-polled request may be held by the coordinator before it is asked again."""


class UndoCopy:
    """A copy of every shared tensor, taken before a round's result is applied tentatively.

    Its buffers are allocated once per tensor (same shape, dtype and device) and reused, so
    taking it costs one copy of the shared state and no allocation after the first round.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._names: tuple[str, ...] = ()

    def take(self, state: SharedState) -> None:
        """Copy every tensor of ``state`` (its current values) into this copy's buffers."""
        with torch.no_grad():
            for name, t in state.items():
                b = self._bufs.get(name)
                if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
                    b = torch.empty_like(t, memory_format=torch.contiguous_format)
                    self._bufs[name] = b
                b.copy_(t)
        self._names = tuple(n for n, _ in state.items())

    def restore(self, state: SharedState) -> None:
        """Write the copied values back into ``state``'s tensors, in place, bit for bit.

        Raises RuntimeError when ``state`` holds a tensor the copy was not taken of (a tensor
        registered since: the copy cannot undo it)."""
        names = tuple(n for n, _ in state.items())
        if names != self._names:
            raise RuntimeError(
                f"the undo copy holds {len(self._names)} shared tensors, the state "
                f"{len(names)}: it was registered again since the copy was taken"
            )
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(self._bufs[name])


@dataclasses.dataclass(eq=False)
class PendingVote:
    """Round ``plan.round``'s ``ok``, being reported by a background thread, and the ``begin``
    of the next round that carries it or follows it (see the module docstring).

    Every wait of the thread is bounded: each request by the client's own bounds, the waits for
    an answer other than ``wait`` by ``timeout`` seconds each. An exception it meets is kept in
    :attr:`error` for the training thread."""

    plan: RoundPlan
    started: float
    """When the round's go arrived (monotonic), for its record."""
    timeout: float
    carry: bool = False
    """Carry the vote in the next begin (a coordinator listing
    :data:`~isthmus.coordinator.protocol.VOTE_IN_BEGIN`): one request instead of two."""
    outcome: msgs.Decision | None = None
    """The coordinator's answer to the vote: committed, aborted, evicted ... (None: unknown)."""
    decided_at: float = 0.0
    next_begin: msgs.Begin | None = None
    """The begin to send once committed (set by :meth:`prepare`; None: none is sent)."""
    answer: msgs.Decision | None = None
    """The last answer to :attr:`next_begin` (a go, or what the training thread must handle)."""
    error: BaseException | None = None
    """What reporting the vote met (a coordinator that cannot be reached): the verdict is
    unknown. A failure of the begin after it only leaves :attr:`answer` None."""
    settled: bool = False
    """The training thread has taken the outcome (revision raised, or the undo restored)."""
    ahead: bool = False
    """The training thread went on computing from the tentative state (it prepared a begin):
    that work is void if the vote does not commit."""
    decided: threading.Event = dataclasses.field(default_factory=threading.Event)
    prepared: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def committed(self) -> bool:
        return isinstance(self.outcome, msgs.Committed)

    def start(self, client: CoordinatorClient, vote: msgs.Commit) -> None:
        """Report ``vote`` and follow it with the next begin, on a daemon thread."""
        threading.Thread(
            target=self._run, args=(client, vote), name="isthmus-vote", daemon=True
        ).start()

    def prepare(self, begin: msgs.Begin | None) -> None:
        """Hand the thread the next round's begin (None: send none, the vote goes alone).
        Idempotent: the first call counts."""
        if not self.prepared.is_set():
            self.next_begin = begin
            self.ahead = begin is not None
            self.prepared.set()

    def _poll(self, client: CoordinatorClient, path: str, msg: Any) -> msgs.Decision:
        deadline = time.monotonic() + self.timeout
        hashes = getattr(msg, "hashes", None)  # the next begin's, taken on the training thread
        while True:
            d = client.call(path, msg, msgs.Decision, read_timeout=READ_TIMEOUT)
            if path == "/v1/begin":
                msg = dataclasses.replace(msg, hashes=None)  # they went: the coordinator has them
                if isinstance(d, msgs.SendHashes) and hashes is not None:
                    msg = dataclasses.replace(msg, hashes=hashes)
                    continue
                self.next_begin = msg
            if not isinstance(d, msgs.Wait) or time.monotonic() > deadline:
                return d

    def _carried(self, client: CoordinatorClient, vote: msgs.Commit) -> None:
        """The vote inside the next begin: held until the round voted on is decided; once it
        committed, the answer is the begin's (:attr:`answer`, or None where the begin must
        still be asked: a wait, or hashes wanted)."""
        assert self.next_begin is not None
        prev = msgs.Vote(epoch=vote.epoch, round=vote.round)
        msg = dataclasses.replace(self.next_begin, prev=prev)
        deadline = time.monotonic() + self.timeout
        while True:
            d = client.call("/v1/begin", msg, msgs.Decision, read_timeout=READ_TIMEOUT)
            if d.prev == "committed":
                self.outcome = msgs.Committed()
                asked = isinstance(d, msgs.SendHashes)  # then it goes on with the hashes
                self.next_begin = dataclasses.replace(
                    msg, prev=None, hashes=msg.hashes if asked else None
                )
                if not isinstance(d, (msgs.Wait, msgs.SendHashes)):
                    self.answer = d
                return
            if not isinstance(d, msgs.Wait) or time.monotonic() > deadline:
                self.outcome = d  # aborted, evicted, ...: the vote's outcome; no begin went
                return

    def _run(self, client: CoordinatorClient, vote: msgs.Commit) -> None:
        try:
            try:
                if self.carry:
                    self.prepared.wait(self.timeout)
                if self.carry and self.next_begin is not None:
                    self._carried(client, vote)
                else:
                    self.outcome = self._poll(client, "/v1/commit", vote)
            except BaseException as e:  # the verdict is unknown: kept for the training thread
                self.error = e
                return
            finally:
                self.decided_at = time.monotonic()
                self.decided.set()
            if not self.committed or self.answer is not None:
                return
            self.prepared.wait(self.timeout)
            if self.next_begin is not None:
                # a failure here leaves answer None: the training thread asks again itself
                with contextlib.suppress(Exception):
                    self.answer = self._poll(client, "/v1/begin", self.next_begin)
        finally:
            self.done.set()


def round_record(
    plan: RoundPlan,
    *,
    me: int | None,
    committed: bool,
    stage: str,
    reason: str,
    t_start: float,
    t_end: float,
    by_op: dict[str, int],
    bytes_sent: int,
) -> dict[str, Any]:
    """One attempt's entry of :attr:`Session.rounds` (``by_op``: this attempt's bytes per op)."""
    return {
        "round": plan.round,
        "epoch": plan.epoch,
        "world": len(plan.members),
        "outcome": "committed" if committed else "aborted",
        "stage": stage,
        "reason": "" if committed else reason,
        "resynced": me in plan.resynced,
        "t_start": t_start,
        "t_end": t_end,
        "bytes": sum(by_op.values()),  # this attempt's bytes on the wire (this peer)
        "bytes_by_op": {k: v for k, v in by_op.items() if v},
        "bytes_sent": bytes_sent,  # running total
    }


class VoteAhead:
    """The session's side of a pipelined round (:class:`~isthmus.comm.session.Session` is
    one): the vote sent ahead, settling it, and each attempt's record. It uses the session's
    client, state, config and round bookkeeping."""

    if TYPE_CHECKING:  # what the session provides
        config: Any
        state: SharedState
        stats: Any
        rounds: Any
        revision: int
        parity_every: int
        peer_id: int | None
        run_id: str
        name: str
        _client: CoordinatorClient
        _fresh: bool
        _group: Any
        _push_lock: threading.Lock
        _aborted_epochs: set[int]
        _last_by_op: dict[str, int]
        _commit_hooks: list[Any]
        _deferrable_hooks: bool
        _vote: PendingVote | None
        _undo: UndoCopy
        _void: bool
        _in_round: Any
        _carry_votes: bool

    def _next_begin(self, revision: int) -> msgs.Begin:
        """The begin of round ``revision`` (a new attempt: a new nonce), with the schema when
        this peer is new and the state's hashes when new or the parity check is due."""
        parity = self._fresh or revision % self.parity_every == 0
        return msgs.Begin(
            peer=self.peer_id or 0,
            run=self.run_id,
            nonce=uuid.uuid4().hex,
            revision=revision,
            schema=tuple(self.state.schema()) if self._fresh else None,
            hashes=self.state.hashes() if parity else None,
        )

    # -- the commit vote in the background (pipeline_commit) ----------------------------------
    def _pipelines(self) -> bool:
        return (
            self.config.pipeline_commit
            and self._deferrable_hooks
            and getattr(self, "island", None) is None
        )

    def _vote_ahead(self, rnd: Any) -> bool:
        """Keep the undo copy and send ``ok`` for ``rnd`` from a background thread; the caller
        then applies the result tentatively (the commit hooks run when the verdict settles).
        False: a fault injected at the commit failed the round instead (reported, as a
        commit of a failure is)."""
        try:
            rnd.check_faults("commit")
        except CollectiveError as e:
            rnd.commit(ok=False, error=str(e), cause=e)
            return False
        rnd._done = True
        self._in_round = None
        self._undo.take(self.state)
        vote = msgs.Commit(
            peer=self.peer_id or 0, run=self.run_id, epoch=rnd.epoch, round=rnd.number, ok=True
        )
        self._vote = PendingVote(
            rnd.plan, rnd.started, self.config.round_timeout, carry=self._carry_votes
        )
        self._vote.start(self._client, vote)
        return True

    @property
    def pending_revision(self) -> int | None:
        """The revision this peer's shared state holds tentatively while the coordinator's
        verdict on it is not known (None: none; :attr:`revision` is what it holds)."""
        v = self._vote
        return None if v is None or v.settled else v.plan.round + 1

    def applied(self, *, last: bool = False) -> None:
        """The caller has applied the result of a pipelined round: the shared state is what the
        next round starts from. Takes its hashes now if the next begin carries them (they are
        sent only once the round committed) and lets the background send that begin. With
        ``last`` (the caller will run no further round: its run ends) the vote goes alone, as
        a ``commit``, and no begin is sent, so the coordinator forms no round that this peer's
        leaving would abort. Does nothing without a pending vote, or once a call decided."""
        v = self._vote
        if v is not None and not v.settled and not v.prepared.is_set():
            v.prepare(None if last else self._next_begin(v.plan.round + 1))

    def settle(self, *, begin: bool = False) -> tuple[msgs.Begin, msgs.Decision] | None:
        """Wait for the verdict on the round applied tentatively. Committed: :attr:`revision`
        rises. Anything else: the shared state is restored from the undo copy (bit for bit) and
        this peer's work since (if it went on computing from the tentative state: it prepared
        a begin) counts in no round (:attr:`Round.resynced`) until one commits.
        ``begin=True`` first lets the background send the next round's begin (if it has not
        yet), waits for it and returns it with its last answer (None: it sent none). Without
        it, a vote whose begin was not prepared yet goes alone (the caller ends its run, or
        checkpoints after :meth:`applied`). Raises what the background met (a coordinator that
        cannot be reached), after the undo."""
        v = self._vote
        if v is None:
            return None
        if not v.settled:
            if begin:
                self.applied()
            else:
                v.prepare(None)  # no-op where applied() prepared the begin already
            v.decided.wait()
            v.settled = True
            committed = v.committed
            if committed:
                self.revision = v.plan.round + 1
                for hook in self._commit_hooks:
                    hook(v.plan)
            else:
                self._undo.restore(self.state)
                self._void = v.ahead  # nothing computed from the undone state: no work lost
                log.warning("%s: round %d was not committed; undone", self.name, v.plan.round)
            reason = str(v.error) if v.error else (v.outcome.reason if v.outcome else "")
            self._record(v.plan, committed, "round", reason, v.started, v.decided_at)
            if not committed and v.error is not None:
                self._vote = None
                raise v.error
        if not begin:
            return None
        self._vote = None
        if not v.committed:
            return None  # no begin went: this peer begins its round again
        v.done.wait()
        if v.next_begin is None:
            return None
        # without an answer (the begin failed, or the coordinator kept it waiting), go on
        # asking with the same begin: a new nonce would abandon a round formed with this one
        return v.next_begin, v.answer or msgs.Wait()

    def _record(
        self, plan: RoundPlan, committed: bool, stage: str, reason: str, t0: float, t1: float
    ) -> None:
        if committed:
            self._void = False
        else:
            with self._push_lock:
                self._aborted_epochs.add(plan.epoch)
            if self._group is not None and self._group.name == f"epoch{plan.epoch}":
                self._group.abort(f"round {plan.round} aborted: {reason}")
        by_op = {k: v - self._last_by_op.get(k, 0) for k, v in self.stats.by_op.items()}
        self._last_by_op = dict(self.stats.by_op)
        record = round_record(
            plan,
            me=self.peer_id,
            committed=committed,
            stage=stage,
            reason=reason,
            t_start=t0,
            t_end=t1,
            by_op=by_op,
            bytes_sent=self.stats.bytes_sent,
        )
        self.rounds.append(record)
