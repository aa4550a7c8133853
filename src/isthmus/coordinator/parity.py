"""Parity as pure functions: who votes on the state of a round, the canonical state by majority
vote, and who must be repaired from whom. :class:`~isthmus.coordinator.membership.Membership`
calls these when a round forms; :func:`canonical` and :func:`repairs` see only the peers' hashes
(peer id -> tensor name -> hash). :func:`state_digest` folds one peer's hashes into one value,
which a begin may carry instead of the list (:data:`~.protocol.HASH_DIGEST`), and
:func:`lists_wanted` says whose full lists a vote over such digests still needs.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from isthmus.coordinator.peers import Peer
from isthmus.coordinator.protocol import Transfer

__all__ = [
    "Hashes",
    "canonical",
    "lists_from_digests",
    "lists_wanted",
    "repairs",
    "state_digest",
    "voters",
]

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


def state_digest(hashes: Mapping[str, str]) -> str:
    """One value for a peer's whole list of hashes: BLAKE2b (16 bytes, as 32 hex digits) over
    every ``(name, hash)`` pair in name order, each part as its UTF-8 bytes after their length
    (4 bytes, big-endian). Two lists have the same digest exactly when they name the same
    tensors with the same hashes (in any order), short of a collision of BLAKE2b."""
    h = hashlib.blake2b(digest_size=16)
    for name, value in sorted(hashes.items()):
        for part in (name.encode(), value.encode()):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    return h.hexdigest()


def lists_wanted(
    ready: Sequence[int], voters: Sequence[int], digests: Mapping[int, str], full: Iterable[int]
) -> list[int]:
    """The ready peers whose full lists a parity check still needs when ``digests`` (peer id ->
    :func:`state_digest` of its state, for every ready peer) are known and ``full`` hold their
    lists too; empty when the check can be planned exactly as over every list:

    * every ready peer has the same digest: they all hold one state, which is the canonical
      one, and nobody is repaired (no list is needed at all);
    * else, when more than half of the ``voters`` share one digest (the majority state: it
      wins every tensor's vote, as :func:`canonical` counts them), the lists of the peers that
      differ from it, and one list of that state (the lowest voter id holding it) unless a
      peer holding it already sent one: the others holding it have that same list;
    * else (no majority state), every ready peer's list (the vote is per tensor).
    """
    have = set(full)
    first = digests[ready[0]] if ready else None
    if all(digests[p] == first for p in ready):
        return []
    counts = Counter(digests[v] for v in voters)
    top, n = counts.most_common(1)[0] if counts else ("", 0)
    if 2 * n <= len(voters):
        return [p for p in ready if p not in have]
    wanted = [p for p in ready if digests[p] != top and p not in have]
    holders = [p for p in ready if digests[p] == top]
    if not any(p in have for p in holders):
        wanted.append(min(v for v in voters if digests[v] == top))
    return sorted(wanted)


def lists_from_digests(
    ready: Sequence[int], digests: Mapping[int, str], lists: Mapping[int, Mapping[str, str]]
) -> dict[int, Mapping[str, str]]:
    """Every ready peer's list for :func:`canonical` and :func:`repairs`: its own where it
    sent one, else that of a peer with the same digest (the same state). A peer with neither
    is left out (it then counts as holding no tensor)."""
    by_digest: dict[str, Mapping[str, str]] = {}
    for p, row in lists.items():
        by_digest.setdefault(digests[p], row)
    out: dict[int, Mapping[str, str]] = {}
    for p in ready:
        row = lists.get(p)
        if row is None:
            row = by_digest.get(digests[p])
        if row is not None:
            out[p] = row
    return out
