"""Parity as pure functions: who votes on the state of a round, the canonical state by majority
vote, and who must be repaired from whom. :class:`~isthmus.coordinator.membership.Membership`
calls these when a round forms; :func:`canonical` and :func:`repairs` see only the peers' hashes
(peer id -> tensor name -> hash)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from isthmus.coordinator.peers import Peer
from isthmus.coordinator.protocol import Transfer

__all__ = ["Hashes", "canonical", "repairs", "voters"]

Hashes = Mapping[int, Mapping[str, str]]
"""Each peer's per-tensor hashes."""


def voters(
    ready: Sequence[int],
    peers: Mapping[int, Peer],
    *,
    started: bool,
    revision: int,
    restore_revision: int | None,
    expected: Sequence[int],
) -> list[int]:
    """The ready peers whose state counts in the majority vote.

    Before the run's first round (``started`` false) everyone holds an initial state, and peers
    resuming from a checkpoint may be ahead: the highest revision present votes, unless a
    checkpoint of a later revision (``restore_revision``) is to be loaded first (then nobody
    votes yet). Afterwards the voters are the peers in sync at the run's ``revision``; when no
    such peer is ready and none of the ``expected`` members is in sync either (every in-sync peer
    is gone), the peers holding exactly that revision vote on its state.
    """
    if not started:
        top = max((peers[p].revision or 0) for p in ready)
        if restore_revision is not None and top < restore_revision:
            return []
        return [p for p in ready if (peers[p].revision or 0) == top]
    chosen = [p for p in ready if peers[p].in_sync and peers[p].revision == revision]
    if not chosen and not any(peers[m].in_sync for m in expected):
        chosen = [p for p in ready if peers[p].revision == revision]
    return chosen


def canonical(names: Sequence[str], voters: Sequence[int], hashes: Hashes) -> dict[str, str]:
    """Per tensor, the hash most voters hold; ties go to the voter with the lowest id (the
    longest-standing member). With two voters that disagree the direction of repair is
    therefore arbitrary but deterministic: both copies look equally valid. A tensor no voter
    reported is left out."""
    out: dict[str, str] = {}
    rows = [hashes.get(v, {}) for v in sorted(voters)]  # by id: the first winner breaks a tie
    for n in names:
        column = [row.get(n) for row in rows]
        votes = Counter(column)
        best = max(votes.values())
        h = next((h for h in column if h is not None and votes[h] == best), None)
        if h is not None:
            out[n] = h
    return out


def repairs(
    target: Mapping[str, str], ready: Sequence[int], voters: Sequence[int], hashes: Hashes
) -> tuple[list[Transfer], dict[int, tuple[str, ...]]]:
    """Transfers that bring every ready peer to ``target``, and per peer the tensors it lacks.

    A peer with a wrong tensor receives it from a voter holding all of ``target`` (spread over
    them in turn), or, when no voter holds all of it, each tensor from a voter that has it.
    """
    whole = dict(target)
    sources = [v for v in voters if dict(hashes.get(v, {})) == whole]
    transfers: list[Transfer] = []
    wrong_by_peer: dict[int, tuple[str, ...]] = {}
    k = 0
    for pid in ready:
        have = hashes.get(pid, {})
        if have == whole:  # the common case, one comparison in C rather than one per tensor
            continue
        wrong = tuple(n for n, h in target.items() if have.get(n) != h)
        if not wrong:
            continue
        wrong_by_peer[pid] = wrong
        if sources:
            transfers.append(Transfer(sources[k % len(sources)], pid, wrong))
            k += 1
            continue
        by_src: dict[int, list[str]] = {}
        for n in wrong:
            src = next(v for v in voters if hashes.get(v, {}).get(n) == target[n])
            by_src.setdefault(src, []).append(n)
        transfers.extend(Transfer(s, pid, tuple(ns)) for s, ns in sorted(by_src.items()))
    return transfers, wrong_by_peer
