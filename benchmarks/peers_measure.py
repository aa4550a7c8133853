"""The figures of ``benchmarks/peers.py``, as pure functions of what the runs recorded.

Every system's run is reduced to the same few lists of wall-clock times, so that one definition
serves all of them:

* **eval curve**: the mean eval loss over peers at each eval step, at the time the last peer
  recorded it, counted from the run's ``t0`` (:func:`eval_curve`); **time to a target** is the
  first point of the curve at or below it (:func:`time_to_target`).
* **kill -> next commit**: from the SIGKILL to the first synchronization committed among the
  survivors after it (:func:`first_after`), where "committed" is each system's own notion:
  isthmus's ``commit`` event, torchft's ``should_commit() == True``, hivemind's successful
  averaging round (:func:`hivemind_events`; an epoch that proceeded with local gradients is not
  one). Counted twice: the first commit of any kind (torchft can still commit a step whose
  all-reduce finished before the kill), and the first one **without** the killed peer (a group
  smaller than before: ``fewer_than``), the time the survivors took to go on without it.
* **join -> first contribution**: from starting the joiner's process to the first committed
  synchronization that holds its update: isthmus's first commit in an epoch whose members include
  it (:func:`isthmus_join_commit`), torchft's first commit in which it was participating, hivemind's
  first averaging round it took part in.

Records are dicts as the workers wrote them (``peers_common``) or as isthmus's run directory
holds them; nothing here touches a network or a file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_HIVEMIND = (
    (re.compile(r"^Averaged gradients with (\d+) peers"), "averaged", "gradients"),
    (re.compile(r"^Averaged parameters with (\d+) peers"), "averaged", "parameters"),
    (re.compile(r"^Averaging gradients failed"), "failed", "gradients"),
    (re.compile(r"^Averaging failed with"), "failed", "parameters"),
    (re.compile(r"^Proceeding with local gradients"), "local", "gradients"),
    (re.compile(r"^Skipped averaging"), "local", "gradients"),
    (re.compile(r"^Transitioning to epoch (\d+)"), "epoch", None),
    (re.compile(r"^Peer is out of sync"), "out_of_sync", None),
    (re.compile(r"^Catching up with collaboration step (\d+)"), "caught_up", None),
)


def hivemind_events(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """hivemind's log lines (``log`` records) as events, in order: ``{ts, kind, what, n}`` with
    kind ``averaged`` (``n`` peers in the group), ``failed``, ``local`` (went on with its own
    gradients), ``epoch`` (``n`` the new epoch), ``out_of_sync`` or ``caught_up``. Lines of
    another shape are skipped."""
    out = []
    for r in records:
        if r.get("kind") != "log":
            continue
        msg = str(r.get("msg", ""))
        for pattern, kind, what in _HIVEMIND:
            m = pattern.match(msg)
            if m:
                n = int(m.group(1)) if m.groups() else None
                out.append({"ts": float(r["ts"]), "kind": kind, "what": what, "n": n})
                break
    return out


def hivemind_commits(
    records: Iterable[Mapping[str, Any]], what: str, *, fewer_than: int | None = None
) -> list[float]:
    """Times of the successful averaging rounds (``what``: ``gradients`` or ``parameters``)
    with at least one other peer; with ``fewer_than``, only rounds of a smaller group."""
    return [
        e["ts"]
        for e in hivemind_events(records)
        if e["kind"] == "averaged"
        and e["what"] == what
        and (e["n"] or 0) >= 2
        and (fewer_than is None or e["n"] < fewer_than)
    ]


def torchft_commits(
    records: Iterable[Mapping[str, Any]],
    *,
    participating: bool = False,
    fewer_than: int | None = None,
) -> list[float]:
    """Times of torchft's committed synchronizations (``should_commit`` returned True); with
    ``participating``, only those in which this replica contributed; with ``fewer_than``, only
    those of a quorum with fewer participants."""
    return [
        float(r["ts"])
        for r in records
        if r.get("kind") == "commit"
        and r.get("ok")
        and (r.get("participating") or not participating)
        and (fewer_than is None or int(r.get("participants", 0)) < fewer_than)
    ]


def isthmus_commits(
    events: Iterable[Mapping[str, Any]], *, fewer_than: int | None = None
) -> list[float]:
    """Times of isthmus's ``commit`` events; with ``fewer_than``, only those of a round with
    fewer members."""
    return [
        float(e["ts"])
        for e in events
        if e.get("kind") == "commit" and (fewer_than is None or int(e["world"]) < fewer_than)
    ]


def first_after(t: float, times: Iterable[float]) -> float | None:
    """Seconds from ``t`` to the first of ``times`` after it, or None if there is none."""
    later = [x for x in times if x > t]
    return round(min(later) - t, 3) if later else None


def isthmus_join_commit(events: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """The time of the first commit in an epoch whose members include the process ``name``
    (its id from its ``register`` event), from isthmus's coordinator events; None if it never
    took part in a committed round."""
    ids = [e["peer"] for e in events if e.get("kind") == "register" and e.get("name") == name]
    if not ids:
        return None
    pid = ids[-1]
    epochs = {
        e["epoch"] for e in events if e.get("kind") == "epoch" and pid in e.get("members", [])
    }
    commits = [
        float(e["ts"]) for e in events if e.get("kind") == "commit" and e.get("epoch") in epochs
    ]
    return min(commits) if commits else None


def eval_curve(
    records: Mapping[str, Sequence[Mapping[str, Any]]], t0: float
) -> list[tuple[int, float, float]]:
    """``(step, seconds since t0, mean eval loss)`` at each step where a peer recorded an eval
    loss (records without a step, such as a final eval, are not points of the curve): the mean over the peers that did, at the time of the last of them. Non-finite losses
    (a diverged peer) are left out of the mean; a step where every loss is non-finite is left
    out."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for recs in records.values():
        for r in recs:
            loss = r.get("eval_loss")
            if loss is None or "step" not in r or not math.isfinite(float(loss)):
                continue
            by_step.setdefault(int(r["step"]), []).append((float(loss), float(r["ts"])))
    return [
        (
            step,
            round(max(ts for _, ts in vals) - t0, 3),
            round(sum(v for v, _ in vals) / len(vals), 5),
        )
        for step, vals in sorted(by_step.items())
    ]


def time_to_target(curve: Sequence[Sequence[float]], target: float) -> tuple[float, int] | None:
    """``(seconds, step)`` of the first point of ``curve`` at or below ``target``, or None."""
    for step, t, loss in curve:
        if loss <= target:
            return float(t), int(step)
    return None


def loosest_best(curves: Iterable[Sequence[Sequence[float]]]) -> float | None:
    """The highest of the curves' lowest losses: the tightest target every curve reaches."""
    bests = [min(c[2] for c in curve) for curve in curves if curve]
    return max(bests) if bests else None


def wire_tx(
    before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]
) -> dict[str, int]:
    """Bytes each node's link sent between two counter snapshots (``{node: {tx_bytes: ...}}``).
    Raises ValueError for a counter that went backwards (the interface was recreated)."""
    out = {}
    for node, b in after.items():
        if node not in before:
            continue
        d = int(b["tx_bytes"]) - int(before[node]["tx_bytes"])
        if d < 0:
            raise ValueError(f"{node}: tx_bytes went backwards; the snapshots are of two networks")
        out[node] = d
    return out


def start_time(records: Mapping[str, Sequence[Mapping[str, Any]]], names: Iterable[str]) -> float:
    """``t0`` of a foreign run: when the last of the starting peers passed the start barrier
    (its ``start`` record), as isthmus's ``t0`` is its first round, formed once every starting
    peer registered. Raises ValueError naming the peers that never started."""
    names = list(names)
    starts = {
        n: [float(r["ts"]) for r in records.get(n, ()) if r.get("kind") == "start"] for n in names
    }
    missing = [n for n, ts in starts.items() if not ts]
    if missing:
        raise ValueError(f"no start record from {', '.join(missing)}: they never trained")
    return max(ts[0] for ts in starts.values())
