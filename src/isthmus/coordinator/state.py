"""What the coordinator knows of a run, and the changes every rule of :mod:`.membership` is built
from: a peer dropped, a round ended (committed or aborted), the run restarted from a checkpoint.

:class:`RunState` holds the peers (:class:`~.peers.Roster`), the run's revision and epoch, the
members of the current (or last) epoch, the :class:`~.phase.RunPhase` (with the round that
runs), the canonical hashes, the outcomes of recent rounds, the restore point and the
:class:`~.record.RunRecord` of events, counters and pushes. Pure: every method takes ``now``.
"""

from __future__ import annotations

from typing import Any

from isthmus.coordinator.abort_streak import AbortStreak, normalize_cause
from isthmus.coordinator.parity import voters as voters_of
from isthmus.coordinator.partition import Reachability
from isthmus.coordinator.peers import MembershipConfig, Peer, PeerState, Roster
from isthmus.coordinator.phase import Phase, RunPhase
from isthmus.coordinator.protocol import Decision, RestorePoint, RoundPlan, TensorSpec
from isthmus.coordinator.record import Notice, RunRecord

__all__ = ["HISTORY", "RunState"]

HISTORY = 256
"""Outcomes of this many recent rounds are kept (a late commit report is answered from them)."""


class RunState:
    """One run's state (see the module doc); :class:`~.membership.Membership` adds the
    requests."""

    def __init__(self, config: MembershipConfig | None = None) -> None:
        self.config = config or MembershipConfig()
        self.roster = Roster()
        self.peers = self.roster.peers  # the same dict: id -> Peer
        self.schema: list[TensorSpec] | None = None
        self.revision = 0
        self.epoch = 0
        self.members: tuple[int, ...] = ()  # members of the current (or last) epoch
        self.phase = RunPhase()
        self.canonical: dict[str, str] | None = None  # hashes at `revision`, when known
        self.outcomes: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, round) -> (kind, why)
        self.record = RunRecord()
        self.counters = self.record.counters  # the record's own objects, under short names
        self.events = self.record.events
        self.notices = self.record.notices
        self.restore_point: RestorePoint | None = None
        """The latest complete checkpoint, which the run restarts from when no live peer holds
        its state (None: unknown; such a run waits for a peer that holds it)."""
        self.reach = Reachability(self.config.partition)
        """Which pairs of peers (by name) failed to reach each other, and their probes since."""
        self.streak = AbortStreak(self.config.abort_limit)
        """Consecutive aborts of the running round for one cause; at the limit the run stops."""
        self.probe_asked: dict[tuple[str, str], float] = {}
        """When the coordinator last asked for a probe of each down pair."""
        self.begins_apart = 0
        """Begins from peers outside the run's in-sync voters (joiners, stale peers): such a
        begin may change what the other waiting peers are answered (send hashes)."""
        self.reason_cache: tuple[tuple[int, ...], float, str] | None = None
        """(stamp, when, reason): the last reason a waiting begin was given."""
        self.blocker: tuple[tuple[int, ...], int, float, list[int]] | None = None
        """(members, member, since, others): the last round that could not form waited for
        ``member`` of those ``members`` (and for ``others``, the next to check once ``member``
        has begun), and no waiting member had been ready before ``since``
        (:func:`.forming.try_form` checks it first)."""

    # -- questions ------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """A round has formed since the run started (or restarted from a checkpoint)."""
        return self.phase.started

    @property
    def running(self) -> RoundPlan | None:
        """The plan of the round that runs (None between rounds)."""
        return None if self.phase.round is None else self.phase.round.plan

    @property
    def round_started_at(self) -> float | None:
        """When the round that runs formed (None between rounds)."""
        return None if self.phase.round is None else self.phase.round.started_at

    @property
    def events_total(self) -> int:
        """Events ever recorded (:attr:`events` holds the latest of them)."""
        return self.record.total

    def stamp(self) -> tuple[int, int, int, int, int]:
        """Changes whenever an answer to a waiting begin or commit may have changed (an event,
        a move of the phase, a begin from outside the voters); equal stamps mean the waiting
        requests need not be asked again. O(1)."""
        return (self.record.total, self.phase.moves, self.revision, self.epoch, self.begins_apart)

    def is_active(self, pid: int) -> bool:
        """Whether peer ``pid`` is registered and active (not dead, left or refused)."""
        return self.roster.is_active(pid)

    def expected(self) -> list[int]:
        """The live members of the last epoch: the next round waits for them."""
        return self.roster.alive(self.members)

    def active_names(self) -> list[str]:
        """The names of the active peers (the members of the reachability picture)."""
        return [p.name for p in self.peers.values() if p.state is PeerState.ACTIVE]

    def by_name(self, name: str) -> Peer | None:
        """The active peer called ``name`` (the latest registered), or None."""
        found = [p for p in self.peers.values() if p.name == name and p.state is PeerState.ACTIVE]
        return found[-1] if found else None

    def voters(self, ready: list[int]) -> list[int]:
        """Those of ``ready`` whose state counts in the majority vote (:func:`.parity.voters`)."""
        rp = self.restore_point
        return voters_of(
            ready,
            self.peers,
            started=self.started,
            revision=self.revision,
            restore_revision=None if rp is None else rp.revision,
            expected=self.expected(),
        )

    def gone(self, pid: int) -> Decision:
        """The answer to a request of ``pid``, which is not active."""
        p = self.peers.get(pid)
        if p is None:
            return Decision("evicted", f"peer {pid} is not registered with this coordinator")
        if p.state is PeerState.REFUSED:
            return Decision("refused", p.reason)
        return Decision("evicted", f"peer {pid} was removed: {p.reason or p.state.value}")

    # -- the record -----------------------------------------------------------------------------
    def note(self, now: float, kind: str, **kw: Any) -> None:
        """Record an event (with the run's revision); also for events that happened outside the
        membership (a checkpoint written)."""
        self.record.add({"t": now, "kind": kind, "revision": self.revision, **kw})

    def take_notices(self) -> list[Notice]:
        """The pushes queued for peers (round aborted), oldest first; none are left queued."""
        return self.record.take_notices()

    # -- changes --------------------------------------------------------------------------------
    def drop(
        self,
        pid: int,
        now: float,
        reason: str,
        state: PeerState = PeerState.DEAD,
        **detail: Any,
    ) -> None:
        """Mark active peer ``pid`` dead, left or refused (nothing if it is not active); aborts
        the running round if it is a member. Forms no round (the membership's requests do)."""
        p = self.roster.active(pid)
        if p is None:
            return
        self.roster.retire(p, state)
        p.reason = reason
        p.ready_nonce = None
        p.isolated = None
        self.reach.forget(p.name)  # a later process under this name is another process
        self.counters[
            {"dead": "evictions", "left": "leaves", "refused": "refusals"}[state.value]
        ] += 1
        self.note(now, state.value, peer=pid, name=p.name, reason=reason, **detail)
        r = self.phase.round
        if r is not None and r.has(pid):
            self.abort(now, f"peer {pid} ({p.name}) {state.value}: {reason}")

    def _finish(self, outcome: str, reason: str) -> RoundPlan:
        plan = self.running
        assert plan is not None
        self.outcomes[(plan.epoch, plan.round)] = (outcome, reason)
        if len(self.outcomes) > HISTORY:
            for k in sorted(self.outcomes)[: len(self.outcomes) - HISTORY]:
                del self.outcomes[k]
        self.phase.to(Phase.COMMITTED if outcome == "committed" else Phase.ABORTED)
        return plan

    def commit_round(self, now: float) -> None:
        """Every member of the running round succeeded: the run's revision advances and every
        member holds it, in sync."""
        plan = self.running
        assert plan is not None
        self.revision += 1
        for pid in plan.members:
            p = self.peers[pid]
            p.in_sync = True
            p.uncounted = False
            p.revision = self.revision
        self.canonical = None
        self.counters["rounds_committed"] += 1
        self._finish("committed", "")
        self.streak.committed()
        self.note(now, "commit", round=plan.round, epoch=plan.epoch, world=len(plan.members))

    def abort(self, now: float, reason: str) -> None:
        """Abort the running round (if one runs) for every member; they are pushed an ``abort``
        message. The next round opens a new epoch."""
        if self.running is None:
            return
        self.counters["rounds_aborted"] += 1
        # A member that did not finish the round still holds the state of the round's start,
        # which is the run's revision: it stays in sync.
        plan = self._finish("aborted", reason)
        self.streak.aborted(normalize_cause(reason), reason)
        self.note(now, "abort", round=plan.round, epoch=plan.epoch, reason=reason)
        stop = self.streak.stop()
        if stop is not None and self.streak.count == self.streak.limit:
            self.note(now, "stopped", round=plan.round, reason=stop)
        msg = {"type": "abort", "epoch": plan.epoch, "round": plan.round, "reason": reason}
        self.record.push(plan.members, msg)

    # -- restoring from a checkpoint ------------------------------------------------------------
    def set_restore_point(self, point: RestorePoint, now: float) -> None:
        """A complete checkpoint exists at ``point`` (kept if it is the newest known)."""
        if self.restore_point is None or point.revision >= self.restore_point.revision:
            self.restore_point = point

    def restore_wanted(self) -> RestorePoint | None:
        """The checkpoint a peer registering now should load before its first round: set while
        the run is (re)starting from one, else None."""
        return None if self.started else self.restore_point

    def restart_if_lost(self, now: float) -> None:
        """Every peer that held the run's state is gone: restart from the restore point (nothing
        when there is none, a round runs, or a live peer is in sync)."""
        rp = self.restore_point
        if rp is None or self.running is not None or not self.started:
            return
        if any(p.in_sync for p in map(self.roster.active, self.peers) if p):
            return
        self.note(
            now,
            "restart",
            checkpoint_revision=rp.revision,
            url=rp.url,
            reason=f"no live peer holds the state of revision {self.revision}: the run continues "
            f"from checkpoint {rp.revision}",
        )
        self.phase.to(Phase.RESTARTING)
        self.members, self.canonical = (), None

    def restore_for(self, p: Peer, ready: list[int]) -> RestorePoint | None:
        """The checkpoint ``p`` must load before the restarting run can form (None: none)."""
        rp = self.restore_point
        if rp is None or self.started or (p.revision or 0) >= rp.revision or p.id not in ready:
            return None
        if max((self.peers[q].revision or 0) for q in ready) >= rp.revision:
            return None  # a peer holds that state or a later one: p is repaired from it
        return rp

    # -- introspection --------------------------------------------------------------------------
    def status(self, now: float) -> dict[str, Any]:
        """``/v1/status``'s view of the run (without the events)."""
        return {
            "revision": self.revision,
            "epoch": self.epoch,
            "members": list(self.members),
            "world": len(self.expected()),
            "phase": "running" if self.running is not None else "forming",
            "round": self.running.round if self.running else self.revision,
            "peers": self.roster.describe(now, self.members),
            "isolated": {
                str(pid): p.isolated
                for pid, p in self.peers.items()
                if p.isolated and p.state is PeerState.ACTIVE
            },
            "down_pairs": [list(k) for k in self.reach.down_pairs(self.active_names())],
            "stopped": self.streak.stop(),
            "counters": dict(self.counters),
            "config": {
                k: getattr(self.config, k)
                for k in ("min_peers", "heartbeat_timeout", "parity_every")
            },
            "restore_point": self.restore_point and self.restore_point.to_json(),
        }
