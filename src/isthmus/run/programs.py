"""What the launcher starts in each peer slot: a :class:`Program` gives one process's argv and
environment, from what the launcher tells it about that process (:class:`PeerLaunch`).

Two programs: :class:`BuiltinJob` writes the peer's ``<name>.job.json`` and starts
``python -m isthmus.run.job`` on it (the demo and the lab; the job's code is
:mod:`isthmus.run.job`), and :class:`Script` starts the user's own script with the run in its
environment (``isthmus run``). :class:`~isthmus.run.launch.Launcher` starts them; nothing here
trains or launches anything itself."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from isthmus.run.config import RunConfig
from isthmus.run.job import PeerJob, PeerSpec
from isthmus.run.record import RunDir

__all__ = ["BuiltinJob", "PeerLaunch", "Program", "Script"]


@dataclass(frozen=True)
class PeerLaunch:
    """What the launcher tells a program about one process it starts."""

    slot: int
    name: str
    coordinator: str
    token: str
    faults: tuple[str, ...]
    hostname: str | None
    run_dir: RunDir
    coordinator_fingerprint: str | None = None  # the TLS certificate to pin (None: plain HTTP)


class Program(ABC):
    """What each peer process runs."""

    label: str

    @abstractmethod
    def command(self, peer: PeerLaunch) -> list[str]:
        """The argv of peer ``peer``'s process."""

    def env(self, peer: PeerLaunch) -> dict[str, str]:
        """Extra environment of the process."""
        return {}


class BuiltinJob(Program):
    """The built-in training job (:mod:`isthmus.run.job`) configured by ``run``."""

    label = "isthmus.run.job"

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.attacks = {b.peer: b for b in run.faults.byzantine}

    def command(self, peer: PeerLaunch) -> list[str]:
        attack = self.attacks.get(peer.slot)
        job = PeerJob(
            run=self.run,
            peer=PeerSpec(
                name=peer.name,
                coordinator=peer.coordinator,
                token=peer.token,
                coordinator_fingerprint=peer.coordinator_fingerprint,
                out_dir=str(peer.run_dir),
                faults=list(peer.faults),
                attack=attack.attack if attack else None,
                attack_from_step=attack.from_step if attack else 0,
                hostname=peer.hostname,
            ),
        )
        path = peer.run_dir.job(peer.name)
        path.write_text(job.to_json())
        if self.run.nproc_per_peer > 1:  # an island: the agent starts the job's ranks
            from isthmus.run import job as job_module

            n = str(self.run.nproc_per_peer)
            return [sys.executable, "-m", "isthmus.run.island", n, job_module.__file__, str(path)]
        return [sys.executable, "-m", "isthmus.run.job", str(path)]


class Script(Program):
    """The user's own training script, run with this Python: ``python script.py args...``.

    It finds the run through the environment (``ISTHMUS_COORDINATOR``, ``ISTHMUS_TOKEN``,
    ``ISTHMUS_NAME``, ``ISTHMUS_PEER``, ``ISTHMUS_RUN_DIR``, ``ISTHMUS_HOSTNAME`` in the lab, and
    ``settings``).
    Raises FileNotFoundError at once if the script does not exist.
    """

    def __init__(
        self,
        path: str | Path,
        args: list[str] | tuple[str, ...] = (),
        *,
        settings: Mapping[str, str] | None = None,
        nproc_per_peer: int | Sequence[int] = 1,
    ) -> None:
        counts = (nproc_per_peer,) if isinstance(nproc_per_peer, int) else tuple(nproc_per_peer)
        if not counts or any(n < 1 for n in counts):
            raise ValueError(f"--nproc-per-peer needs counts of at least 1, got {nproc_per_peer}")
        self.nprocs = counts
        """Processes per peer (peer ``i`` has ``nprocs[i % len]``): unless every peer has one,
        each peer is an island of that many ranks, started by :mod:`isthmus.run.island` with
        torchrun's environment."""
        self.path = Path(path)
        self.settings = dict(settings or {})
        """More environment for every peer: the run's settings that every peer must share
        (``ISTHMUS_CONNECTIONS``, ``ISTHMUS_PROBE_LINKS``; see ``SessionConfig.from_env``)."""
        if not self.path.is_file():
            raise FileNotFoundError(f"no such script: {self.path}")
        self.args = list(args)
        self.label = str(self.path)

    def nproc(self, slot: int) -> int:
        """How many processes peer ``slot`` has."""
        return self.nprocs[slot % len(self.nprocs)]

    def command(self, peer: PeerLaunch) -> list[str]:
        if self.nprocs != (1,):
            island = ["-m", "isthmus.run.island", str(self.nproc(peer.slot))]
            return [sys.executable, *island, str(self.path), *self.args]
        return [sys.executable, str(self.path), *self.args]

    def env(self, peer: PeerLaunch) -> dict[str, str]:
        env = {
            "ISTHMUS_COORDINATOR": peer.coordinator,
            "ISTHMUS_TOKEN": peer.token,
            "ISTHMUS_NAME": peer.name,
            "ISTHMUS_PEER": str(peer.slot),
            "ISTHMUS_RUN_DIR": str(peer.run_dir),
            **self.settings,
        }
        if peer.faults:  # the lab's [[fault]] entries for this peer: SessionConfig.faults
            env["ISTHMUS_FAULTS"] = ";".join(peer.faults)
        if peer.hostname:
            env["ISTHMUS_HOSTNAME"] = peer.hostname
        if peer.coordinator_fingerprint:
            env["ISTHMUS_COORDINATOR_FINGERPRINT"] = peer.coordinator_fingerprint
        return env
