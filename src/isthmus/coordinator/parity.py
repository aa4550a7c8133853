"""Parity as pure functions: the canonical state of a round by majority vote, and who must be
repaired from whom. :class:`~isthmus.coordinator.membership.Membership` calls these when a round
forms with hashes; they see only the peers' hashes (peer id -> tensor name -> hash)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from isthmus.coordinator.protocol import Transfer

__all__ = ["Hashes", "canonical", "repairs"]

Hashes = Mapping[int, Mapping[str, str]]
"""Each peer's per-tensor hashes."""


def canonical(names: Sequence[str], voters: Sequence[int], hashes: Hashes) -> dict[str, str]:
    """Per tensor, the hash most voters hold; ties go to the voter with the lowest id (the
    longest-standing member). With two voters that disagree the direction of repair is
    therefore arbitrary but deterministic: both copies look equally valid. A tensor no voter
    reported is left out."""
    out: dict[str, str] = {}
    for n in names:
        votes = Counter(hashes.get(v, {}).get(n) for v in voters)
        best = max(votes.values())
        winners = {h for h, c in votes.items() if c == best}
        for v in sorted(voters):
            h = hashes.get(v, {}).get(n)
            if h in winners and h is not None:
                out[n] = h
                break
    return out


def repairs(
    target: Mapping[str, str], ready: Sequence[int], voters: Sequence[int], hashes: Hashes
) -> tuple[list[Transfer], dict[int, tuple[str, ...]]]:
    """Transfers that bring every ready peer to ``target``, and per peer the tensors it lacks.

    A peer with a wrong tensor receives it from a voter holding all of ``target`` (spread over
    them in turn), or, when no voter holds all of it, each tensor from a voter that has it.
    """
    sources = [v for v in voters if dict(hashes.get(v, {})) == dict(target)]
    transfers: list[Transfer] = []
    wrong_by_peer: dict[int, tuple[str, ...]] = {}
    k = 0
    for pid in ready:
        have = hashes.get(pid, {})
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
