"""What the dashboard and ``/metrics`` show beyond ``/v1/status``: a run's recent history.

:class:`RunView` is pure (no sockets, no clock of its own, like :mod:`..membership`): the
dashboard's watcher feeds it the world size, the round that is running and the new membership
events each time the coordinator changes, and the peers' heartbeat info about once a second; it
keeps

* the world size over time (a point per change),
* each peer's loss over time and its steps per second (from the ``step`` and ``loss`` its
  session reports with heartbeats),
* how long each round took from formation to commit or abort, and the recent aborts with their
  reasons,
* stragglers: per peer, how many rounds it was the last member to begin and how long the others
  waited for it,
* the recent events other than commits (joins, evictions, epochs, aborts, resyncs, parity
  failures, checkpoints): with data parallel, commits come so often that they would push them
  out of any list of recent events; commits are counted instead.

Every series is bounded: past its cap it keeps every other point (the whole run, coarser), so a
week-long run costs what a ten-minute one does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerTrack", "RunView"]

SERIES_CAP = 600
"""Points kept per series before it is thinned to every other point."""
RATE_WINDOW_S = 10.0
"""Steps per second are measured over this much recent time."""
STALE_S = 5.0
"""A peer that reported no new step for this long trains at 0 steps per second."""


def _append_capped(series: list[list[float]], point: list[float], cap: int = SERIES_CAP) -> None:
    series.append(point)
    if len(series) > cap:
        # keep the first and the latest point so the chart still spans the whole run
        last = series[-1]
        series[:] = [*series[:-1:2], last]


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass
class PeerTrack:
    """What the view remembers of one peer (by name)."""

    steps: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, step) each time the reported step changed, over the last RATE_WINDOW_S."""
    loss: list[list[float]] = field(default_factory=list)
    """[time, loss] each time the reported loss changed."""
    last_step_at: float | None = None
    straggled: int = 0
    """Rounds this peer was the last member to begin (with others waiting for it)."""
    straggle_s: float = 0.0
    """Time the other members waited for it at those rounds, in total."""

    def steps_per_s(self, now: float) -> float | None:
        """Recent training speed; None before two distinct steps were seen."""
        if self.last_step_at is not None and now - self.last_step_at > STALE_S:
            return 0.0
        if len(self.steps) < 2:
            return None
        (t0, s0), (t1, s1) = self.steps[0], self.steps[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class RunView:
    """The history of one run as the coordinator saw it (see the module docstring)."""

    def __init__(self, *, max_aborts: int = 50, max_events: int = 60) -> None:
        self.world: list[list[float]] = []
        self.peers: dict[str, PeerTrack] = {}
        self.aborts: deque[dict[str, Any]] = deque(maxlen=max_aborts)
        self.recent: deque[dict[str, Any]] = deque(maxlen=max_events)
        """The latest events that are not commits, as rows for the dashboard's list."""
        self.durations: list[list[float]] = []
        """[time, seconds, 1 if committed else 0] per finished round."""
        self._formed: dict[tuple[int, int], float] = {}
        self._last_world: int | None = None

    def track(self, name: str) -> PeerTrack:
        return self.peers.setdefault(name, PeerTrack())

    # -- fed by the watcher ---------------------------------------------------------------------
    def update(
        self,
        now: float,
        *,
        world: int,
        running: tuple[int, int, float] | None,
        ready_since: Iterable[tuple[str, float | None]] = (),
        events: Iterable[dict[str, Any]] = (),
    ) -> list[tuple[str, float]]:
        """Record the coordinator's state after a change.

        ``running`` is the round being run (epoch, round, when it formed) or None;
        ``ready_since`` the members of that round with the time each began it (only read when
        the round is new: the last to begin was the straggler); ``events`` the membership
        events since the last call. Returns (outcome, seconds) for every round that finished
        and whose formation was seen, for the duration histogram.
        """
        # nothing to draw before the first epoch: the chart starts where the run does
        if world != self._last_world and (world or self.world):
            _append_capped(self.world, [round(now, 3), float(world)])
            self._last_world = world
        if running is not None:
            epoch, rnd, formed = running
            if (epoch, rnd) not in self._formed:
                self._formed[(epoch, rnd)] = formed
                self._note_straggler(list(ready_since))
        done: list[tuple[str, float]] = []
        for e in events:
            kind = e.get("kind")
            if kind != "commit":
                self.recent.append(_event_row(e))
            if kind not in ("commit", "abort"):
                continue
            key = (int(e.get("epoch", -1)), int(e.get("round", -1)))
            formed_at = self._formed.pop(key, None)
            t = float(e.get("t", now))
            if kind == "abort":
                self.aborts.append(
                    {
                        "t": round(t, 3),
                        "round": e.get("round"),
                        "epoch": e.get("epoch"),
                        "reason": str(e.get("reason", ""))[:500],
                    }
                )
            if formed_at is not None:
                outcome = "committed" if kind == "commit" else "aborted"
                seconds = max(0.0, t - formed_at)
                done.append((outcome, seconds))
                _append_capped(
                    self.durations, [round(t, 3), round(seconds, 4), float(kind == "commit")]
                )
        # rounds whose outcome was never seen (the history of outcomes is bounded) are dropped
        if len(self._formed) > 64:
            for key in sorted(self._formed)[:-8]:
                del self._formed[key]
        return done

    def _note_straggler(self, ready: list[tuple[str, float | None]]) -> None:
        times = [(t, name) for name, t in ready if t is not None]
        if len(times) < 2:
            return
        times.sort()
        waited = times[-1][0] - times[0][0]
        if waited <= 0:
            return
        p = self.track(times[-1][1])
        p.straggled += 1
        p.straggle_s += waited

    def sample_peers(self, now: float, peers: Iterable[dict[str, Any]]) -> None:
        """Read each active peer's reported step and loss (``/v1/status`` peers)."""
        reports = (
            (
                str(p.get("name")),
                p.get("info") or {},
                now - float(p.get("last_heartbeat_s") or 0.0),  # when that info arrived
            )
            for p in peers
            if p.get("state") == "active"
        )
        self.sample_reports(now, reports)

    def sample_reports(
        self, now: float, reports: Iterable[tuple[str, dict[str, Any], float]]
    ) -> None:
        """Read each active peer's reported step and loss from ``(name, info, seen)``: its last
        heartbeat's info and when that arrived (the coordinator's clock)."""
        for name, info, seen in reports:
            track = self.track(name)
            step = _number(info.get("step"))
            if step is not None and (not track.steps or track.steps[-1][1] != step):
                track.steps.append((seen, step))
                track.last_step_at = seen
            while track.steps and track.steps[0][0] < now - RATE_WINDOW_S and len(track.steps) > 2:
                track.steps.popleft()
            loss = _number(info.get("loss"))
            if loss is not None and (not track.loss or track.loss[-1][1] != loss):
                _append_capped(track.loss, [round(seen, 3), loss])

    # -- read -----------------------------------------------------------------------------------
    def peer_rows(self, now: float, status: dict[str, Any]) -> list[dict[str, Any]]:
        """One row per peer of ``status`` (newest registration first among equal names), with
        what the dashboard's table shows."""
        rows = []
        for p in status.get("peers", []):
            info = p.get("info") or {}
            track = self.peers.get(str(p.get("name")))
            by_op = info.get("bytes_by_op")
            rows.append(
                {
                    "id": p.get("id"),
                    "name": p.get("name"),
                    "state": p.get("state"),
                    "reason": p.get("reason", ""),
                    "isolated": p.get("isolated"),
                    "member": bool(p.get("member")),
                    "in_sync": bool(p.get("in_sync")),
                    "revision": p.get("revision"),
                    "address": info.get("address"),
                    "host": info.get("host"),
                    "pid": info.get("pid"),
                    "last_heartbeat_s": p.get("last_heartbeat_s"),
                    "step": _number(info.get("step")),
                    "loss": _number(info.get("loss")),
                    "steps_per_s": None if track is None else track.steps_per_s(now),
                    "bytes_sent": _number(info.get("bytes_sent")) or 0,
                    "bytes_by_op": {
                        str(k): v for k, v in (by_op or {}).items() if _number(v) is not None
                    }
                    if isinstance(by_op, dict)
                    else {},
                    "straggled": 0 if track is None else track.straggled,
                    "straggle_s": 0.0 if track is None else round(track.straggle_s, 3),
                }
            )
        return rows

    def snapshot(
        self, now: float, status: dict[str, Any], *, waiting_for: list[str] | None = None
    ) -> dict[str, Any]:
        """Everything the dashboard draws, as JSON-able values (times: seconds since the
        coordinator started; add ``run.started_at`` for Unix time)."""
        rows = self.peer_rows(now, status)
        names = {str(r["name"]) for r in rows}
        return {
            "now": round(now, 3),
            "run": {
                "id": status.get("run_id"),
                "started_at": status.get("started_at"),
                "uptime_s": status.get("uptime_s"),
                "revision": status.get("revision"),
                "epoch": status.get("epoch"),
                "world": status.get("world"),
                "phase": status.get("phase"),
                "round": status.get("round"),
                "config": status.get("config", {}),
                "waiting_for": waiting_for or [],
            },
            "counters": status.get("counters", {}),
            "checkpoint": status.get("checkpoint", {}),
            "peers": rows,
            "world_series": [*self.world, [round(now, 3), self.world[-1][1]]] if self.world else [],
            "loss_series": {n: t.loss for n, t in self.peers.items() if n in names and t.loss},
            "durations": self.durations[-200:],
            "aborts": list(self.aborts)[::-1],
            "events": list(self.recent)[::-1],
        }


def _event_row(e: dict[str, Any]) -> dict[str, Any]:
    """An event for the dashboard's list: its time and kind, and a short text of the rest."""
    rest = {k: v for k, v in e.items() if k not in ("t", "kind", "ts")}
    if e.get("kind") == "resync":  # tensor names would fill the list: say how many
        text = "; ".join(
            f"peer {t.get('src')} -> peer {t.get('dst')}: {len(t.get('names', []))} tensors"
            for t in e.get("transfers", [])
        )
    else:
        text = ", ".join(f"{k} {v}" for k, v in rest.items() if v not in (None, "", [], {}))
    return {"t": round(float(e.get("t", 0.0)), 3), "kind": e.get("kind"), "text": text[:400]}
