"""Members that cannot reach each other: the membership's side of the partition rule.

Peers report whom they could not reach (:class:`~.protocol.Unreached`, with a failed round) and
what their probes found (:class:`~.protocol.ProbeOutcome`, on heartbeats); these functions feed
them into the run's :class:`~.partition.Reachability` (members named by peer name), decide who
sits out when a round forms, and ask for the probes that tell when a pair is up again. Functions
of a :class:`~.state.RunState`; pure like it (times are passed in).

* A member left out is *isolated*: it stays registered and heartbeating, its begin is answered
  ``wait`` with the reason (``isolated: cannot reach peer2 at 10.0.0.4:41234 (refused)``), and
  ``/v1/status``, the events (``isolated``, ``readmitted``) and the counters show it.
* While a pair is down, the kept end (the more senior one when both are kept or both out) is
  pushed a ``probe`` of the other's probe listener every ``PartitionConfig.probe_every_s``;
  between two islands that sent their ranks' listeners (``info.rank_probes``) the push
  carries the other island's, and the island probes rank to rank (``comm/island_probe.py``).
* When the pair is up again the member is kept in the next round; it joins as a peer that missed
  commits and is resynced like any stale peer.
"""

from __future__ import annotations

from collections.abc import Iterable

from isthmus.coordinator.partition import FailureReport, How, ProbeResult
from isthmus.coordinator.peers import Peer, PeerState
from isthmus.coordinator.protocol import ProbeOutcome, ProbePush, Unreached
from isthmus.coordinator.state import RunState
from isthmus.coordinator.wire import encode

__all__ = [
    "NO_ADDRESS",
    "ask_probes",
    "plan_reach",
    "probed",
    "rank_listeners",
    "seniority",
    "sit_out",
    "stalled",
    "unreached",
]

NO_ADDRESS = "no known address"
"""Where a pair's reason (``isolated: cannot reach peer1 at ...``) says the member was not
reached when the coordinator knows no probe listener of it."""


def rank_listeners(p: Peer) -> tuple[str, ...] | None:
    """The probe listener of every local rank of island ``p`` (``info.rank_probes``, sent at
    registration, rank 0 first; heartbeats never carry the key, so it stays), or None: not an
    island, an island of an earlier release, or a list that is not one well-formed
    ``host:port`` per rank (it would break every plan that carried it)."""
    island = p.info.get("island")
    if not isinstance(island, dict):
        return None
    probes, size = p.info.get("rank_probes"), island.get("size")
    if not isinstance(probes, list) or not isinstance(size, int) or len(probes) != size:
        return None
    for a in probes:
        if not isinstance(a, str):
            return None
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(a) > 300:
            return None
    return tuple(probes)


def plan_reach(s: RunState, members: Iterable[int]) -> dict[str, str]:
    """A round plan's ``reach``: each member's probe listener under its peer id, and an
    island's followers' under ``<peer id>.<local rank>``."""
    out: dict[str, str] = {}
    for pid in members:
        p = s.peers[pid]
        if (a := p.probe_address) is not None:
            out[str(pid)] = a
        for r, a in enumerate(rank_listeners(p) or ()):
            if r:
                out[f"{pid}.{r}"] = a
    return out


def unreached(s: RunState, reporter: Peer, entries: Iterable[Unreached], now: float) -> None:
    """``reporter`` could not reach these members: each pair is down from ``now`` (an entry
    naming an unknown or inactive peer, or the reporter itself, is ignored)."""
    for u in entries:
        remote = s.roster.active(u.peer)
        if remote is None or remote.id == reporter.id:
            continue
        _down(s, reporter, remote, u.address, How(u.how), now)


def stalled(s: RunState, sender: Peer, receiver: Peer, address: str | None, now: float) -> None:
    """``sender``'s data to ``receiver`` has gone unacknowledged past the stall rule (the link
    between them is cut): the pair is down from ``now``, as a failure report of ``sender``'s
    naming ``receiver`` (``stalled``, at its probe listener ``address``) marks it. Without a
    listener (``address`` None: a peer whose listener could not bind, or of an earlier release)
    the pair is down all the same, or the next round would form it again and lose another
    ``stall_s`` to the same cut; its reason then says :data:`NO_ADDRESS`, and
    :func:`ask_probes` asks ``receiver`` to probe ``sender``'s listener instead. Ignored when
    either end is no longer active."""
    if s.roster.active(sender.id) is None or s.roster.active(receiver.id) is None:
        return
    _down(s, sender, receiver, address, How.STALLED, now)


def _down(
    s: RunState, reporter: Peer, remote: Peer, address: str | None, how: How, now: float
) -> None:
    where = NO_ADDRESS if address is None else address
    s.reach.report(FailureReport(reporter.name, remote.name, where, how, now))
    s.note(
        now,
        "unreachable",
        peer=reporter.id,
        name=reporter.name,
        remote=remote.id,
        remote_name=remote.name,
        address=address,
        how=how.value,
    )


def probed(s: RunState, prober: Peer, outcomes: Iterable[ProbeOutcome], now: float) -> bool:
    """Record probes ``prober`` made; True if any was recorded."""
    any_ = False
    for o in outcomes:
        remote = s.roster.active(o.peer)
        if remote is None or remote.id == prober.id:
            continue
        s.reach.probe(ProbeResult(prober.name, remote.name, o.ok, now))
        any_ = True
    return any_


def seniority(s: RunState, ids: Iterable[int]) -> list[int]:
    """``ids`` from the longest-serving down: peers in sync at the run's revision first, then
    by registration."""

    def key(i: int) -> tuple[bool, float, int]:
        p = s.peers[i]
        return (not (p.in_sync and p.revision == s.revision), p.registered_at, i)

    return sorted(ids, key=key)


def sit_out(s: RunState, ready: list[int], now: float) -> list[int]:
    """Those of ``ready`` that take part in the next round: of the ready peers and the live
    members of the last epoch (who are expected to begin), the largest set whose pairs are all
    up (:meth:`~.partition.Reachability.decide`). The others are marked isolated (an event and
    a counter the first time, with the reason); isolated peers that are kept again are
    readmitted (an event). Deciding over the expected members too keeps the answer the same
    while members begin one by one. With no pair known down and nobody ever isolated, that
    set is everyone: ``ready`` is returned without a look at the others."""
    if s.reach.empty and not s.counters["isolations"]:
        return ready
    candidates = sorted(set(ready) | set(s.expected()))
    names = {s.peers[i].name: i for i in candidates}
    if len(names) != len(candidates):  # two peers share a name: the picture cannot tell them
        return ready
    voters = s.voters(candidates)
    d = s.reach.decide(
        list(names),
        seniority=[s.peers[i].name for i in seniority(s, candidates)],
        holders=[s.peers[i].name for i in voters],
        now=now,
    )
    for a, b in d.trials:
        s.note(now, "trial", pair=[a, b], reason="probes kept failing; trying the pair again")
    for name, why in d.out.items():
        p = s.peers[names[name]]
        if p.isolated != why:
            if p.isolated is None:
                s.counters["isolations"] += 1
            p.isolated = why
            s.note(now, "isolated", peer=p.id, name=p.name, reason=why)
    kept = [names[n] for n in d.keep]
    for pid in kept:
        p = s.peers[pid]
        if p.isolated is not None:
            p.isolated = None
            s.counters["readmissions"] += 1
            s.note(now, "readmitted", peer=pid, name=p.name, reason="probes connect again")
    keep = set(kept)
    return [pid for pid in ready if pid in keep]


def ask_probes(s: RunState, now: float) -> None:
    """Queue a ``probe`` push for each down pair due one (at most one per pair every
    ``probe_every_s``): to the kept end, of the other end's probe listener, or the other way
    round where only the kept end has a listener (a probe connects either way; with neither, the
    pair waits for its trial, ``PartitionConfig.trial_after_s``). Between two islands that both
    sent their ranks' listeners (:func:`rank_listeners`) the push carries the target's, so
    that the prober checks the paths between its ranks and the target's, not only the
    leaders'."""
    if s.reach.empty:
        return  # no pair is down: nothing to probe (and no need to list the peers)
    every = s.config.partition.probe_every_s
    for a, b in s.reach.probes_due(s.active_names(), now):
        pa, pb = s.by_name(a), s.by_name(b)
        if pa is None or pb is None:
            continue
        if now - s.probe_asked.get((a, b), float("-inf")) < every:
            continue
        # the kept end probes; between two of the same kind, the more senior one
        order = seniority(s, [pa.id, pb.id])
        ends = sorted(order, key=lambda i: s.peers[i].isolated is not None)
        prober, target = s.peers[ends[0]], s.peers[ends[1]]
        if target.probe_address is None:  # no listener there: the other end's, if it has one
            prober, target = target, prober
        address = target.probe_address
        if address is None or prober.state is not PeerState.ACTIVE:
            continue
        s.probe_asked[(a, b)] = now
        ranks = rank_listeners(target) if rank_listeners(prober) is not None else None
        msg = encode(ProbePush(peer=target.id, address=address, ranks=ranks))
        s.record.push((prober.id,), msg)
