"""Membership, rounds and parity as a pure state machine (no sockets, no clocks of its own).

The coordinator server feeds :class:`Membership` requests and the current time; everything that
decides who is in a round, whether a round commits, who must be resynced from whom, and when a
run restarts from a checkpoint lives here and in the modules it is built from, so it can be
unit-tested with a fake clock: :mod:`.state` (what is known of the run, and how a round ends),
:mod:`.forming` (when a round forms, and with whom), :mod:`.phase` (the run's phase and its legal
moves), :mod:`.parity` (the vote on the state), :mod:`.peers` (each peer, and the rules' config).
docs/PROTOCOL.md walks through the protocol; in short:

* A peer **registers**, then keeps a heartbeat; one silent for ``heartbeat_timeout`` (or whose
  heartbeat connection closed) is evicted. A member of the running round gets
  ``transfer_heartbeat_timeout`` instead (its heartbeats may queue behind that transfer's data
  on a thin link, also after it reported: its kernel may still be sending), unless another
  member's heartbeat since the round formed says nothing moves on its connections.
* **begin**: the run's next round is always ``revision`` (committed rounds so far). It forms
  when every surviving member of the last epoch is ready (plus waiting joiners) and at least
  ``min_peers`` are: members ranked by name, a new epoch if membership changed or the last
  round aborted, and a resync plan.
* **Parity** (:mod:`.parity`): with begin every ``parity_every`` rounds, and always when new or
  stale, peers send per-tensor hashes; the voters (in sync at the last commit) decide the
  canonical hashes by majority; a voter that differs is a *parity failure*, anyone who differs
  is repaired from an in-sync source before taking part.
* **commit**: one failure, a report missing past ``commit_timeout`` (counted from the later
  of the round's start and the member's last heartbeat that said its transfer moved), or a
  member's death aborts
  the round for everyone; only when every member succeeded does ``revision`` advance. After an
  abort the next round opens a new epoch (fresh process groups). **leave** aborts nothing.
* **A link cut after its data was handed over**: a collective completes once its last data is
  in the kernel, so the sending end of a cut link may report success while the receiving end
  waits with nothing in flight, which looks like waiting for a late member. When every member
  but some has reported, each of those says (for this round) that nothing moves, and a member
  that reported says its data to one of them has gone unacknowledged past the stall rule
  (its heartbeat's ``transfer.silent``), the round aborts and the pair is down, as if the
  sender had failed naming the receiver (:meth:`Membership.tick`).
  A round that aborts ``abort_limit`` times in a row for the same cause stops: every begin is
  answered ``stopped`` with the cause.
* **Partial partitions** (:mod:`.isolation`): a failure report may name members the reporter
  could not reach; such a pair is down until probes connect again, and the next round keeps the
  largest set of ready peers whose pairs are all up. The others are *isolated* (told why, still
  registered) until the coordinator's probes find their pairs up again.
* **Restore**: when no live peer holds the run's state any more (every in-sync peer died or
  left) and a complete checkpoint is known (:attr:`Membership.restore_point`: reported by the
  peers that wrote it, or the coordinator's ``--resume``), the run *restarts* from it: the next
  round forms as a run's first one does, from peers at the checkpoint's revision or later.
  Peers registering then are told the point at registration (they load it, local state
  included, before any work); peers already waiting are answered ``restore`` (they load the
  shared state, and their first round's work does not count).

Every wait that this class can cause is bounded by one of the timeouts in
:class:`MembershipConfig`: a waiting peer is either admitted, or the peers it waits for are
evicted. The only unbounded condition, fewer than ``min_peers`` alive, is bounded on the client
side (the session gives up with an error naming the shortfall).
"""

from __future__ import annotations

from typing import Any

from isthmus.coordinator import forming, isolation
from isthmus.coordinator.peers import MembershipConfig, Peer, PeerState
from isthmus.coordinator.protocol import (
    Decision,
    ProbeOutcome,
    TensorSpec,
    Unreached,
    schema_mismatch,
)
from isthmus.coordinator.state import RunState

__all__ = ["REASON_TTL", "Membership", "MembershipConfig", "PeerState"]  # config: .peers

REASON_TTL = 0.25
"""Seconds a waiting begin's reason may be reused (see :meth:`Membership.poll_begin`)."""

MAX_SILENT = 64
"""At most this many entries of a heartbeat's ``transfer.silent`` are read."""

_WAIT = Decision("wait", "")
"""A ``wait`` without its reason (decisions are immutable: every such answer is this one)."""


class Membership(RunState):
    """The coordinator's state and the requests that change it. Methods take ``now`` (seconds,
    monotonic) and never block.

    Callers (the server) hold a lock around every call and wake waiting requests after each one.
    Pushes for peers (round aborted) are queued in :attr:`notices`; the server drains them
    (:meth:`take_notices`).
    """

    def __init__(self, config: MembershipConfig | None = None) -> None:
        super().__init__(config)
        self._needed: tuple[tuple[int, ...], bool] | None = None  # _hashes_needed at a stamp
        self.claims: set[int] = set()
        """Peers whose last heartbeat named members their data does not reach
        (``transfer.silent``); :meth:`tick` looks for a cut link only while there are any."""

    # -- registration and liveness ----------------------------------------------------------------
    def register(self, name: str, now: float, info: dict[str, Any] | None = None) -> int:
        self.restart_if_lost(now)
        self.reach.forget(name)  # a new process under this name: its pairs start afresh
        pid = self.roster.add(name, now, info or {}, uncounted=self.started)
        self.counters["registrations"] += 1
        self.note(now, "register", peer=pid, name=name)
        return pid

    def heartbeat(
        self,
        pid: int,
        now: float,
        info: dict[str, Any] | None = None,
        *,
        probes: tuple[ProbeOutcome, ...] = (),
    ) -> bool:
        """Record a sign of life, with the outcomes of probes the coordinator asked this peer for
        (a pair found up again may re-admit a member). False if the peer is no longer active
        (it must register again)."""
        p = self.roster.active(pid)
        if p is None:
            return False
        p.last_seen = now
        if info:
            t = info.get("transfer")
            t = t if isinstance(t, dict) else {}
            p.moving = t.get("moving") is True
            # outside a round a heartbeat may carry only ``silent``: it names no round
            p.transfer_round = (t.get("epoch"), t.get("round")) if "round" in t else None
            if p.moving:
                p.progress_at = now
            p.silent = _silent_claims(t.get("silent"))
            if p.silent:
                self.claims.add(pid)
            else:
                self.claims.discard(pid)
            p.info.update(info)
            p.beats += 1
        if probes and isolation.probed(self, p, probes, now):
            self.try_form(now)
        return True

    def same_beat(self, pid: int, now: float, beats: int) -> bool | None:
        """A heartbeat that repeats, word for word, the info recorded as the peer's ``beats``-th
        (:attr:`Peer.beats`): a sign of life that changes nothing else, since recording the
        same info again would set the same fields (a ``moving`` transfer still counts as
        progress now). None when another info was recorded since (record this one in full
        with :meth:`heartbeat`); False if the peer is no longer active."""
        p = self.roster.active(pid)
        if p is None:
            return False
        if p.beats != beats:
            return None
        p.last_seen = now
        if p.moving:
            p.progress_at = now
        return True

    def _in_transfer(self, pid: int) -> bool:
        """Whether ``pid`` may be inside its round's transfer, so that its heartbeats may queue
        behind the data: a member of the running round, unless another member that has not
        reported says in its last heartbeat, for this round, that nothing moves on its
        connections (a stopped member takes no data, so its partners soon see that; the
        heartbeats of members whose link is full may not arrive at all, which says nothing).
        A member that reported is still in it until the round ends: its collective completed
        once its data was handed to its kernel, which may still be sending it (tens of seconds
        on a thin link), ahead of its heartbeats."""
        r = self.phase.round
        if r is None or not r.has(pid):
            return False
        for m in r.plan.members:  # a partner that reported is done with the transfer: no evidence
            q = self.roster.active(m)
            if m == pid or q is None or m in r.reports:
                continue
            if q.transfer_round == (r.plan.epoch, r.plan.round) and not q.moving:
                return False
        return True

    def remove(
        self, pid: int, now: float, reason: str, *, state: PeerState = PeerState.DEAD
    ) -> None:
        """Evict (or mark left/refused) a peer; aborts the running round if it was a member."""
        self.drop(pid, now, reason, state)
        self.try_form(now)

    def leave(
        self, pid: int, now: float, *, digest: str | None = None, revision: int | None = None
    ) -> None:
        """``pid`` leaves between rounds; ``digest`` and ``revision`` (its shared state's, as it
        leaves) go into the ``left`` event, for checking that every peer ended identical."""
        detail = {} if digest is None else {"digest": digest, "final_revision": revision}
        self.drop(pid, now, "left the run", PeerState.LEFT, **detail)
        self.try_form(now)

    def tick(self, now: float) -> None:
        """Apply every timeout: dead peers, members that never begin or never commit."""
        cfg = self.config
        short = cfg.silence_bound(False)
        for p in list(self.peers.values()):
            silent = now - p.last_seen
            # the transfer's longer bound is looked for only past the short one: finding it
            # walks the round's members, which every tick would do for every peer
            if (
                p.state is PeerState.ACTIVE
                and silent > short
                and silent > cfg.silence_bound(self._in_transfer(p.id))
            ):
                self.drop(p.id, now, f"no heartbeat for {silent:.1f}s")
        r = self.phase.round
        if r is not None and now - r.started_at > cfg.commit_timeout:
            for pid in self.roster.alive(r.plan.members):
                if pid in r.reports:
                    continue
                # counted from the member's last progress: a transfer that moves is not late
                p = self.peers[pid]
                since = max(r.started_at, p.progress_at or r.started_at)
                if now - since > cfg.commit_timeout:
                    self.drop(
                        pid,
                        now,
                        f"did not report round {r.plan.round} within {cfg.commit_timeout:.0f}s "
                        "of its last progress",
                    )
        if self.claims:
            self._cut_link(now)
        isolation.ask_probes(self, now)
        forming.try_form(self, now, quick=True)

    def _cut_link(self, now: float) -> None:
        """Abort the running round if a link between two of its members is cut after the
        sending end handed its last data to its kernel (see the module doc): every member that
        has not reported says in its last heartbeat, about this round, that nothing moves on
        its connections, and a member that reported (ok: a failure would have aborted the round)
        says that its data to one of them has gone unacknowledged past the stall rule. The
        bound is the sender's: its ``stall_s`` and the kernel's retransmission timeouts
        (:mod:`isthmus.comm.progress`), the rule by which an end that still waits gives up on a
        silent connection. Each such pair is reported down (the sender could not reach the
        receiver, ``stalled``), so that the next round sits one end out and probes take it back
        once the link heals. A receiver that still sees data arrive (a thin link) says it moves,
        and nothing is aborted."""
        r = self.phase.round
        if r is None:
            return
        plan = r.plan
        waiting: set[int] = set()
        for m in plan.members:
            if m in r.reports:
                continue
            q = self.roster.active(m)
            # a member that is gone aborts the round by itself; one that moves is waited for
            if q is None or q.transfer_round != (plan.epoch, plan.round) or q.moving:
                return
            waiting.add(m)
        cut: list[tuple[Peer, Peer, float]] = []
        for pid in sorted(self.claims):
            p = self.roster.active(pid)
            if p is None:
                self.claims.discard(pid)
                continue
            if pid not in r.reports:
                continue  # its own wait names the member when it gives up on the connection
            for epoch, rank, for_s in p.silent:
                to = (
                    plan.members[rank]
                    if epoch == plan.epoch and 0 <= rank < len(plan.members)
                    else None
                )
                if to in waiting:
                    cut.append((p, self.peers[to], for_s))
        if not waiting or not cut:
            return
        for sender, to, _ in cut:
            address = (plan.reach or {}).get(str(to.id)) or to.probe_address
            isolation.stalled(self, sender, to, address, now)
        sender, to, for_s = cut[0]
        self.abort(
            now,
            f"peer {sender.id} ({sender.name}) reported round {plan.round}, but its data to peer "
            f"{to.id} ({to.name}) has gone unacknowledged for {for_s:.0f}s while {to.name} "
            "sees nothing move: the link between them is cut",
        )

    # -- begin ----------------------------------------------------------------------------------
    def begin(
        self,
        pid: int,
        now: float,
        *,
        nonce: str,
        revision: int,
        hashes: dict[str, str] | None,
        schema: list[TensorSpec] | None,
        digest: str | None = None,
        explain: bool = True,
    ) -> Decision:
        """A peer is ready for the next round (``nonce`` names this attempt; re-asking with the
        same nonce is idempotent, a new nonce from a member of the running round abandons it).
        ``digest``: the :func:`.parity.state_digest` of its hashes, sent instead of them; the
        parity check asks for the list itself (a ``hashes`` answer) only where the digests
        disagree (:func:`.forming.try_form`). ``explain=False``: a ``wait`` answer carries no
        reason (see :meth:`poll_begin`)."""
        p = self.roster.active(pid)
        if p is None:
            return self.gone(pid)
        p.last_seen = now
        if schema is not None and not p.schema_ok:
            why = None if self.schema is None else schema_mismatch(self.schema, schema)
            why = why or self.roster.kind_conflict(pid)
            if why is not None:
                reason = f"shared state does not match the run: {why}"
                self.remove(pid, now, reason, state=PeerState.REFUSED)
                return Decision("refused", reason)
            if self.schema is None:
                self.schema = list(schema)
            p.schema_ok = True
        if not p.schema_ok:
            return Decision("refused", "a peer's first begin must carry its shared-state schema")
        r = self.phase.round
        if r is not None and pid in r.nonces:
            if r.nonces[pid] == nonce:
                return r.go
            # A new attempt from a member means it gave up on the running round.
            self.abort(now, f"peer {pid} ({p.name}) abandoned round {r.plan.round}")
        p.revision = revision
        rp = self.restore_point
        if rp is not None and p.told_restore == rp.revision and revision < rp.revision:
            # it loaded an older checkpoint instead (this one failed to verify there): continue
            # from what it could load rather than ask again forever
            self.note(
                now,
                "checkpoint_unusable",
                peer=pid,
                name=p.name,
                checkpoint_revision=rp.revision,
                reason=f"{p.name} could not load checkpoint {rp.revision} and restored {revision}",
            )
            self.restore_point = None
        if hashes is not None:
            p.hashes, p.digest = dict(hashes), None
        elif digest is not None:
            p.hashes, p.digest = None, digest
        if p.ready_nonce != nonce:
            p.ready_nonce = nonce
            p.ready_since = now
        if self.started and not (p.in_sync and revision == self.revision):
            self.begins_apart += 1  # a joiner or stale peer: the others may owe their hashes
        if not self.phase.running:
            self.phase.waiting(now)
        forming.try_form(self, now, quick=bool(nonce))
        return self.poll_begin(pid, nonce, explain=explain)

    def poll_begin(
        self, pid: int, nonce: str, *, explain: bool = True, now: float | None = None
    ) -> Decision:
        """Where a waiting begin stands, without changing anything. ``explain=False`` leaves a
        ``wait`` answer's reason empty, which spares a scan of every peer (a waiter that is
        asked again at the next change only reads the reason of its last answer). With
        ``now``, the reason of a round still forming may be one worked out up to
        :data:`REASON_TTL` seconds earlier with nothing changed since but begins of in-sync
        members (thousands of waiters that time out together share one scan)."""
        p = self.roster.active(pid)
        if p is None:
            return self.gone(pid)
        r = self.phase.round
        if r is not None and r.nonces.get(pid) == nonce:
            return r.go
        if p.ready_nonce != nonce:
            return Decision("wait", "this begin attempt was superseded")
        stop = self.streak.stop()
        if stop is not None:
            return Decision("stopped", stop)
        if p.isolated is not None:
            return Decision("wait", p.isolated)
        if r is not None:
            return Decision("wait", f"round {r.plan.round} is running; joining after it")
        # every peer is scanned only where a rule needs it (a restart, every member gone, a
        # peer without hashes): the usual waiting begin is answered in constant time
        ready: list[int] | None = None
        rp = None
        if self.restore_point is not None and not self.started:
            ready = self.roster.ready()
            rp = self.restore_for(p, ready)
        if rp is not None:
            # Its work so far started from another state: the first round it is in drops it. It
            # is not ready until it begins again, restored.
            p.told_restore, p.uncounted, p.ready_nonce = rp.revision, True, None
            return Decision(
                "restore",
                f"no live peer holds the run's state: load checkpoint {rp.revision} at {rp.url}",
                restore=rp,
            )
        # finished needs every member of the last epoch gone: the first one tells at once
        if self.started and self.members and self.peers[self.members[0]].state is PeerState.LEFT:
            ready = self.roster.ready() if ready is None else ready
            if forming.finished(self, ready):
                return Decision(
                    "finished",
                    f"the run is over: its last members left after round {self.revision - 1} "
                    f"and no peer holding its state is here",
                )
        if p.hashes is None and p.digest is None and p.ready_nonce and self._hashes_needed(ready):
            return Decision("hashes", "send state hashes for the parity check")
        return Decision("wait", self._waiting_reason(now)) if explain else _WAIT

    def _hashes_needed(self, ready: list[int] | None) -> bool:
        """:func:`.forming.hashes_needed` over the ready peers (``ready``, or listed here),
        worked out once per :meth:`~.state.RunState.stamp`: only a begin from outside the
        voters (which moves the stamp) or a change of the run can bring a peer that is not in
        sync among the ready ones, so between two moves of the stamp the answer stands. Every
        waiting begin without hashes asks it at every pass (with ``parity_every`` > 1 that is
        every waiting begin): once per pass, not once per waiter, each a pass over every peer."""
        if not self.started or self.revision % self.config.parity_every == 0:
            return True  # scheduled, or the first round: no need to look at anyone
        stamp = self.stamp()
        if self._needed is None or self._needed[0] != stamp:
            ready = self.roster.ready() if ready is None else ready
            self._needed = (stamp, forming.hashes_needed(self, ready))
        return self._needed[1]

    def _waiting_reason(self, now: float | None) -> str:
        if now is None:
            return forming.waiting_reason(self)
        stamp, cached = self.stamp(), self.reason_cache
        if cached is not None and cached[0] == stamp and 0 <= now - cached[1] < REASON_TTL:
            return cached[2]
        why = forming.waiting_reason(self)
        self.reason_cache = (stamp, now, why)
        return why

    def try_form(self, now: float) -> None:
        """Form the next round if its conditions hold (:func:`.forming.try_form`)."""
        forming.try_form(self, now)

    # -- commit ---------------------------------------------------------------------------------
    def commit(
        self,
        pid: int,
        now: float,
        *,
        epoch: int,
        round: int,
        ok: bool,
        error: str = "",
        unreached: tuple[Unreached, ...] = (),
        explain: bool = True,
    ) -> Decision:
        """Record a member's outcome for round ``round`` of epoch ``epoch``. ``unreached``
        (with a failure) names members it could not reach: those pairs are down, also when the
        round already ended (the first report aborts it, the others still describe the
        network). ``explain=False``: a ``wait`` answer carries no reason (see
        :meth:`poll_commit`)."""
        reporter = self.roster.active(pid)
        if unreached and reporter is not None:
            isolation.unreached(self, reporter, unreached, now)
        key = (epoch, round)
        if key in self.outcomes:
            return Decision(*self.outcomes[key])
        p = self.roster.active(pid)
        if p is None:
            return self.gone(pid)
        p.last_seen = now
        r = self.phase.round
        if r is None or (r.plan.epoch, r.plan.round) != key or not r.has(pid):
            return Decision("aborted", f"round {round} of epoch {epoch} is not running")
        r.report(pid, ok)
        if not ok:
            self.abort(now, f"peer {pid} ({p.name}) failed: {error or 'no reason given'}")
        elif r.all_succeeded:
            self.commit_round(now)
        return self.poll_commit(epoch, round, explain=explain)

    def poll_commit(self, epoch: int, round: int, *, explain: bool = True) -> Decision:
        """Where a commit report of round ``round`` of epoch ``epoch`` stands, without changing
        anything. ``explain=False`` leaves a ``wait`` answer's reason empty (naming the members
        still to report scans them all)."""
        key = (epoch, round)
        if key in self.outcomes:
            return Decision(*self.outcomes[key])
        r = self.phase.round
        if r is None or (r.plan.epoch, r.plan.round) != key:
            return Decision("aborted", f"round {round} of epoch {epoch} is not running")
        if not explain:
            return _WAIT
        waiting = [m for m in r.plan.members if m not in r.reports]
        return Decision("wait", f"waiting for commit reports from peers {waiting}")


def _silent_claims(value: Any) -> tuple[tuple[int, int, float], ...]:
    """A heartbeat's ``transfer.silent`` as ``(epoch, rank, for_s)``; entries of another shape
    are left out (the heartbeat's info is the peer's own free-form dict)."""
    if not isinstance(value, list):
        return ()
    out = []
    for e in value[:MAX_SILENT]:
        if not isinstance(e, dict):
            continue
        epoch, rank, for_s = e.get("epoch"), e.get("rank"), e.get("for_s")
        numbers = (epoch, rank, for_s)
        if not any(isinstance(x, bool) for x in numbers) and (
            isinstance(epoch, int) and isinstance(rank, int) and isinstance(for_s, (int, float))
        ):
            out.append((epoch, rank, float(for_s)))
    return tuple(out)
