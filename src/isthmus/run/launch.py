"""The one way to start peers: ``isthmus run``, ``isthmus demo`` and ``isthmus lab run`` launch here.

A :class:`Launcher` starts (or joins) a coordinator, starts one process per peer *slot*, watches
them until they all exit, and tears everything down on every way out. What differs between the
three commands plugs in, and one driver per command puts it together
(:mod:`isthmus.run.builtin_run` for ``isthmus demo``, :mod:`isthmus.run.script_run` for
``isthmus run``, :mod:`isthmus.run.lab_run` for ``isthmus lab run``):

* the :class:`Program` each peer runs (:mod:`isthmus.run.programs`): the built-in job
  (:class:`BuiltinJob`, whose code is :mod:`isthmus.run.job`: the demo and the lab) or the
  user's own script (:class:`Script`, ``isthmus run``, like ``torchrun``: it reads
  ``ISTHMUS_COORDINATOR``, ``ISTHMUS_TOKEN`` and ``ISTHMUS_NAME`` with
  :meth:`isthmus.SessionConfig.from_env`);
* the :class:`Spawner` that makes the processes: plain local ones here, one per network namespace
  in the lab (:class:`isthmus.run.lab_run.NamespaceSpawner`);
* :class:`Hook` objects called at the start, on every tick and at the end: planned churn (the
  demo's ``--kill``/``--join`` and the lab's scenarios, :mod:`isthmus.run.churn_hook`), the lab's
  link counters.

A crashed peer (non-zero exit the launcher did not cause) is started again as a joiner, up to
``max_restarts`` times per slot (torchrun's elastic agent does the same). The whole run is
bounded by ``timeouts.run_timeout`` when it is set (none: the run lasts as long as its peers do),
each teardown step by a few seconds. On Ctrl-C, a timeout or an error every child gets SIGCONT
and SIGTERM, then SIGKILL after a short grace period, and the embedded coordinator stops; the
exception (KeyboardInterrupt) then propagates.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isthmus.coordinator.auth import join_token
from isthmus.coordinator.client import CoordinatorClient
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.stragglers import StragglerConfig
from isthmus.lab.churn_plan import SlotState
from isthmus.run import forkserver
from isthmus.run.config import TimeoutConfig
from isthmus.run.forkserver import PeerProcess
from isthmus.run.names import PrefixClaim, check_prefix, machine_prefix, peer_name
from isthmus.run.programs import BuiltinJob, PeerLaunch, Program, Script
from isthmus.run.record import RunDir
from isthmus.run.secure import embedded_tls
from isthmus.run.tee import LogTee

__all__ = [
    "BuiltinJob",
    "Hook",
    "Incarnation",
    "Launcher",
    "Outcome",
    "PeerLaunch",
    "Program",
    "Script",
    "Slot",
    "Spawner",
]

log = logging.getLogger("isthmus.launch")

TERM_GRACE_S = 3.0
"""How long children get to exit after SIGTERM before SIGKILL."""

COMMIT_BOUND_S = 86400.0
"""The embedded coordinator's bound on a member that keeps heartbeating but never reports its
round: a day, longer than any sync it must let finish."""


# ---------------------------------------------------------------------------- processes


class Spawner:
    """Starts peer processes on this machine. The lab's spawner starts each in its namespace."""

    coordinator_host = "127.0.0.1"
    separate_hosts = False  # peers stand for other machines: TLS and join tokens (SECURITY.md)

    def coordinator_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around starting the embedded coordinator (the lab enters the coordinator's
        namespace there, so that it listens on the emulated network)."""
        return contextlib.nullcontext()

    def hostname(self, slot: int) -> str | None:
        """The address Gloo should bind in slot ``slot`` (None: resolve the hostname)."""
        return None

    def popen(self, slot: int, argv: list[str], env: dict[str, str], log: Any) -> PeerProcess:
        # forked from a warm server (torch imported once, not once per peer) in a session of its
        # own: Ctrl-C reaches the launcher only, and it stops the peers itself
        return forkserver.popen(argv, env={**os.environ, **env}, log_path=log.name)


def signal_group(proc: PeerProcess, sig: int) -> bool:
    """Send ``sig`` to the process group of ``proc``; False if it is gone."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces: the state follows the last ')'
    return text.rsplit(")", 1)[1].split()[0]


@dataclass
class Incarnation:
    """One process that ran in a slot."""

    slot: int
    name: str
    proc: PeerProcess
    started: float
    killed: bool = False
    """SIGKILLed by the launcher (planned churn)."""
    torn_down: bool = False
    """Stopped by the launcher's teardown (end of the run, timeout, Ctrl-C), not by a fault."""
    restarted: bool = False
    """It crashed and the launcher started a new process in its slot."""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


@dataclass
class Slot:
    """One peer position and the processes that ran there one after another."""

    index: int
    incarnations: list[Incarnation] = field(default_factory=list)
    restarts: int = 0
    prefix: str = ""
    """What its processes' names start with (:mod:`isthmus.run.names`; ``""``: ``peer<i>``)."""

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None

    def state(self) -> SlotState:
        cur = self.current
        if cur is None:
            return "absent"
        if cur.proc.poll() is not None:
            return "exited"
        return "stopped" if proc_state(cur.proc.pid) in ("T", "t") else "running"

    def next_name(self) -> str:
        return peer_name(self.prefix, self.index, len(self.incarnations))


class Hook:
    """Called by the launcher: plug-in behaviour (churn, measurements). Every method is optional."""

    def faults(self, slot: int, from_step: float) -> list[str]:
        """Fault specs the incarnation of ``slot`` starting at run step ``from_step`` carries."""
        return []

    def start(self, launcher: Launcher) -> None:
        """The coordinator is up; no peer has started yet."""

    def tick(self, launcher: Launcher) -> None:
        """Called a few times a second while peers run."""

    def stuck(self, launcher: Launcher) -> bool:
        """True when the run can make no progress any more (every live peer is frozen)."""
        return False

    def stop(self, launcher: Launcher) -> None:
        """The run ended (every peer exited, or the launcher gave up); called before teardown."""


@dataclass
class Outcome:
    """What a launch left behind, for the summary."""

    slots: list[Slot]
    events: list[dict[str, Any]]
    status: dict[str, Any]
    wall_s: float
    t0: float | None
    """Unix time at which the first round formed (None: it never did)."""
    timed_out: bool = False

    @property
    def incarnations(self) -> list[Incarnation]:
        return [i for s in self.slots for i in s.incarnations]


# ---------------------------------------------------------------------------- the launcher


class Launcher:
    """Starts and watches the peers of one run (see the module docstring).

    ``coordinator`` None starts an embedded coordinator (with a fresh token) on the spawner's
    host; otherwise peers join the coordinator at that address with ``token``. ``slots`` peer
    positions exist over the run, ``starting`` of them start at once (the others are started by
    a hook, e.g. a planned join).

    Peers are named ``peer0``, ``peer1``... (a restart ``peer1.1``); with ``name_prefix``
    ``X``, ``X-peer0``... Joining a remote coordinator without one, the launcher claims this
    machine's prefix (:mod:`isthmus.run.names`), so that no two machines' peers share a name;
    ``name_prefix=""`` keeps the bare names. Raises ValueError for a prefix
    :func:`~isthmus.run.names.check_prefix` refuses.
    """

    def __init__(
        self,
        program: Program,
        *,
        run_dir: RunDir,
        slots: int,
        starting: list[int] | None = None,
        timeouts: TimeoutConfig | None = None,
        spawner: Spawner | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        coordinator_fingerprint: str | None = None,
        max_restarts: int = 0,
        hooks: list[Hook] | None = None,
        total_steps: int | None = None,
        label: str = "",
        progress: bool = True,
        checkpoint_dir: str | None = None,
        stragglers: StragglerConfig | None = None,
        tee: bool = False,
        name_prefix: str | None = None,
    ) -> None:
        if coordinator is not None and not token:
            raise ValueError("joining a remote coordinator needs its token")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.program = program
        self.run_dir = run_dir
        # the peers' lines on this terminal, prefixed (isthmus run); the logs stay the record
        self.tee = LogTee(self._echo) if tee else None
        self._claim: PrefixClaim | None = None
        if name_prefix is None and coordinator is not None:
            self._claim = PrefixClaim(machine_prefix(), coordinator)
            name_prefix = self._claim.prefix
        self.name_prefix = check_prefix(name_prefix) if name_prefix else ""
        """What this launcher's peer names start with (``""``: ``peer0``...)."""
        self.slots = [Slot(i, prefix=self.name_prefix) for i in range(slots)]
        self.starting = list(range(slots)) if starting is None else list(starting)
        self.timeouts = timeouts or TimeoutConfig()
        self.spawner = spawner or Spawner()
        self.remote = coordinator
        self.token = token or secrets.token_hex(16)
        self.max_restarts = max_restarts
        self.hooks = list(hooks or [])
        self.total_steps = total_steps
        self.label = label or program.label
        self.show_progress = progress
        self.checkpoint_dir = checkpoint_dir
        self.stragglers = stragglers or StragglerConfig()
        self.coordinator: Coordinator | None = None
        self.fingerprint = coordinator_fingerprint  # the coordinator's TLS certificate, if any
        self.coordinator_tls: Any = None  # the embedded coordinator's certificate, if any
        self.client: CoordinatorClient | None = None
        self.run_step = 0
        """The most advanced active peer's step (what step-clock churn waits for)."""
        self.t0: float | None = None
        self.status: dict[str, Any] = {}
        self._events: list[dict[str, Any]] = []  # drained from an embedded coordinator
        self._events_seen = 0

    # -- what hooks use -------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self.remote is not None:
            return self.remote
        assert self.coordinator is not None
        return self.coordinator.address

    @property
    def elapsed(self) -> float | None:
        """Seconds since the first round formed (None before)."""
        return None if self.t0 is None else time.time() - self.t0

    def spawn(self, slot: int, from_step: float = 0) -> Incarnation:
        """Start a new process in ``slot`` (a joiner unless the run is just starting)."""
        s = self.slots[slot]
        faults = [f for h in self.hooks for f in h.faults(slot, from_step)]
        name = s.next_name()
        launch = PeerLaunch(
            slot=slot,
            name=name,
            coordinator=self.address,
            # a slot's incarnations share its identity: revoking it refuses the slot's restarts
            token=join_token(self.token, f"peer{slot}") if self.coordinator_tls else self.token,
            faults=tuple(faults),
            hostname=self.spawner.hostname(slot),
            run_dir=self.run_dir,
            coordinator_fingerprint=self.fingerprint,
        )
        argv = self.program.command(launch)
        with self.run_dir.log(name).open("wb") as logf:
            proc = self.spawner.popen(
                slot, argv, {"PYTHONUNBUFFERED": "1", **self.program.env(launch)}, logf
            )
        if self.tee is not None:
            self.tee.follow(name, self.run_dir.log(name))
        inc = Incarnation(slot, name, proc, time.monotonic())
        s.incarnations.append(inc)
        return inc

    def kill(self, slot: int) -> None:
        """SIGKILL the slot's process group and reap it (bounded)."""
        cur = self.slots[slot].current
        if cur is not None and cur.proc.poll() is None:
            cur.killed = True
            signal_group(cur.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                cur.proc.wait(10)

    def signal(self, slot: int, sig: int) -> bool:
        cur = self.slots[slot].current
        return cur is not None and signal_group(cur.proc, sig)

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Launch, watch until every peer exited (or the run timed out), tear down."""
        started = time.monotonic()
        timed_out = False
        if self._claim is not None:
            self._say(
                f"this machine's peers are named {peer_name(self.name_prefix, 0)}, ... "
                "(choose with --name-prefix)"
            )
        try:
            self._start_coordinator()
        except BaseException:
            # nothing was started: the machine's peer names go back (a launcher started
            # again in this process must get the same ones, or resumed peers miss their state)
            if self._claim is not None:
                self._claim.release()
            raise
        try:
            for h in self.hooks:
                h.start(self)
            for i in self.starting:
                self.spawn(i, 0)
            limit = self.timeouts.run_timeout
            timed_out = self._watch(math.inf if limit is None else started + limit)
            for h in self.hooks:
                h.stop(self)
        finally:
            self._teardown()
            events, status = self._final_view()
            if self.coordinator is not None:
                self.coordinator.stop()
            if self.client is not None:
                self.client.close()
            if self._claim is not None:
                self._claim.release()
        return Outcome(self.slots, events, status, time.monotonic() - started, self.t0, timed_out)

    def _start_coordinator(self) -> None:
        t = self.timeouts
        if self.remote is not None:
            opts = {"connect_timeout": t.connect_timeout, "fingerprint": self.fingerprint}
            self.client = CoordinatorClient(self.remote, self.token, **opts)  # type: ignore[arg-type]
            return
        self.coordinator_tls = tls = embedded_tls(self.spawner, self.run_dir.path)
        if tls is not None:  # a join token per slot too
            self.fingerprint = tls.fingerprint
        with self.spawner.coordinator_context():
            self.coordinator = Coordinator(
                CoordinatorConfig(
                    token=self.token,
                    tls=tls,
                    host=self.spawner.coordinator_host,
                    port=0,
                    membership=MembershipConfig(
                        start_peers=max(1, len(self.starting)),
                        start_timeout=t.start_timeout,
                        heartbeat_timeout=t.heartbeat_timeout,
                        # a member whose transfer moves may be quiet as long as a link may
                        # (its heartbeats queue behind that transfer's data)
                        transfer_heartbeat_timeout=max(t.heartbeat_timeout, t.stall_s),
                        # A transfer runs as long as its bytes move, and each member gives up
                        # a stuck one itself (stall_s, late_s): the coordinator's bound is
                        # only for a member that heartbeats yet never reports.
                        commit_timeout=COMMIT_BOUND_S,
                    ),
                    heartbeat_interval=min(0.5, t.heartbeat_timeout / 3),
                    checkpoint_dir=self.checkpoint_dir,
                    stragglers=self.stragglers,
                )
            ).start()

    def _drain_events(self) -> None:
        # the coordinator keeps its last 10,000 events; a long run (a soak) has many more
        if self.coordinator is not None:
            new, self._events_seen = self.coordinator.events_since(self._events_seen)
            self._events += new

    def _poll_status(self) -> dict[str, Any]:
        if self.coordinator is not None:
            self._drain_events()
            return self.coordinator.status(events=0)
        assert self.client is not None
        try:
            return self.client.get("/v1/status?events=0")
        except Exception as e:  # a remote coordinator that blips must not end the launch
            log.warning("status of %s: %s", self.remote, e)
            return self.status

    def _final_view(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if self.coordinator is not None:
            self._drain_events()
            return self._events, self.coordinator.status()
        assert self.client is not None
        with contextlib.suppress(Exception):
            status = self.client.get("/v1/status?events=100000")
            base = float(status.get("started_at", 0.0))
            events = [{**e, "ts": round(base + e["t"], 4)} for e in status.pop("events", [])]
            return events, status
        return [], self.status

    def _restart_crashed(self) -> None:
        for s in self.slots:
            cur = s.current
            if cur is None or cur.proc.poll() is None or cur.returncode == 0:
                continue
            if cur.killed or cur.torn_down or cur.restarted or s.restarts >= self.max_restarts:
                continue
            cur.restarted = True
            s.restarts += 1
            log.warning(
                "%s exited with %s; restarting it as %s (%d of %d)",
                cur.name,
                cur.returncode,
                s.next_name(),
                s.restarts,
                self.max_restarts,
            )
            self._say(f"{cur.name} exited with {cur.returncode}: restarted as {s.next_name()}")
            self.spawn(s.index, self.run_step)

    def _watch(self, deadline: float) -> bool:
        """Poll until every peer has exited; True if the run timed out."""
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._console = Console(stderr=True)
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("peers {task.fields[peers]}"),
            TextColumn("sent {task.fields[sent]}"),
            TimeElapsedColumn(),
            console=self._console,
            disable=not self.show_progress,
        )
        with progress:
            task = progress.add_task(
                self.label, total=self.total_steps, loss="-", peers=0, sent="0 B"
            )
            while True:
                if self.tee is not None:
                    self.tee.pump()
                self._restart_crashed()
                alive = [s for s in self.slots if s.state() in ("running", "stopped")]
                if not alive:
                    break
                if any(h.stuck(self) for h in self.hooks):
                    self._say("every remaining peer is stopped and none will continue: ending")
                    break
                if time.monotonic() > deadline:
                    self._say(
                        f"[red]run timed out after {self.timeouts.run_timeout or 0:.0f}s; "
                        "stopping peers"
                    )
                    return True
                st = self._poll_status()
                self.status = st
                if self.t0 is None and st.get("epoch", 0) >= 1:
                    self.t0 = time.time()
                peers = st.get("peers", [])
                active = [p for p in peers if p["state"] == "active"]
                steps = [int(p["info"].get("step", 0)) for p in active]
                self.run_step = max([self.run_step, *steps])
                for h in self.hooks:
                    h.tick(self)
                losses = [float(p["info"]["loss"]) for p in active if "loss" in p["info"]]
                sent = sum(int(p["info"].get("bytes_sent", 0)) for p in peers)
                fields: dict[str, Any] = {"sent": _fmt_bytes(sent), "peers": st.get("world", 0)}
                if losses:
                    fields["loss"] = f"{sum(losses) / len(losses):.3f}"
                done = min(self.run_step, self.total_steps) if self.total_steps else self.run_step
                progress.update(task, completed=done, **fields)
                time.sleep(0.1)
            if self.total_steps:
                progress.update(task, completed=self.total_steps)
            if self.tee is not None:
                self.tee.close()
        return False

    def _echo(self, line: str) -> None:
        """A peer's line, as it is (no markup), on stdout; above the progress bar while one is
        drawn on a terminal (which shares the terminal with it)."""
        console = getattr(self, "_console", None)
        if self.show_progress and console is not None and console.is_terminal:
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def _say(self, text: str) -> None:
        console = getattr(self, "_console", None)
        if console is not None:
            console.print(text)
        else:
            print(text, file=sys.stderr)

    def _teardown(self) -> None:
        """Stop every child still running: SIGCONT and SIGTERM to its group, SIGKILL after a
        short grace period. Bounded; never stops half-way."""
        live = [
            i for i in (s.current for s in self.slots) if i is not None and i.proc.poll() is None
        ]
        for inc in live:
            inc.torn_down = True
            signal_group(inc.proc, signal.SIGCONT)
            signal_group(inc.proc, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for inc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                inc.proc.wait(max(0.0, deadline - time.monotonic()))
        for inc in live:
            if inc.proc.poll() is None:
                signal_group(inc.proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inc.proc.wait(10)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
