"""``isthmus run``: the user's own training script on N local peers, like ``torchrun``.

``isthmus run --peers 3 train.py --lr 3e-4`` starts an embedded coordinator and three processes of
``python train.py --lr 3e-4``; each finds the run through ``ISTHMUS_COORDINATOR``,
``ISTHMUS_TOKEN`` and ``ISTHMUS_NAME``, and the run's ``ISTHMUS_CONNECTIONS`` and
``ISTHMUS_PROBE_LINKS`` (``isthmus.SessionConfig.from_env()`` reads them). With
``coordinator=`` the peers join a coordinator elsewhere instead (``isthmus coordinator`` on some
host, the token from a file), so the same command starts this machine's share of a run across
machines. With GPUs, each peer gets one device through ``CUDA_VISIBLE_DEVICES`` (round robin over
the visible ones). A crashed peer is restarted as a joiner up to ``max_restarts`` times.

This is the launching side: :func:`launch_script` puts a :class:`~isthmus.run.programs.Script`
program (:class:`DeviceScript`) in every slot of the one :class:`~isthmus.run.launch.Launcher`,
here and in the lab (:mod:`isthmus.run.lab_run`, inside network namespaces); the built-in job is
launched by :mod:`isthmus.run.builtin_run` instead. In the lab :class:`StepRecords` also writes
each peer's per-step records from what its session reports (``session.report(step=..., loss=...)``),
so that the lab's plots and ``isthmus lab compare`` have curves for a script too.

The run directory gets each peer's log, ``events.jsonl`` (the coordinator's view) and
``summary.json``; parity at the end comes from the digests the peers' sessions report when they
leave.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from isthmus.run.config import RunConfig, TimeoutConfig, from_flat
from isthmus.run.launch import Hook, Launcher, Outcome, PeerLaunch, Script, Spawner
from isthmus.run.record import RunDir, Summary
from isthmus.run.summarize import collect_metrics, summarize

__all__ = [
    "DeviceScript",
    "StepRecords",
    "launch_script",
    "run_script",
    "script_config",
    "visible_devices",
]

_RUN_TIMEOUT_KEYS = ("timeout", "run_timeout", "timeouts.run_timeout")


def script_config(overrides: Mapping[str, Any]) -> RunConfig:
    """``isthmus run``'s settings from the flags given (flat names or dotted paths, as
    :func:`~isthmus.run.flags.overrides_from` gives them): a run lasts as long as its peers do,
    so there is no wall-clock bound (``timeouts.run_timeout`` None) unless ``--timeout`` (or
    ``timeouts.run_timeout``) is among them. Raises :class:`~isthmus.spec.SpecError` naming a bad
    value."""
    if not any(k in _RUN_TIMEOUT_KEYS for k in overrides):
        overrides = {**overrides, "timeout": None}
    return from_flat(**overrides)


def visible_devices() -> list[str]:
    """The CUDA devices peers may use: ``CUDA_VISIBLE_DEVICES`` if set, else every device torch
    sees (none without CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch, or a broken CUDA install: run on the CPU
        return []


class DeviceScript(Script):
    """A :class:`Script` whose peer ``i`` sees one device: ``devices[i % len(devices)]``."""

    def __init__(
        self,
        path: str | Path,
        args: list[str],
        devices: list[str],
        *,
        settings: dict[str, str] | None = None,
        nproc_per_peer: int | list[int] = 1,
    ) -> None:
        super().__init__(path, args, settings=settings, nproc_per_peer=nproc_per_peer)
        self.devices = devices

    def env(self, peer: PeerLaunch) -> dict[str, str]:
        env = super().env(peer)
        n = self.nproc(peer.slot)
        if self.devices and n > 1:  # an island: peer i sees the n devices after the others'
            first = sum(self.nproc(s) for s in range(peer.slot))
            mine = [self.devices[(first + r) % len(self.devices)] for r in range(n)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        elif self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[peer.slot % len(self.devices)]
        return env


class StepRecords(Hook):
    """Writes ``<name>.jsonl`` for peers that run a user's script: one record each time the
    coordinator's view of an active peer shows a new ``step`` with a ``loss`` (what the script
    passes to ``session.report``), with the time, the world size, the revision and the bytes the
    session sent. The view comes with heartbeats, so steps between two of them are missing; a
    script that reports no step or loss gets no records (the run itself is unaffected)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._last: dict[str, Any] = {}

    def tick(self, launcher: Launcher) -> None:
        status = launcher.status
        for p in status.get("peers", []):
            info = p.get("info") or {}
            step, loss = info.get("step"), info.get("loss")
            if p.get("state") != "active" or not _number(step) or not _number(loss):
                continue
            name = str(p["name"])
            if self._last.get(name) == step:
                continue
            self._last[name] = step
            rec = {
                "ts": round(time.time(), 4),
                "step": int(step),
                "loss": float(loss),
                "world": int(status.get("world", 0)),
                "revision": int(p.get("revision", 0)),
                "bytes_sent": int(info.get("bytes_sent", 0)),
            }
            with self.run_dir.records_path(name).open("a") as f:
                f.write(json.dumps(rec) + "\n")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def launch_script(
    program: Script,
    *,
    run_dir: RunDir,
    slots: int,
    starting: list[int] | None = None,
    timeouts: TimeoutConfig,
    spawner: Spawner | None = None,
    hooks: list[Hook] | None = None,
    steps: int | None = None,
    **launcher: Any,
) -> tuple[Summary, Outcome]:
    """Run ``program`` in ``slots`` peer slots (``starting`` of them at once) through the one
    launcher until every peer exited; returns the summary (not yet written) and the launch's
    outcome, and writes ``metrics.jsonl`` and ``events.jsonl``. ``launcher`` holds the
    :class:`~isthmus.run.launch.Launcher`'s other keywords (coordinator, token, restarts,
    progress, tee...). Re-raises KeyboardInterrupt after stopping every child."""
    outcome = Launcher(
        program,
        run_dir=run_dir,
        slots=slots,
        starting=starting,
        timeouts=timeouts,
        spawner=spawner,
        hooks=hooks,
        total_steps=steps,
        **launcher,
    ).run()
    n = slots if starting is None else len(starting)
    summary = summarize(outcome, run_dir, steps=steps, program=str(program.path), starting=n)
    collect_metrics(outcome, run_dir)
    return summary, outcome


def run_script(
    script: str | Path,
    args: list[str],
    *,
    peers: int,
    max_restarts: int = 0,
    coordinator: str | None = None,
    token: str | None = None,
    coordinator_fingerprint: str | None = None,
    timeouts: TimeoutConfig | None = None,
    run_dir: str | None = None,
    steps: int | None = None,
    progress: bool = True,
    tee: bool = True,
    summary_json: str | None = None,
    connections: int = 1,
    probe_links: bool = False,
    pipeline_commit: bool = True,
    nproc_per_peer: int | list[int] = 1,
    mesh: bool = False,
    name_prefix: str | None = None,
) -> tuple[Summary, RunDir]:
    """Run ``script`` on ``peers`` local processes until they all exit; returns the summary
    (also in ``summary.json``) and the run directory.

    ``timeouts``: the run's bounds; without, those of :func:`script_config` with no flags (no
    wall-clock bound). ``connections``, ``probe_links``, ``pipeline_commit`` and ``mesh``
    (``--connections``, ``--probe-links``, ``--no-pipeline-commit``, ``--mesh``) reach every peer
    as ``ISTHMUS_CONNECTIONS``, ``ISTHMUS_PROBE_LINKS``, ``ISTHMUS_PIPELINE_COMMIT`` and
    ``ISTHMUS_MESH``, and ``timeouts``' ``stall_s`` and ``late_s`` as
    ``ISTHMUS_STALL_S`` and ``ISTHMUS_LATE_S``, which
    :meth:`isthmus.SessionConfig.from_env` reads (what the script passes itself wins). With
    ``tee`` (``isthmus run`` without ``--quiet``) every line the peers write is also printed
    here, prefixed with its peer (:mod:`isthmus.run.tee`); the logs in the run directory hold it
    either way. ``nproc_per_peer`` above 1 makes each peer an island of that many processes
    (:mod:`isthmus.run.island`); a list gives peer ``i`` the ``i``-th count (cycled).
    ``name_prefix`` (``--name-prefix``): the peers' names start with it
    (:mod:`isthmus.run.names`; None: none on one machine, this machine's with ``coordinator``).

    Raises FileNotFoundError if the script does not exist, ValueError for bad settings, and
    re-raises KeyboardInterrupt after stopping every child.
    """
    if peers < 1:
        raise ValueError(f"--peers must be at least 1, got {peers}")
    timeouts = timeouts or script_config({}).timeouts
    settings = {
        "ISTHMUS_CONNECTIONS": str(connections),
        "ISTHMUS_PROBE_LINKS": "1" if probe_links else "0",
        "ISTHMUS_PIPELINE_COMMIT": "1" if pipeline_commit else "0",
        "ISTHMUS_MESH": "1" if mesh else "0",  # SessionConfig.mesh
        "ISTHMUS_STALL_S": repr(float(timeouts.stall_s)),
        "ISTHMUS_LATE_S": repr(float(timeouts.late_s)),
    }
    program = DeviceScript(
        script, args, visible_devices(), settings=settings, nproc_per_peer=nproc_per_peer
    )
    rd = RunDir.create(run_dir, Path(script).stem)
    rd.write_json(
        "config.json",
        {
            "program": str(script),
            "args": list(args),
            "peers": peers,
            "nproc_per_peer": nproc_per_peer,
            "max_restarts": max_restarts,
            "coordinator": coordinator,
            "connections": connections,
            "probe_links": probe_links,
            "pipeline_commit": pipeline_commit,
            "mesh": mesh,
            "name_prefix": name_prefix,
            "timeouts": dataclasses.asdict(timeouts),
        },
    )
    summary, _ = launch_script(
        program,
        run_dir=rd,
        slots=peers,
        timeouts=timeouts,
        steps=steps,
        coordinator=coordinator,
        token=token,
        coordinator_fingerprint=coordinator_fingerprint,
        max_restarts=max_restarts,
        label=Path(script).name,
        progress=progress,
        tee=tee,
        name_prefix=name_prefix,
    )
    rd.write_summary(summary, also=summary_json)
    return summary, rd
