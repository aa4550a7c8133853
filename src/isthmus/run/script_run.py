"""``isthmus run``: the user's own training script on N local peers, like ``torchrun``.

``isthmus run --peers 3 train.py --lr 3e-4`` starts an embedded coordinator and three processes of
``python train.py --lr 3e-4``; each finds the run through ``ISTHMUS_COORDINATOR``,
``ISTHMUS_TOKEN`` and ``ISTHMUS_NAME``, and the run's ``ISTHMUS_CONNECTIONS`` and
``ISTHMUS_PROBE_LINKS`` (``isthmus.SessionConfig.from_env()`` reads them). With
``coordinator=`` the peers join a coordinator elsewhere instead (``isthmus coordinator`` on some
host, the token from a file), so the same command starts this machine's share of a run across
machines. With GPUs, each peer gets one device through ``CUDA_VISIBLE_DEVICES`` (round robin over
the visible ones). A crashed peer is restarted as a joiner up to ``max_restarts`` times.

This is the launching side: it puts a :class:`~isthmus.run.programs.Script` program
(:class:`DeviceScript`) in every slot of the one :class:`~isthmus.run.launch.Launcher`; the
built-in job is launched by :mod:`isthmus.run.builtin_run` instead.

The run directory gets each peer's log, ``events.jsonl`` (the coordinator's view) and
``summary.json``; parity at the end comes from the digests the peers' sessions report when they
leave.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from isthmus.run.config import RunConfig, TimeoutConfig, from_flat
from isthmus.run.launch import Launcher, PeerLaunch, Script
from isthmus.run.record import RunDir, Summary
from isthmus.run.summarize import collect_metrics, summarize

__all__ = ["DeviceScript", "run_script", "script_config", "visible_devices"]

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
    ) -> None:
        super().__init__(path, args, settings=settings)
        self.devices = devices

    def env(self, peer: PeerLaunch) -> dict[str, str]:
        env = super().env(peer)
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[peer.slot % len(self.devices)]
        return env


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
) -> tuple[Summary, RunDir]:
    """Run ``script`` on ``peers`` local processes until they all exit; returns the summary
    (also in ``summary.json``) and the run directory.

    ``timeouts``: the run's bounds; without, those of :func:`script_config` with no flags (no
    wall-clock bound). ``connections`` and ``probe_links`` (``--connections``, ``--probe-links``)
    reach every peer as ``ISTHMUS_CONNECTIONS`` and ``ISTHMUS_PROBE_LINKS``, and ``timeouts``'
    ``stall_s`` and ``late_s`` as ``ISTHMUS_STALL_S`` and ``ISTHMUS_LATE_S``, which
    :meth:`isthmus.SessionConfig.from_env` reads (what the script passes itself wins). With
    ``tee`` (``isthmus run`` without ``--quiet``) every line the peers write is also printed
    here, prefixed with its peer (:mod:`isthmus.run.tee`); the logs in the run directory hold it
    either way.

    Raises FileNotFoundError if the script does not exist, ValueError for bad settings, and
    re-raises KeyboardInterrupt after stopping every child.
    """
    if peers < 1:
        raise ValueError(f"--peers must be at least 1, got {peers}")
    timeouts = timeouts or script_config({}).timeouts
    settings = {
        "ISTHMUS_CONNECTIONS": str(connections),
        "ISTHMUS_PROBE_LINKS": "1" if probe_links else "0",
        "ISTHMUS_STALL_S": repr(float(timeouts.stall_s)),
        "ISTHMUS_LATE_S": repr(float(timeouts.late_s)),
    }
    program = DeviceScript(script, args, visible_devices(), settings=settings)
    rd = RunDir.create(run_dir, Path(script).stem)
    rd.write_json(
        "config.json",
        {
            "program": str(script),
            "args": list(args),
            "peers": peers,
            "max_restarts": max_restarts,
            "coordinator": coordinator,
            "connections": connections,
            "probe_links": probe_links,
            "timeouts": dataclasses.asdict(timeouts),
        },
    )
    launcher = Launcher(
        program,
        run_dir=rd,
        slots=peers,
        timeouts=timeouts,
        coordinator=coordinator,
        token=token,
        coordinator_fingerprint=coordinator_fingerprint,
        max_restarts=max_restarts,
        total_steps=steps,
        label=Path(script).name,
        progress=progress,
        tee=tee,
    )
    outcome = launcher.run()
    summary = summarize(outcome, rd, steps=steps, program=str(script), starting=peers)
    collect_metrics(outcome, rd)
    rd.write_summary(summary, also=summary_json)
    return summary, rd
