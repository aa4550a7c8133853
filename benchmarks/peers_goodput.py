"""Goodput under failures for ``benchmarks/peers.py --goodput``: the failure schedule and the
figures, as pure functions (nothing here touches a process, a network or a file).

The run is shaped like torchft's public fault-tolerance run (a failure every 60 s at 11 s steps:
about one failure per 6 step times): a SIGKILL of a random peer at a fixed mean interval, the peer
started again a fixed time later. What is reported, the same way for every system:

* **committed fraction**: synchronizations committed over synchronizations attempted. isthmus:
  the coordinator's ``commit`` events over ``commit`` + ``abort`` (an aborted round is retried as
  another round); torchft: the ``commit`` records of a replica group that is never killed (peer
  0), ``should_commit()`` True over all its decisions (a step whose collective failed is retried
  at the same step). A failure seen by every member costs the same one attempt in both.
* **theoretical fraction**: what is left when every failure costs exactly one attempt and nothing
  else: ``1 - failures / attempts`` of the run itself, and the nominal ``1 - step / interval``
  (torchft's 83.3% is ``1 - 1/6``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A SIGKILL of peer ``peer`` at ``at_s`` seconds after the start, started again at
    ``back_s``."""

    at_s: float
    peer: int
    back_s: float


def failure_schedule(
    *,
    every_s: float,
    restart_after_s: float,
    until_s: float,
    peers: int,
    seed: int,
    poisson: bool = False,
    spare: Sequence[int] = (0,),
) -> list[Failure]:
    """Failures in time order, one every ``every_s`` seconds (``poisson``: exponential gaps of
    that mean) up to ``until_s``, each of a peer drawn uniformly from those that are running and
    not in ``spare`` (peer 0 is spared: it hosts hivemind's bootstrap node and is torchft's
    observer). A moment at which no such peer runs (all are still down) is skipped. The same seed
    gives the same schedule. Raises ValueError for a non-positive interval or restart delay, or
    when no peer may fail."""
    if not (math.isfinite(every_s) and every_s > 0):
        raise ValueError(f"every_s must be a positive number of seconds, got {every_s!r}")
    if not (math.isfinite(restart_after_s) and restart_after_s > 0):
        raise ValueError(f"restart_after_s must be positive, got {restart_after_s!r}")
    candidates = [p for p in range(peers) if p not in spare]
    if not candidates:
        raise ValueError(f"no peer may fail: {peers} peers, spared {list(spare)}")
    rng = random.Random(seed)
    back: dict[int, float] = {}
    out: list[Failure] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / every_s) if poisson else every_s
        if t >= until_s:
            return out
        up = [p for p in candidates if back.get(p, -1.0) <= t]
        if not up:
            continue
        victim = rng.choice(up)
        back[victim] = t + restart_after_s
        out.append(Failure(at_s=round(t, 6), peer=victim, back_s=round(t + restart_after_s, 6)))


def committed_fraction(committed: int, attempted: int) -> float | None:
    """``committed / attempted``, or None when nothing was attempted. Raises ValueError when
    more committed than were attempted (the counts are of two different things)."""
    if committed < 0 or attempted < committed:
        raise ValueError(f"committed {committed} of {attempted} attempted: impossible counts")
    return committed / attempted if attempted else None


def theoretical_fraction(attempted: int, failures: int) -> float | None:
    """The fraction left when each failure costs exactly one of ``attempted`` attempts:
    ``1 - failures / attempted`` (never below 0); None when nothing was attempted."""
    if attempted <= 0:
        return None
    return max(0.0, 1.0 - failures / attempted)


def nominal_fraction(step_s: float, every_s: float) -> float:
    """The theoretical fraction of a failure every ``every_s`` seconds at ``step_s`` per step,
    one step lost per failure: ``1 - step_s / every_s`` (never below 0)."""
    if step_s <= 0 or every_s <= 0:
        raise ValueError(f"step_s and every_s must be positive, got {step_s}, {every_s}")
    return max(0.0, 1.0 - step_s / every_s)


def isthmus_attempts(events: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(committed, attempted)`` rounds from isthmus's coordinator events: ``commit`` events,
    and ``commit`` plus ``abort`` events."""
    kinds = [e.get("kind") for e in events]
    committed = kinds.count("commit")
    return committed, committed + kinds.count("abort")


def torchft_attempts(records: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(committed, attempted)`` from one torchft replica group's ``commit`` records (its
    ``should_commit()`` decisions: ``ok`` True, and all of them)."""
    decisions = [bool(r.get("ok")) for r in records if r.get("kind") == "commit"]
    return sum(decisions), len(decisions)


def step_time(wall_s: float, attempted: int) -> float | None:
    """Seconds per attempted synchronization of a run (its wall-clock over its attempts), or
    None when nothing was attempted."""
    return wall_s / attempted if attempted > 0 and wall_s > 0 else None


def goodput_row(committed: int, attempted: int, kills: int) -> dict[str, Any]:
    """The goodput fields of a result row: the counts, the committed fraction and the
    theoretical one (rounded to 4 digits; None where nothing was attempted)."""
    frac = committed_fraction(committed, attempted)
    theory = theoretical_fraction(attempted, kills)
    return {
        "syncs_committed": committed,
        "syncs_attempted": attempted,
        "kills": kills,
        "committed_fraction": None if frac is None else round(frac, 4),
        "theoretical_fraction": None if theory is None else round(theory, 4),
    }


def time_fraction(quiet_wall_s: float | None, wall_s: float | None) -> float | None:
    """The wall-clock goodput of a run under failures: the same budget's wall-clock without
    failures over its wall-clock with them (1.0: the failures cost no time); None when either
    is unknown or not positive."""
    if not quiet_wall_s or not wall_s or quiet_wall_s <= 0 or wall_s <= 0:
        return None
    return quiet_wall_s / wall_s


def starters(records: Mapping[str, Any]) -> dict[str, Any]:
    """The records of the processes that started the run (``peer<i>``), without those of
    restarted ones (``peer<i>.<n>``, ``peer<i>.r<n>``): a restarted process numbers its steps
    from where it resumed or from 0, and its points would put late evals at early steps of the
    curve. Peer 0, never killed, covers the whole run."""
    return {k: v for k, v in records.items() if "." not in k}
