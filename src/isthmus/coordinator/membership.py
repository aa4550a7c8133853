"""Membership, rounds and parity as a pure state machine (no sockets, no clocks of its own).

The coordinator server feeds this class requests and the current time; everything that decides
who is in a round, whether a round commits, who must be resynced from whom, and when a run
restarts from a checkpoint lives here, so it can be unit-tested with a fake clock.
docs/PROTOCOL.md walks through the protocol; in short:

* A peer **registers**, then keeps a heartbeat; one silent for ``heartbeat_timeout`` (or whose
  heartbeat connection closed) is evicted.
* **begin**: the run's next round is always ``revision`` (committed rounds so far). It forms
  when every surviving member of the last epoch is ready (plus waiting joiners) and at least
  ``min_peers`` are: members ranked by name, a new epoch if membership changed or the last
  round aborted, and a resync plan.
* **Parity** (:mod:`.parity`): with begin every ``parity_every`` rounds, and always when new or
  stale, peers send per-tensor hashes; the voters (in sync at the last commit) decide the
  canonical hashes by majority; a voter that differs is a *parity failure*, anyone who differs
  is repaired from an in-sync source before taking part.
* **commit**: one failure, a report missing past ``commit_timeout`` or a member's death aborts
  the round for everyone; only when every member succeeded does ``revision`` advance. After an
  abort the next round opens a new epoch (fresh process groups). **leave** aborts nothing.
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

from collections import Counter
from typing import Any

from isthmus.coordinator.parity import canonical, repairs
from isthmus.coordinator.peers import COUNTERS, MembershipConfig, Peer, PeerState
from isthmus.coordinator.phase import Phase, RunPhase
from isthmus.coordinator.protocol import (
    Decision,
    RestorePoint,
    RoundPlan,
    TensorSpec,
    Transfer,
    schema_mismatch,
)
from isthmus.coordinator.ring import ring_members

__all__ = ["Membership", "MembershipConfig", "PeerState"]  # config and states live in .peers


_HISTORY = 256


class Membership:
    """The coordinator's state. Methods take ``now`` (seconds, monotonic) and never block.

    Callers (the server) hold a lock around every call and wake waiting requests after each one.
    Pushes for peers (round aborted) are queued in :attr:`notices`; the server drains them.
    """

    def __init__(self, config: MembershipConfig | None = None) -> None:
        self.config = config or MembershipConfig()
        self.peers: dict[int, Peer] = {}
        self._next_id = 0
        self.schema: list[TensorSpec] | None = None
        self.revision = 0
        self.epoch = 0
        self.members: tuple[int, ...] = ()  # members of the current (or last) epoch
        self.running: RoundPlan | None = None
        self.reports: dict[int, bool] = {}
        self.round_started_at = 0.0
        self.phase = RunPhase()
        self.canonical: dict[str, str] | None = None  # hashes at `revision`, when known
        self.outcomes: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, round) -> (kind, why)
        self.plans: dict[int, tuple[str, RoundPlan]] = {}  # peer -> (nonce, plan) of running round
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.events: list[dict[str, Any]] = []
        self.events_total = 0  # ever recorded (the list keeps the last 10,000)
        self.notices: list[tuple[tuple[int, ...], dict[str, Any]]] = []
        self.restore_point: RestorePoint | None = None
        """The latest complete checkpoint, which the run restarts from when no live peer holds
        its state (None: unknown; such a run waits for a peer that holds it)."""

    @property
    def started(self) -> bool:
        """A round has formed since the run started (or restarted from a checkpoint)."""
        return self.phase.started

    # -- helpers --------------------------------------------------------------------------------
    def note(self, now: float, kind: str, **kw: Any) -> None:
        """Record an event that happened outside the membership (a checkpoint written)."""
        self._event(now, kind, **kw)

    def _event(self, now: float, kind: str, **kw: Any) -> None:
        self.events.append({"t": now, "kind": kind, "revision": self.revision, **kw})
        self.events_total += 1
        if len(self.events) > 10_000:  # bounded memory; Coordinator.events_since drains them
            del self.events[:1000]

    def is_active(self, pid: int) -> bool:
        """Whether peer ``pid`` is registered and active (not dead, left or refused)."""
        p = self.peers.get(pid)
        return p is not None and p.state is PeerState.ACTIVE

    def _peer(self, pid: int) -> Peer | None:
        p = self.peers.get(pid)
        return p if p is not None and p.state is PeerState.ACTIVE else None

    def _gone(self, pid: int) -> Decision:
        p = self.peers.get(pid)
        if p is None:
            return Decision("evicted", f"peer {pid} is not registered with this coordinator")
        if p.state is PeerState.REFUSED:
            return Decision("refused", p.reason)
        return Decision("evicted", f"peer {pid} was removed: {p.reason or p.state.value}")

    # -- registration and liveness ----------------------------------------------------------------
    def register(self, name: str, now: float, info: dict[str, Any] | None = None) -> int:
        self._maybe_restart(now)
        pid = self._next_id
        self._next_id += 1
        self.peers[pid] = Peer(pid, name, now, now, info=dict(info or {}), uncounted=self.started)
        self.counters["registrations"] += 1
        self._event(now, "register", peer=pid, name=name)
        return pid

    def heartbeat(self, pid: int, now: float, info: dict[str, Any] | None = None) -> bool:
        """Record a sign of life. False if the peer is no longer active (it must register again)."""
        p = self._peer(pid)
        if p is None:
            return False
        p.last_seen = now
        if info:
            p.info.update(info)
        return True

    def remove(
        self, pid: int, now: float, reason: str, *, state: PeerState = PeerState.DEAD
    ) -> None:
        """Evict (or mark left/refused) a peer; aborts the running round if it was a member."""
        self._remove(pid, now, reason, state)
        self.try_form(now)

    def _remove(
        self,
        pid: int,
        now: float,
        reason: str,
        state: PeerState = PeerState.DEAD,
        **detail: Any,
    ) -> None:
        p = self._peer(pid)
        if p is None:
            return
        p.state = state
        p.reason = reason
        p.ready_nonce = None
        self.counters[
            {"dead": "evictions", "left": "leaves", "refused": "refusals"}[state.value]
        ] += 1
        self._event(now, state.value, peer=pid, name=p.name, reason=reason, **detail)
        if self.running is not None and pid in self.running.members:
            self._abort(now, f"peer {pid} ({p.name}) {state.value}: {reason}")

    def leave(
        self, pid: int, now: float, *, digest: str | None = None, revision: int | None = None
    ) -> None:
        """``pid`` leaves between rounds; ``digest`` and ``revision`` (its shared state's, as it
        leaves) go into the ``left`` event, for checking that every peer ended identical."""
        detail = {} if digest is None else {"digest": digest, "final_revision": revision}
        self._remove(pid, now, "left the run", PeerState.LEFT, **detail)
        self.try_form(now)

    def tick(self, now: float) -> None:
        """Apply every timeout: dead peers, members that never begin or never commit."""
        cfg = self.config
        for p in list(self.peers.values()):
            if p.state is PeerState.ACTIVE and now - p.last_seen > cfg.heartbeat_timeout:
                self._remove(p.id, now, f"no heartbeat for {now - p.last_seen:.1f}s")
        if self.running is not None and now - self.round_started_at > cfg.commit_timeout:
            for pid in self.running.members:
                if pid not in self.reports and self.is_active(pid):
                    self._remove(
                        pid,
                        now,
                        f"did not report round {self.running.round} within "
                        f"{cfg.commit_timeout:.0f}s",
                    )
        self.try_form(now)

    # -- restoring from a checkpoint ------------------------------------------------------------
    def set_restore_point(self, point: RestorePoint, now: float) -> None:
        """A complete checkpoint exists at ``point`` (kept if it is the newest known)."""
        if self.restore_point is None or point.revision >= self.restore_point.revision:
            self.restore_point = point

    def restore_wanted(self) -> RestorePoint | None:
        """The checkpoint a peer registering now should load before its first round: set while
        the run is (re)starting from one, else None."""
        return None if self.started else self.restore_point

    def _state_lost(self) -> bool:
        return self.started and not any(p.in_sync for p in map(self._peer, self.peers) if p)

    def _maybe_restart(self, now: float) -> None:
        """Every peer that held the run's state is gone: restart from the restore point."""
        rp = self.restore_point
        if rp is None or self.running is not None or not self._state_lost():
            return
        self._event(
            now,
            "restart",
            checkpoint_revision=rp.revision,
            url=rp.url,
            reason=f"no live peer holds the state of revision {self.revision}: the run continues "
            f"from checkpoint {rp.revision}",
        )
        self.phase.to(Phase.RESTARTING)
        self.members, self.canonical = (), None

    def _restore_for(self, p: Peer, ready: list[int]) -> RestorePoint | None:
        """The checkpoint ``p`` must load before the restarting run can form (None: none)."""
        rp = self.restore_point
        if rp is None or self.started or (p.revision or 0) >= rp.revision or p.id not in ready:
            return None
        if max((self.peers[q].revision or 0) for q in ready) >= rp.revision:
            return None  # a peer holds that state or a later one: p is repaired from it
        return rp

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
    ) -> Decision:
        """A peer is ready for the next round (``nonce`` names this attempt; re-asking with the
        same nonce is idempotent, a new nonce from a member of the running round abandons it)."""
        p = self._peer(pid)
        if p is None:
            return self._gone(pid)
        p.last_seen = now
        if schema is not None and not p.schema_ok:
            why = None if self.schema is None else schema_mismatch(self.schema, schema)
            if why is not None:
                reason = f"shared state does not match the run: {why}"
                self.remove(pid, now, reason, state=PeerState.REFUSED)
                return Decision("refused", reason)
            if self.schema is None:
                self.schema = list(schema)
            p.schema_ok = True
        if not p.schema_ok:
            return Decision("refused", "a peer's first begin must carry its shared-state schema")
        if self.running is not None and pid in self.plans:
            old_nonce, plan = self.plans[pid]
            if old_nonce == nonce:
                return Decision("go", plan=plan)
            # A new attempt from a member means it gave up on the running round.
            self._abort(now, f"peer {pid} ({p.name}) abandoned round {self.running.round}")
        p.revision = revision
        rp = self.restore_point
        if rp is not None and p.told_restore == rp.revision and revision < rp.revision:
            # it loaded an older checkpoint instead (this one failed to verify there): continue
            # from what it could load rather than ask again forever
            self._event(
                now,
                "checkpoint_unusable",
                peer=pid,
                name=p.name,
                checkpoint_revision=rp.revision,
                reason=f"{p.name} could not load checkpoint {rp.revision} and restored {revision}",
            )
            self.restore_point = None
        if hashes is not None:
            p.hashes = dict(hashes)
        if p.ready_nonce != nonce:
            p.ready_nonce = nonce
            p.ready_since = now
        if not self.phase.running:
            self.phase.waiting(now)
        self.try_form(now)
        return self.poll_begin(pid, nonce)

    def poll_begin(self, pid: int, nonce: str) -> Decision:
        """Where a waiting begin stands, without changing anything."""
        p = self._peer(pid)
        if p is None:
            return self._gone(pid)
        if pid in self.plans and self.plans[pid][0] == nonce:
            return Decision("go", plan=self.plans[pid][1])
        if p.ready_nonce != nonce:
            return Decision("wait", "this begin attempt was superseded")
        if self.running is not None:
            return Decision("wait", f"round {self.running.round} is running; joining after it")
        ready = self._ready()
        rp = self._restore_for(p, ready)
        if rp is not None:
            # Its work so far started from another state: the first round it is in drops it. It
            # is not ready until it begins again, restored.
            p.told_restore, p.uncounted, p.ready_nonce = rp.revision, True, None
            return Decision(
                "restore",
                f"no live peer holds the run's state: load checkpoint {rp.revision} at {rp.url}",
                restore=rp,
            )
        if self._finished(ready):
            return Decision(
                "finished",
                f"the run is over: its last members left after round {self.revision - 1} and no "
                f"peer holding its state is here",
            )
        if p.hashes is None and pid in ready and self._hashes_needed(ready):
            return Decision("hashes", "send state hashes for the parity check")
        return Decision("wait", self._waiting_reason())

    def _ready(self) -> list[int]:
        return sorted(
            pid for pid, p in self.peers.items() if p.state is PeerState.ACTIVE and p.ready_nonce
        )

    def _expected(self) -> list[int]:
        return [pid for pid in self.members if self.is_active(pid)]

    def _hash_round(self) -> bool:
        return self.revision % self.config.parity_every == 0

    def _voters(self, ready: list[int]) -> list[int]:
        """Peers whose state counts in the majority vote: in sync at the run's revision."""
        if not self.started:
            # Nobody has committed anything yet: everyone holds an initial state. Peers resuming
            # from a checkpoint may be ahead; the highest revision present wins.
            top = max((self.peers[p].revision or 0) for p in ready)
            if self.restore_point is not None and top < self.restore_point.revision:
                return []  # they load the checkpoint first (poll_begin answers restore)
            return [p for p in ready if (self.peers[p].revision or 0) == top]
        voters = [
            p for p in ready if self.peers[p].in_sync and self.peers[p].revision == self.revision
        ]
        if not voters and not any(self.peers[m].in_sync for m in self._expected()):
            # Every in-sync peer is gone (e.g. the whole run restarted from a checkpoint): peers
            # that hold exactly the run's revision may vote on its state.
            voters = [p for p in ready if self.peers[p].revision == self.revision]
        return voters

    def _finished(self, ready: list[int]) -> bool:
        """Every member of the last epoch left gracefully and nobody ready holds the state."""
        if not self.started or self._voters(ready) or not self.members:
            return False
        return all(self.peers[m].state is PeerState.LEFT for m in self.members)

    def _hashes_needed(self, ready: list[int]) -> bool:
        """Whether the next round needs every ready peer's hashes: a scheduled check, or someone
        who is not in sync (a joiner or stale peer) must be compared and repaired."""
        if not ready:
            return False
        voters = set(self._voters(ready))
        return not self.started or self._hash_round() or any(p not in voters for p in ready)

    def _waiting_reason(self) -> str:
        ready = self._ready()
        expected = self._expected()
        missing = [pid for pid in expected if pid not in ready]
        if missing:
            names = ", ".join(f"{pid} ({self.peers[pid].name})" for pid in missing)
            return f"waiting for members to begin round {self.revision}: {names}"
        if len(ready) < self.config.min_peers:
            return f"waiting for peers: {len(ready)} ready, min_peers is {self.config.min_peers}"
        start = self.config.start_peers or self.config.min_peers
        if not self.started and len(ready) < start:
            return f"waiting for the first {start} peers: {len(ready)} ready"
        rp = self.restore_point
        if not self.started and rp is not None and ready and not self._voters(ready):
            return f"waiting for peers to load checkpoint {rp.revision} at {rp.url}"
        if ready and not self._voters(ready):
            return (
                f"no ready peer holds the run's state (revision {self.revision}); waiting for one"
            )
        return "waiting for state hashes"

    def try_form(self, now: float) -> None:
        """Form the next round if its conditions hold (called after every event)."""
        if self.running is not None:
            return
        ready = self._ready()
        if not ready:
            self.phase.nobody_waiting()
            return
        self._maybe_restart(now)  # lazily: when somebody is there to restart with
        waiting_since = self.phase.waiting(now)
        cfg = self.config
        speaking = [p for p in ready if not self._quiet(p, now)]
        if speaking:  # a peer that went quiet while waiting is left out like a quiet member
            ready = speaking
        expected = self._expected()
        missing = [pid for pid in expected if pid not in ready]
        # The clock starts when a member of the last epoch is ready, never because of a joiner:
        # members are not expected to begin a round just because somebody is waiting to join.
        member_ready = [
            now if self.peers[m].ready_since is None else self.peers[m].ready_since
            for m in expected
            if m in ready
        ]
        if missing and member_ready and now - min(member_ready) > cfg.begin_timeout:
            for pid in missing:
                self._remove(
                    pid, now, f"did not begin round {self.revision} within {cfg.begin_timeout:.0f}s"
                )
            missing = []
        if missing and member_ready and all(self._quiet(p, now) for p in missing):
            # Members that went quiet are not waited for (MembershipConfig.quiet_after): a second
            # silent member must not hold the retry until its own eviction.
            missing = []
        if missing:
            return
        if len(ready) < cfg.min_peers:
            return
        restarting = self.phase.phase is Phase.RESTARTING
        start = cfg.min_peers if restarting else cfg.start_peers or cfg.min_peers
        if not self.started and len(ready) < start and now - waiting_since < cfg.start_timeout:
            return
        voters = self._voters(ready)
        if not voters:
            return  # no peer holds the run's state; wait (bounded by the clients' timeouts)
        need_hashes = self._hashes_needed(ready)
        if need_hashes and any(self.peers[p].hashes is None for p in ready):
            return  # waiting peers are told to send hashes by poll_begin
        self._form(now, ready, voters, need_hashes)

    def _quiet(self, pid: int, now: float) -> bool:
        return now - self.peers[pid].last_seen > self.config.quiet_after_s

    def _form(self, now: float, ready: list[int], voters: list[int], checked: bool) -> None:
        for pid in self.members:
            if pid not in ready and self.is_active(pid):  # only a quiet member is left out alive
                p = self.peers[pid]
                self._event(
                    now,
                    "quiet",
                    peer=pid,
                    name=p.name,
                    reason=f"left out of round {self.revision}: silent for "
                    f"{now - p.last_seen:.1f}s",
                )
        if not self.started:
            self.revision = self.peers[voters[0]].revision or 0
        transfers: list[Transfer] = []
        expected: dict[str, str] = {}
        if checked:
            hashes = {pid: self.peers[pid].hashes or {} for pid in ready}
            names = [s.name for s in self.schema or []]
            self.canonical = canonical(names, voters, hashes)
            self.counters["parity_checks"] += 1
            transfers, wrong_by_peer = repairs(self.canonical, ready, voters, hashes)
            for pid, wrong in wrong_by_peer.items():
                if pid in voters and self.started:
                    self.counters["parity_failures"] += 1
                    self._event(now, "parity_failure", peer=pid, tensors=list(wrong)[:20])
                self.counters["resyncs"] += 1
                expected.update({n: self.canonical[n] for n in wrong})
        # in_sync: holds the canonical state of the run's revision. Repaired peers become in sync
        # only when the round commits (the transfer might not complete).
        dsts = {t.dst for t in transfers}
        stale = tuple(p for p in ready if self.peers[p].uncounted and p not in dsts)
        for pid in ready:
            self.peers[pid].in_sync = pid in voters and pid not in dsts
            if pid in dsts:
                self.peers[pid].uncounted = True  # until this round commits
        # ranks follow names, then ids (registration order is a race): a restarted or resumed
        # peer gets its rank, shard and slot back; ring order when peers report links (ring.py)
        members = ring_members(ready, self.peers)
        new_epoch = self.phase.new_epoch_due or members != self.members
        if new_epoch:
            self.epoch += 1
            self._event(now, "epoch", epoch=self.epoch, members=list(members), world=len(members))
        self.members = members
        plan = RoundPlan(
            round=self.revision,
            epoch=self.epoch,
            members=members,
            transfers=tuple(transfers),
            expected=expected,
            new_epoch=new_epoch,
            stale=stale,
        )
        self.phase.to(Phase.RUNNING)
        self.running = plan
        self.reports = {}
        self.round_started_at = now
        self.plans = {}
        for pid in members:
            p = self.peers[pid]
            self.plans[pid] = (p.ready_nonce or "", plan)
            p.ready_nonce = None
            p.hashes = None
        if transfers:
            self._event(now, "resync", transfers=[t.to_json() for t in transfers])

    # -- commit ---------------------------------------------------------------------------------
    def commit(
        self, pid: int, now: float, *, epoch: int, round: int, ok: bool, error: str = ""
    ) -> Decision:
        """Record a member's outcome for round ``round`` of epoch ``epoch``."""
        key = (epoch, round)
        if key in self.outcomes:
            return Decision(*self.outcomes[key])
        p = self._peer(pid)
        if p is None:
            return self._gone(pid)
        p.last_seen = now
        plan = self.running
        if plan is None or plan.epoch != epoch or plan.round != round or pid not in plan.members:
            return Decision("aborted", f"round {round} of epoch {epoch} is not running")
        self.reports[pid] = ok
        if not ok:
            self._abort(now, f"peer {pid} ({p.name}) failed: {error or 'no reason given'}")
        elif all(self.reports.get(m) for m in plan.members):
            self._commit(now)
        return self.poll_commit(epoch, round)

    def poll_commit(self, epoch: int, round: int) -> Decision:
        key = (epoch, round)
        if key in self.outcomes:
            return Decision(*self.outcomes[key])
        if self.running is None or (self.running.epoch, self.running.round) != key:
            return Decision("aborted", f"round {round} of epoch {epoch} is not running")
        waiting = [m for m in self.running.members if m not in self.reports]
        return Decision("wait", f"waiting for commit reports from peers {waiting}")

    def _finish(self, now: float, outcome: str, reason: str) -> None:
        assert self.running is not None
        plan = self.running
        self.outcomes[(plan.epoch, plan.round)] = (outcome, reason)
        if len(self.outcomes) > _HISTORY:
            for k in sorted(self.outcomes)[: len(self.outcomes) - _HISTORY]:
                del self.outcomes[k]
        self.phase.to(Phase.COMMITTED if outcome == "committed" else Phase.ABORTED)
        self.running = None
        self.plans = {}
        self.reports = {}

    def _commit(self, now: float) -> None:
        assert self.running is not None
        plan = self.running
        self.revision += 1
        for pid in plan.members:
            p = self.peers[pid]
            p.in_sync = True
            p.uncounted = False
            p.revision = self.revision
        self.canonical = None
        self.counters["rounds_committed"] += 1
        self._finish(now, "committed", "")
        self._event(now, "commit", round=plan.round, epoch=plan.epoch, world=len(plan.members))

    def _abort(self, now: float, reason: str) -> None:
        if self.running is None:
            return
        plan = self.running
        self.counters["rounds_aborted"] += 1
        # A member that did not finish the round still holds the state of the round's start,
        # which is the run's revision: it stays in sync.
        self._finish(now, "aborted", reason)
        self._event(now, "abort", round=plan.round, epoch=plan.epoch, reason=reason)
        msg = {"type": "abort", "epoch": plan.epoch, "round": plan.round, "reason": reason}
        self.notices.append((plan.members, msg))

    # -- introspection --------------------------------------------------------------------------
    def status(self, now: float) -> dict[str, Any]:
        peers = [
            p.describe(now, member=p.id in self.members)
            for p in self.peers.values()
            if p.state is PeerState.ACTIVE or now - p.last_seen <= 600
        ]
        return {
            "revision": self.revision,
            "epoch": self.epoch,
            "members": list(self.members),
            "world": len([m for m in self.members if self.is_active(m)]),
            "phase": "running" if self.running is not None else "forming",
            "round": self.running.round if self.running else self.revision,
            "peers": peers,
            "counters": dict(self.counters),
            "config": {
                k: getattr(self.config, k)
                for k in ("min_peers", "heartbeat_timeout", "parity_every")
            },
            "restore_point": self.restore_point and self.restore_point.to_json(),
        }
