"""Planned churn, applied: the launcher hook that carries out a :class:`~isthmus.lab.churn_plan.ChurnPlan`.

Step-clock kills and stops travel with the peer of the built-in job as injected faults (it fires
them on itself at exactly that step); this hook notices them happen and records them. A user's
script carries no faults of the launcher's making (``self_fired=False``): its step-clock kills and
stops are applied from outside, at the first tick after a peer reported that step. Everything else (joins,
continues, timed kills and stops) it applies when due: a join starts a new process in the slot,
a kill is SIGKILL, stop and cont are SIGSTOP and SIGCONT to the peer's process group. Every
action, applied or skipped with its reason, goes to ``churn.jsonl`` and to the summary.

The demo's ``--kill PEER@STEP`` and ``--join STEP`` are churn like a scenario's: see
:func:`plan_from_config`.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterable, Mapping
from typing import Any

from isthmus.lab.churn_plan import ChurnPlan, Planned, starting_slots
from isthmus.run.config import RunConfig
from isthmus.run.launch import Hook, Launcher

__all__ = ["ChurnHook", "plan_from_config"]

log = logging.getLogger("isthmus.churn")


def plan_from_config(run: RunConfig) -> tuple[list[Planned], int]:
    """The demo's kills and joins as planned events, and the number of slots: ``--kill P@S`` is
    a kill of slot P at step S; the k-th ``--join S`` starts slot ``peers + k`` at step S."""
    events = [
        Planned(action="kill", slot=p, clock="step", when=s, source="cli")
        for p, s in run.faults.kills
    ]
    for k, step in enumerate(run.faults.joins):
        events.append(
            Planned(action="join", slot=run.peers + k, clock="step", when=step, source="cli")
        )
    return events, run.everyone


class ChurnHook(Hook):
    """Applies ``events`` through the launcher and hands every new incarnation its faults
    (``static_faults`` per slot go to a slot's first incarnation only). With ``self_fired``
    False (a user's script) the churn's step-clock kills and stops are applied from outside
    when due, like the rest, and only ``static_faults`` are handed out (a script's session
    fires them: ``SessionConfig.faults``)."""

    def __init__(
        self,
        events: Iterable[Planned],
        *,
        static_faults: Mapping[int, list[str]] | None = None,
        log_path: Any = None,
        self_fired: bool = True,
    ) -> None:
        self.plan = ChurnPlan(list(events), self_fired=self_fired)
        self.static = {k: list(v) for k, v in (static_faults or {}).items()}
        self.applied: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self._file = open(log_path, "w") if log_path is not None else None  # noqa: SIM115
        self._stop_seen: dict[int, bool] = {}
        self._kill_seen: dict[int, str] = {}
        self._launcher: Launcher | None = None

    def starting(self, slots: int) -> list[int]:
        return starting_slots(slots, self.plan.pending)

    # -- hook -------------------------------------------------------------------------------------
    def faults(self, slot: int, from_step: float) -> list[str]:
        out = self.static.pop(slot, [])
        return self.plan.faults_for(slot, from_step) + out

    def start(self, launcher: Launcher) -> None:
        self._launcher = launcher

    def tick(self, launcher: Launcher) -> None:
        self._observe(launcher)
        for p in self.plan.due(run_step=launcher.run_step, elapsed=launcher.elapsed):
            state = launcher.slots[p.slot].state()
            d = self.plan.decide(p, state, run_step=launcher.run_step)
            if d.kind == "wait":
                continue
            self.plan.done(p)
            if d.kind == "skip":
                self._record(p.action, p.slot, p.source, p.how, skipped=d.reason)
                continue
            if p.action == "join":
                launcher.spawn(p.slot, d.from_step)
                launcher._say(
                    f"step {launcher.run_step}: {launcher.slots[p.slot].current.name} joins"
                )  # type: ignore[union-attr]
            elif p.action == "kill":
                launcher.kill(p.slot)
                self._kill_seen[p.slot] = launcher.slots[p.slot].current.name  # type: ignore[union-attr]
            elif p.action == "stop":
                launcher.signal(p.slot, signal.SIGSTOP)
                self._stop_seen[p.slot] = True
            else:
                launcher.signal(p.slot, signal.SIGCONT)
                self._stop_seen[p.slot] = False
            self._record(p.action, p.slot, p.source, p.how)

    def stuck(self, launcher: Launcher) -> bool:
        alive = [s for s in launcher.slots if s.state() in ("running", "stopped")]
        return (
            bool(alive)
            and all(s.state() == "stopped" for s in alive)
            and not self.plan.can_wake(run_step=launcher.run_step)
        )

    def stop(self, launcher: Launcher) -> None:
        self._observe(launcher)
        for p, reason in self.plan.leftovers():
            how = p.how if not self.plan.by_fault(p) else f"fault at step {int(p.when)}"
            self._record(p.action, p.slot, p.source, how, skipped=reason)
        if self._file is not None:
            self._file.close()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _observe(self, launcher: Launcher) -> None:
        """Record kills and stops the peers fired on themselves."""
        for slot in launcher.slots:
            cur = slot.current
            if cur is None:
                continue
            if cur.proc.poll() == -signal.SIGKILL and self._kill_seen.get(slot.index) != cur.name:
                self._kill_seen[slot.index] = cur.name
                p = self.plan.observed(slot.index, "kill")
                if p is not None:
                    self._record("kill", slot.index, p.source, f"fault at step {int(p.when)}")
            elif slot.state() == "stopped":
                if not self._stop_seen.get(slot.index):
                    self._stop_seen[slot.index] = True
                    p = self.plan.observed(slot.index, "stop")
                    if p is not None:
                        self._record("stop", slot.index, p.source, f"fault at step {int(p.when)}")
            else:
                self._stop_seen[slot.index] = False  # continued: a later stop is recorded again

    def _record(self, action: str, slot: int, source: str, how: str, *, skipped: str = "") -> None:
        launcher = self._launcher
        now = time.time()
        cur = launcher.slots[slot].current if launcher is not None else None
        t0 = launcher.t0 if launcher is not None else None
        rec: dict[str, Any] = {
            "ts": round(now, 4),
            "t": round(now - t0, 3) if t0 is not None else None,
            "action": action,
            "peer": slot,
            "name": cur.name if cur is not None else None,
            "run_step": launcher.run_step if launcher is not None else 0,
            "source": source,
            "how": how,
        }
        if skipped:
            rec["skipped"] = skipped
            self.skipped.append(rec)
        else:
            self.applied.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        verb = f"skipped {action}" if skipped else action
        log.info("churn: %s peer %d (%s)%s", verb, slot, how, f": {skipped}" if skipped else "")
