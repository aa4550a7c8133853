"""When the next round forms, and with whom: the rules the membership applies after every event.

A round forms (:func:`try_form`) when no round runs and

* every live member of the last epoch is ready (a member that has not begun ``begin_timeout``
  after another member did is evicted; members that went quiet, ``quiet_after``, are not
  waited for), and at least ``min_peers`` are;
* for the run's first round, ``start_peers`` are ready or ``start_timeout`` has passed since the
  first was; a restart from a checkpoint waits the same way, for ``restart_timeout`` at most
  (peers killed together come back together, each loading the checkpoint, and a restart formed
  by the first one alone would leave the others to a run of their own once it finished);
* some ready peer holds the run's state (:func:`.parity.voters`), and every ready peer sent its
  hashes when the round needs them (:func:`hashes_needed`);
* the run has not stopped (the same cause aborted its round ``abort_limit`` times in a row).

Ready peers whose pairs are down (a member could not reach another) are sorted out first
(:func:`.isolation.sit_out`): the round forms with the largest set whose pairs are all up, and
is not held for the members left out.

:func:`form` then plans it: the parity check and repairs, members ranked by name (or ring order,
:mod:`.ring`), a new epoch when the members changed or the phase asks for one. Functions of a
:class:`~.state.RunState`; pure like it.
"""

from __future__ import annotations

from isthmus.coordinator.isolation import plan_reach, sit_out
from isthmus.coordinator.parity import (
    canonical,
    lists_from_digests,
    lists_wanted,
    repairs,
    state_digest,
)
from isthmus.coordinator.peers import PeerState
from isthmus.coordinator.phase import Phase, Round
from isthmus.coordinator.protocol import RoundPlan, Transfer
from isthmus.coordinator.ring import ring_members
from isthmus.coordinator.state import RunState

__all__ = ["NAMED", "finished", "form", "hashes_needed", "quiet", "try_form", "waiting_reason"]

NAMED = 20
"""A waiting begin's reason names at most this many of the members it waits for."""


def quiet(s: RunState, pid: int, now: float) -> bool:
    """Peer ``pid`` has been silent longer than ``quiet_after``."""
    return now - s.peers[pid].last_seen > s.config.quiet_after_s


def finished(s: RunState, ready: list[int]) -> bool:
    """Every member of the last epoch left gracefully and nobody ready holds the state."""
    if not s.started or not s.members:
        return False
    # the members' states first: one live member answers it at once, the vote scans everyone
    if not all(s.peers[m].state is PeerState.LEFT for m in s.members):
        return False
    return not s.voters(ready)


def hashes_needed(s: RunState, ready: list[int]) -> bool:
    """Whether the next round needs every ready peer's hashes: a scheduled check, or someone
    who is not in sync (a joiner or stale peer) must be compared and repaired."""
    if not ready:
        return False
    voters = set(s.voters(ready))
    scheduled = s.revision % s.config.parity_every == 0
    return not s.started or scheduled or any(p not in voters for p in ready)


def waiting_reason(s: RunState) -> str:
    """Why no round forms now, in words (a waiting begin's answer)."""
    ready = s.roster.ready()
    is_ready = set(ready)
    missing = [pid for pid in s.expected() if pid not in is_ready and s.peers[pid].isolated is None]
    if missing:
        names = ", ".join(f"{pid} ({s.peers[pid].name})" for pid in missing[:NAMED])
        more = f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
        return f"waiting for members to begin round {s.revision}: {names}{more}"
    if len(ready) < s.config.min_peers:
        return f"waiting for peers: {len(ready)} ready, min_peers is {s.config.min_peers}"
    start = s.config.start_peers or s.config.min_peers
    if not s.started and len(ready) < start:
        return f"waiting for the first {start} peers: {len(ready)} ready"
    rp = s.restore_point
    if not s.started and rp is not None and ready and not s.voters(ready):
        return f"waiting for peers to load checkpoint {rp.revision} at {rp.url}"
    if ready and not s.voters(ready):
        return f"no ready peer holds the run's state (revision {s.revision}); waiting for one"
    return "waiting for state hashes"


def _still_blocked(s: RunState, now: float) -> bool:
    """Whether a member the last attempt waited for (:attr:`~.state.RunState.blocker`) still
    holds the round back, so that :func:`try_form` would change nothing: it is a live, in-sync
    member of the same epoch (so the run need not restart) that has not begun and is not quiet,
    nobody has waited for it past ``begin_timeout``, and no pair is known down and nobody was
    ever isolated (then sitting out leaves everyone in). When the member it names has begun
    (or went quiet) the next of the others it waited for is checked, and so on: each is
    checked once until the round forms, so a round's begins cost O(1) each in all."""
    b = s.blocker
    if b is None or not s.reach.empty or s.counters["isolations"]:
        return False
    members, pid, since, others = b
    if members is not s.members or now - since > s.config.begin_timeout:
        return False
    while True:
        p = s.roster.active(pid)
        if p is not None and p.in_sync and not p.ready_nonce and not quiet(s, pid, now):
            if pid != b[1]:
                s.blocker = (members, pid, since, others)
            return True
        if not others:
            return False
        pid = others.pop()


def try_form(s: RunState, now: float, *, quick: bool = False) -> None:
    """Form the next round if its conditions hold (see the module doc); evicts members that
    did not begin within ``begin_timeout``. ``quick``: first ask whether the member the last
    attempt waited for still holds the round back, which needs no look at every peer (a begin,
    the periodic tick); the forming round's clock is the caller's then (a begin starts it)."""
    if s.running is not None or s.streak.stop() is not None:
        return
    if quick and _still_blocked(s, now):
        return
    s.blocker = None
    ready = s.roster.ready()
    if not ready:
        s.phase.nobody_waiting()
        return
    s.restart_if_lost(now)  # lazily: when somebody is there to restart with
    waiting_since = s.phase.waiting(now)
    cfg = s.config
    speaking = [p for p in ready if not quiet(s, p, now)]
    if speaking:  # a peer that went quiet while waiting is left out like a quiet member
        ready = speaking
    ready = sit_out(s, ready, now)
    taking_part = set(ready)
    expected = [m for m in s.expected() if s.peers[m].isolated is None]
    missing = [pid for pid in expected if pid not in taking_part]
    # The clock starts when a member of the last epoch is ready, never because of a joiner:
    # members are not expected to begin a round just because somebody is waiting to join.
    member_ready = [
        now if s.peers[m].ready_since is None else s.peers[m].ready_since
        for m in expected
        if m in taking_part
    ]
    if missing and member_ready and now - min(member_ready) > cfg.begin_timeout:
        for pid in missing:
            s.drop(pid, now, f"did not begin round {s.revision} within {cfg.begin_timeout:.0f}s")
        missing = []
    speaking_missing = [p for p in missing if not quiet(s, p, now)]
    if missing and member_ready and not speaking_missing:
        # Members that went quiet are not waited for (MembershipConfig.quiet_after): a second
        # silent member must not hold the retry until its own eviction.
        missing = []
    if missing:
        if speaking_missing:
            # The next begins skip this scan while this member holds the round back. The one
            # in the middle: peers that begin in (or against) member order reach it late.
            since = min(member_ready) if member_ready else now
            mid = len(speaking_missing) // 2
            others = speaking_missing[:mid] + speaking_missing[mid + 1 :]
            s.blocker = (s.members, speaking_missing[mid], since, others)
        return
    if len(ready) < cfg.min_peers:
        return
    start = cfg.start_peers or cfg.min_peers
    bound = cfg.start_timeout
    if s.phase.phase is Phase.RESTARTING:
        bound = min(bound, cfg.restart_timeout)
    if not s.started and len(ready) < start and now - waiting_since < bound:
        return
    voters = s.voters(ready)
    if not voters:
        return  # no peer holds the run's state; wait (bounded by the clients' timeouts)
    need_hashes = hashes_needed(s, ready)
    if need_hashes:
        if any(s.peers[p].hashes is None and s.peers[p].digest is None for p in ready):
            return  # waiting peers are told to send hashes by poll_begin
        if _want_lists(s, now, ready, voters):
            return  # as above: those peers are asked for their full lists
    form(s, now, ready, voters, need_hashes)


def digests(s: RunState, ready: list[int]) -> dict[int, str]:
    """Each ready peer's :func:`.parity.state_digest`: the one its begin carried, or that of
    the list it sent (worked out once, kept with the list)."""
    out = {}
    for pid in ready:
        p = s.peers[pid]
        if p.digest is None and p.hashes is not None:
            p.digest = state_digest(p.hashes)
        out[pid] = p.digest or ""
    return out


def _want_lists(s: RunState, now: float, ready: list[int], voters: list[int]) -> bool:
    """Whether a parity check over the ready peers' digests still needs some full lists
    (:func:`.parity.lists_wanted`); those peers' digests are forgotten, so that their waiting
    begins are answered ``hashes`` (:meth:`~.membership.Membership.poll_begin`) and they send
    the list (the ``hash_lists`` event names them, and moves the run's stamp). Peers that sent
    lists (older peers, or asked before) need nothing more."""
    full = [p for p in ready if s.peers[p].hashes is not None]
    if len(full) == len(ready):
        return False
    wanted = lists_wanted(ready, voters, digests(s, ready), full)
    for pid in wanted:
        s.peers[pid].digest = None
    if wanted:
        why = "the ready peers' state digests differ: their full lists decide the vote"
        s.note(now, "hash_lists", peers=wanted[:NAMED], count=len(wanted), reason=why)
    return bool(wanted)


def form(s: RunState, now: float, ready: list[int], voters: list[int], checked: bool) -> None:
    """Start the round of ``ready`` (``voters`` decide its state; ``checked``: with a parity
    check of the hashes they sent): the phase becomes ``RUNNING`` with its plan."""
    taking_part = set(ready)
    for pid in s.members:
        # only a quiet or isolated member is left out alive (isolation has its own event)
        if pid not in taking_part and s.is_active(pid) and s.peers[pid].isolated is None:
            p = s.peers[pid]
            s.note(
                now,
                "quiet",
                peer=pid,
                name=p.name,
                reason=f"left out of round {s.revision}: silent for {now - p.last_seen:.1f}s",
            )
    if not s.started:
        s.revision = s.peers[voters[0]].revision or 0
    transfers: list[Transfer] = []
    expected: dict[str, str] = {}
    if checked:
        lists = {pid: s.peers[pid].hashes for pid in ready if s.peers[pid].hashes is not None}
        s.counters["parity_checks"] += 1
        if len(lists) < len(ready) and len(set(digests(s, ready).values())) == 1:
            # every ready peer holds the same state (one digest): nothing to vote or repair
            s.canonical = next(iter(lists.values()), None)
            wrong_by_peer = {}
        else:
            if len(lists) < len(ready):
                lists = lists_from_digests(ready, digests(s, ready), lists)
            hashes = {pid: lists.get(pid) or {} for pid in ready}
            names = [t.name for t in s.schema or []]
            s.canonical = canonical(names, voters, hashes)
            transfers, wrong_by_peer = repairs(s.canonical, ready, voters, hashes)
        for pid, wrong in wrong_by_peer.items():
            if pid in voters and s.started:
                s.counters["parity_failures"] += 1
                s.note(now, "parity_failure", peer=pid, tensors=list(wrong)[:20])
            s.counters["resyncs"] += 1
            expected.update({n: s.canonical[n] for n in wrong})  # type: ignore[index]
    # in_sync: holds the canonical state of the run's revision. Repaired peers become in sync
    # only when the round commits (the transfer might not complete).
    dsts = {t.dst for t in transfers}
    stale = tuple(p for p in ready if s.peers[p].uncounted and p not in dsts)
    voting = set(voters)
    for pid in ready:
        s.peers[pid].in_sync = pid in voting and pid not in dsts
        if pid in dsts:
            s.peers[pid].uncounted = True  # until this round commits
    # ranks follow names, then ids (registration order is a race): a restarted or resumed
    # peer gets its rank, shard and slot back; ring order when peers report links (ring.py)
    members = ring_members(ready, s.peers)
    new_epoch = s.phase.new_epoch_due or members != s.members
    if new_epoch:
        s.epoch += 1
        s.note(now, "epoch", epoch=s.epoch, members=list(members), world=len(members))
    s.members = members
    plan = RoundPlan(
        round=s.revision,
        epoch=s.epoch,
        members=members,
        transfers=tuple(transfers),
        expected=expected,
        new_epoch=new_epoch,
        stale=stale,
        reach=plan_reach(s, members) or None,
    )
    nonces = {pid: s.peers[pid].ready_nonce or "" for pid in members}
    s.phase.to(Phase.RUNNING, Round(plan, now, nonces))
    for pid in members:
        s.peers[pid].ready_nonce = None
        s.peers[pid].hashes = s.peers[pid].digest = None
    if transfers:
        s.note(now, "resync", transfers=[t.to_json() for t in transfers])
