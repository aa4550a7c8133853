"""``isthmus lab run``: one scenario end to end on the emulated WAN, with its measurements.

What happens, in order:

1. **Network.** :meth:`WanNetwork.from_spec` builds one network namespace per peer and one for
   the coordinator on a bridge, each link shaped with tc tbf at the scenario's rate. Where that is
   impossible (not root, no iproute2, the kernel refuses namespaces or tbf) the run falls back to
   loopback without shaping and says so, in the output and in ``summary.json``
   (``network.mode = "loopback"`` with the reason), unless ``network="netns"`` was demanded.
2. **Coordinator.** Embedded in this process, as in the demo, but started from *inside* the
   coordinator's namespace (:func:`~isthmus.lab.netns.inside_namespace`): its server thread and
   its sockets (HTTP and the rendezvous store) live there, reachable at the bridge address from
   every peer namespace, while this process's main thread returns to the host namespace to run
   ``ip``/``tc``, read counters and own the teardown. We chose this over re-executing the whole
   runner under ``ip netns exec``: one process owns the network (so the teardown guarantees of
   :class:`WanNetwork` cover every exit path) and the coordinator's status and events are read
   in-process, with no second process to keep in step.
3. **Peers.** ``python -m isthmus.job`` per peer inside its namespace (:class:`NamespaceLauncher`;
   ``ip netns exec`` execs python itself, so the process we hold *is* the peer and signals reach
   it). Gloo binds the namespace's address (``TrainJob.hostname``), see DESIGN.md.
4. **Churn.** ``kill``/``stop`` at a step are injected faults the peer fires on itself at exactly
   that step (:mod:`isthmus.comm.faults`); ``join``/``cont`` at a step fire when the run (the most
   advanced peer) reaches it; every event at a time fires that many seconds after the first round
   formed (before that, peers are still importing torch). ``kill`` is SIGKILL, ``stop``/``cont``
   SIGSTOP/SIGCONT to the peer's process group, ``join`` starts a new process for that peer slot
   (named ``peer<i>.<k>`` for its k-th restart). ``[random_churn]`` adds a seeded schedule of
   timed kills or stops. An event that does not apply when it comes (kill a peer that already
   exited) is skipped and listed in the summary.
5. **Measurements.** Every ``sample_interval_s`` the byte counters of every link (read in one go
   from the bridge namespace: a bridge port's rx is its node's tx) go to ``links.jsonl``. The
   summary compares each peer's bytes on the wire with isthmus's own accounting (payload only)
   and splits off the control plane (everything the peers sent to the coordinator: heartbeats,
   round requests, the rendezvous store), adds round latency, world size over time, time lost to
   recovery and, with ``target_loss``, the wall-clock to that eval loss.
6. **Report.** ``metrics.jsonl``, ``events.jsonl``, ``churn.jsonl``, ``links.jsonl``,
   ``summary.json``, the PNG plots and ``report.md`` (:func:`isthmus.lab.report.plot_run`) plus a
   lab section in the report.

Failures: a bad scenario raises :class:`~isthmus.lab.scenario.ScenarioError` before anything
starts; an unknown strategy option raises ``ValueError`` before anything starts; a network that
cannot be built raises :class:`~isthmus.lab.netns.LabError` (or falls back, see 1). Ctrl-C and
errors tear the network down (and kill every peer) before the exception propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.demo.runner import (
    DemoConfig,
    LocalLauncher,
    _initial_eval_loss,
    _read_jsonl,
    _spawn,
    _summarize,
    _write_outputs,
    check_strategy,
    demo_options,
)
from isthmus.lab.counters import read_all_counters
from isthmus.lab.netns import (
    LabError,
    LabUnavailable,
    inside_namespace,
    unavailable_reason,
)
from isthmus.lab.scenario import ChurnEvent, Scenario, format_rate
from isthmus.lab.wan import WanNetwork

__all__ = ["LabOptions", "LoopbackLauncher", "NamespaceLauncher", "run_lab", "scenario_steps"]

log = logging.getLogger("isthmus.lab")

NETWORK_MODES = ("auto", "netns", "loopback")


@dataclass(kw_only=True)
class LabOptions:
    """How to run a scenario: what the scenario file does not say (where, how long to wait)."""

    run_dir: str | None = None
    """Where results go (default ``runs/<time>-<scenario name>``); must not hold a run already."""
    network: str = "auto"
    """``auto``: namespaces if possible, else loopback (with a message); ``netns``: namespaces or
    fail (``LabUnavailable``); ``loopback``: never build namespaces (no shaping, no per-peer
    counters)."""
    prefix: str = "isth"
    """Prefix of the namespace names (1-12 lowercase letters/digits)."""
    sample_interval_s: float = 0.5
    """How often link counters are sampled into ``links.jsonl``."""
    steps: int | None = None
    """Override the scenario's ``run.steps`` (step-based churn must still fall within it)."""
    eval_every: int = 0
    """Evaluate each peer's model every this many steps (0: only at the end)."""
    target_loss: float | None = None
    """Report the wall-clock at which the peers' mean eval loss first reached this."""
    batch_size: int = 16
    lr: float = 1e-3
    corpus_bytes: int = 2_000_000
    collective_timeout: float = 30.0
    heartbeat_timeout: float = 3.0
    timeout_s: float = 1800.0
    """Bound on the whole run; peers still running after it are killed."""
    step_delay: float = 0.0
    """Seconds each peer sleeps after each step (tests: keeps a tiny run alive long enough for
    churn to land)."""
    progress: bool = True
    summary_json: str | None = None
    """Also write the summary here."""

    def __post_init__(self) -> None:
        if self.network not in NETWORK_MODES:
            raise ValueError(
                f"network must be one of {', '.join(NETWORK_MODES)}, got {self.network!r}"
            )
        for name in ("sample_interval_s", "collective_timeout", "heartbeat_timeout", "timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.target_loss is not None and not (
            math.isfinite(self.target_loss) and self.target_loss > 0
        ):
            raise ValueError(f"target_loss must be a positive number, got {self.target_loss!r}")
        if not (math.isfinite(self.step_delay) and self.step_delay >= 0):
            raise ValueError(f"step_delay must be >= 0 seconds, got {self.step_delay!r}")
        if self.batch_size < 1 or self.corpus_bytes < 10_000:
            raise ValueError("batch_size must be >= 1 and corpus_bytes >= 10000")


def scenario_steps(scenario: Scenario, *, batch_size: int) -> int:
    """Inner steps per peer for the scenario: ``run.steps``, or ``run.tokens`` divided by the
    tokens one step of all starting peers consumes (peers at the start x batch x block size)."""
    if scenario.run.steps is not None:
        return scenario.run.steps
    from isthmus.job import model_config

    start = len(_starting_slots(scenario))
    per_step = start * batch_size * model_config(scenario.run.model).block_size
    return max(1, math.ceil(int(scenario.run.tokens or 0) / per_step))


def _starting_slots(scenario: Scenario) -> list[int]:
    first: dict[int, ChurnEvent] = {}
    for ev in sorted(scenario.churn, key=lambda e: (e.clock != "step", e.when)):
        first.setdefault(ev.peer, ev)
    return [i for i in range(scenario.peers) if not (i in first and first[i].action == "join")]


# ---------------------------------------------------------------------------- launchers


class LoopbackLauncher(LocalLauncher):
    """Plain local processes (the fall-back without namespaces), plus per-peer job fields."""

    def __init__(self, extra: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        self.extra = extra or {}

    def job_fields(self, index: int) -> dict[str, Any]:
        return dict(self.extra.get(index, {}))


class NamespaceLauncher(LocalLauncher):
    """Starts peer ``index`` inside its namespace of ``net`` with Gloo bound to its address, and
    the embedded coordinator inside the coordinator's namespace. ``extra`` adds job fields per
    peer index (eval_every, attack_from_step)."""

    def __init__(
        self, net: WanNetwork, extra: Mapping[int, Mapping[str, Any]] | None = None
    ) -> None:
        self.net = net
        self.extra = extra or {}
        self.coordinator_host = net.coordinator.ip

    def coordinator_context(self) -> contextlib.AbstractContextManager[Any]:
        return inside_namespace(self.net.coordinator.netns)

    def job_fields(self, index: int) -> dict[str, Any]:
        # hostname, not interface: Gloo binds and advertises exactly this address
        return {"hostname": self.net.peers[index].ip, **self.extra.get(index, {})}

    def popen(self, index: int, argv: list[str], log: Any) -> subprocess.Popen[bytes]:
        return self.net.popen(
            index,
            argv,
            env={"PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            # a process group of its own: Ctrl-C reaches the runner only, and kill/stop/cont go
            # to the whole group
            start_new_session=True,
        )


# ---------------------------------------------------------------------------- processes


def _proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces: the state follows the last ')'
    return text.rsplit(")", 1)[1].split()[0]


def _signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


@dataclass
class _Pending:
    action: str
    slot: int
    clock: str
    when: float
    source: str
    by_fault: bool = False


class _Slot:
    """One peer position: its namespace and the processes that ran there one after another."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnations: list[Any] = []  # demo runner's _Peer
        self.stop_recorded = 0
        self.kill_recorded = False
        self.fault_events: list[_Pending] = []

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.incarnations[-1].proc if self.incarnations else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> bool:
        p = self.proc
        return p is not None and p.poll() is None and _proc_state(p.pid) in ("T", "t")

    def next_name(self) -> str:
        k = len(self.incarnations)
        return f"peer{self.index}" if k == 0 else f"peer{self.index}.{k}"


# ---------------------------------------------------------------------------- counters


class _LinkSampler:
    """Samples every link's byte counters into ``links.jsonl`` on a background thread."""

    def __init__(self, net: WanNetwork | None, path: Path, interval_s: float) -> None:
        self.net = net
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="isthmus-lab-links", daemon=True)
        self.first: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.errors = 0

    def sample(self) -> list[dict[str, Any]]:
        ts = round(time.time(), 4)
        out: list[dict[str, Any]] = []
        if self.net is None:
            lo = read_all_counters()["lo"]
            out.append({"ts": ts, "node": "lo", "tx_bytes": lo.tx_bytes, "rx_bytes": lo.rx_bytes})
        else:
            table = read_all_counters(netns=self.net.bridge_netns)
            for node in self.net.nodes:
                port = table.get(node.bridge_port)
                if port is None:
                    continue
                name = "coordinator" if node.role == "coordinator" else f"peer{node.index}"
                # the bridge port's rx is what its node sent, and its tx what the node received
                out.append(
                    {
                        "ts": ts,
                        "node": name,
                        "tx_bytes": port.rx_bytes,
                        "rx_bytes": port.tx_bytes,
                        "tx_packets": port.rx_packets,
                        "rx_packets": port.tx_packets,
                        "rate_mbit": None if node.rate_bps is None else node.rate_bps / 1e6,
                    }
                )
        for r in out:
            self.first.setdefault(r["node"], r)
            self.last[r["node"]] = r
        return out

    def _write(self, records: list[dict[str, Any]]) -> None:
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write(self.sample())
            except (RuntimeError, OSError, ValueError) as e:
                # the network is being torn down under us (Ctrl-C), or ip is slow under load
                self.errors += 1
                log.debug("link sample failed: %s", e)

    def start(self) -> None:
        self._write(self.sample())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self._write(self.sample())


# ---------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _network(
    scenario: Scenario, opts: LabOptions
) -> Iterator[tuple[WanNetwork | None, dict[str, Any]]]:
    rates = [None if r is None else r / 1e6 for r in scenario.network.rates_bps]
    info: dict[str, Any] = {
        "rates_mbit": rates,
        "coordinator_rate_mbit": None
        if scenario.network.coordinator_rate_bps is None
        else scenario.network.coordinator_rate_bps / 1e6,
        "congestion_control": scenario.network.congestion_control,
    }
    if opts.network == "loopback":
        yield None, {**info, "mode": "loopback", "reason": "asked for (--network loopback)"}
        return
    reason = unavailable_reason()
    net: WanNetwork | None = None
    if reason is None:
        net = WanNetwork.from_spec(scenario.network, prefix=opts.prefix)
        try:
            net.start()
        except LabUnavailable as e:
            reason, net = str(e), None
    if net is None:
        if opts.network == "netns":
            raise LabUnavailable(f"the emulated network cannot be built here: {reason}")
        print(
            f"isthmus lab: no emulated network ({reason}); falling back to loopback WITHOUT "
            "shaping: link rates are ignored and bytes cannot be attributed to peers",
            file=sys.stderr,
        )
        yield None, {**info, "mode": "loopback", "reason": reason}
        return
    # started above (to catch LabUnavailable), so closed here rather than with `with net:`
    try:
        yield net, {**info, "mode": "netns", "reason": None, "run_id": net.run_id}
    except BaseException:
        try:
            net.close()
        except LabError as e:
            # the body's exception matters more; the leftovers are reported, not hidden
            print(
                f"isthmus lab: teardown after an error left something behind: {e}", file=sys.stderr
            )
        raise
    net.close()


def _check_strategy(scenario: Scenario, steps: int) -> None:
    """Build the strategy once without a network, so a bad option fails here, before anything
    is created, and not in every peer process (see :func:`~isthmus.demo.runner.check_strategy`)."""
    from isthmus.strategies import STRATEGIES

    name = scenario.strategy.name
    if name not in STRATEGIES:
        raise ValueError(
            f"{scenario.source}: strategy {name!r} is not available in this build of isthmus "
            f"(available: {', '.join(STRATEGIES)})"
        )
    check_strategy(
        name,
        scenario.run.model,
        steps,
        demo_options(name, _options(scenario)),
        compression=scenario.strategy.compression,
        aggregator=scenario.strategy.aggregator,
        byzantine_f=len(scenario.byzantine) if scenario.strategy.aggregator else 0,
    )


def _options(scenario: Scenario) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scenario.strategy.options.items()}


def run_lab(scenario: Scenario, opts: LabOptions | None = None) -> dict[str, Any]:
    """Run ``scenario`` and return its summary (also written to the run directory).

    Raises ``ValueError`` for options or strategy settings that cannot work, ``FileExistsError``
    if the run directory already holds a run, :class:`~isthmus.lab.netns.LabUnavailable` when
    ``network="netns"`` cannot be honoured, and re-raises ``KeyboardInterrupt`` after tearing
    everything down.
    """
    opts = opts or LabOptions()
    if opts.steps is not None:
        run = dataclasses.replace(scenario.run, steps=opts.steps, tokens=None)
        scenario = dataclasses.replace(scenario, run=run)
    steps = scenario_steps(scenario, batch_size=opts.batch_size)
    _check_strategy(scenario, steps)
    starting = _starting_slots(scenario)
    run_dir = Path(opts.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{scenario.run.name}")
    if run_dir.exists() and any(run_dir.glob("*.jsonl")):
        raise FileExistsError(f"{run_dir} already holds a run's results; choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = DemoConfig(
        peers=len(starting),
        strategy=scenario.strategy.name,
        steps=steps,
        strategy_options=_options(scenario),
        compression=scenario.strategy.compression,
        aggregator=scenario.strategy.aggregator,
        byzantine_f=len(scenario.byzantine) if scenario.strategy.aggregator else 0,
        byzantine={b.peer: b.spec for b in scenario.byzantine},
        model=scenario.run.model,
        batch_size=opts.batch_size,
        lr=opts.lr,
        seed=scenario.run.seed,
        corpus_bytes=opts.corpus_bytes,
        run_dir=str(run_dir),
        summary_json=opts.summary_json,
        heartbeat_timeout=opts.heartbeat_timeout,
        collective_timeout=opts.collective_timeout,
        progress=opts.progress,
        timeout_s=opts.timeout_s,
        step_delay=opts.step_delay,
    )
    extra: dict[int, dict[str, Any]] = {
        i: {"eval_every": opts.eval_every} for i in range(scenario.peers)
    }
    for b in scenario.byzantine:
        extra[b.peer]["attack_from_step"] = b.from_step
    (run_dir / "scenario.json").write_text(
        json.dumps(dataclasses.asdict(scenario), indent=1, default=str)
    )
    with _network(scenario, opts) as (net, net_info):
        launcher = LoopbackLauncher(extra) if net is None else NamespaceLauncher(net, extra)
        return _Runner(scenario, opts, cfg, launcher, net, net_info, run_dir, starting).run()


class _Runner:
    def __init__(
        self,
        scenario: Scenario,
        opts: LabOptions,
        cfg: Any,
        launcher: Any,
        net: WanNetwork | None,
        net_info: dict[str, Any],
        run_dir: Path,
        starting: list[int],
    ) -> None:
        self.scenario = scenario
        self.opts = opts
        self.cfg = cfg
        self.launcher = launcher
        self.net = net
        self.net_info = net_info
        self.run_dir = run_dir
        self.starting = starting
        self.slots = [_Slot(i) for i in range(scenario.peers)]
        self.pending: list[_Pending] = []
        self.applied: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.run_step = 0
        self.t0: float | None = None  # time.time() when the first round formed
        self.started = time.monotonic()
        self._churn_file = (run_dir / "churn.jsonl").open("w")

    # -- churn plan ------------------------------------------------------------------------------
    def _plan(self) -> None:
        sc = self.scenario
        for ev in sc.churn:
            fault = ev.clock == "step" and ev.action in ("kill", "stop")
            self.pending.append(
                _Pending(ev.action, ev.peer, ev.clock, ev.when, "scenario", by_fault=fault)
            )
        if sc.random_churn is not None:
            for ev in sc.random_churn.schedule(peers=sc.peers, duration_s=self.opts.timeout_s):
                self.pending.append(_Pending(ev.action, ev.peer, "seconds", ev.when, "random"))
        self.pending.sort(key=lambda p: (p.clock, p.when))

    def _faults_for(self, slot: _Slot, from_step: float) -> list[str]:
        """Step-clock kill/stop events of this slot that the incarnation starting at run step
        ``from_step`` fires on itself: those at or after it, up to its first kill."""
        out: list[str] = []
        for p in sorted(
            (p for p in self.pending if p.by_fault and p.slot == slot.index), key=lambda p: p.when
        ):
            if p.when < from_step:
                continue
            out.append(f"{p.action}@step:step={int(p.when)}")
            self.pending.remove(p)
            slot.fault_events.append(p)
            if p.action == "kill":
                break
        return out

    def _spawn(self, slot: _Slot, from_step: float, coordinator: Any, token: str) -> None:
        name = slot.next_name()
        faults = self._faults_for(slot, from_step)
        peer = _spawn(
            slot.index,
            self.cfg,
            coordinator,
            token,
            self.run_dir,
            self.launcher,
            name=name,
            faults=faults,
        )
        slot.incarnations.append(peer)
        slot.stop_recorded = 0
        slot.kill_recorded = False

    def _record(self, action: str, slot: int, source: str, how: str, *, skipped: str = "") -> None:
        now = time.time()
        rec = {
            "ts": round(now, 4),
            "t": round(now - self.t0, 3) if self.t0 is not None else None,
            "action": action,
            "peer": slot,
            "name": self.slots[slot].incarnations[-1].name
            if self.slots[slot].incarnations
            else None,
            "run_step": self.run_step,
            "source": source,
            "how": how,
        }
        if skipped:
            rec["skipped"] = skipped
            self.skipped.append(rec)
        else:
            self.applied.append(rec)
        self._churn_file.write(json.dumps(rec) + "\n")
        self._churn_file.flush()
        verb = f"skipped {action}" if skipped else action
        log.info("lab: %s peer %d (%s)%s", verb, slot, how, f": {skipped}" if skipped else "")

    def _observe_faults(self) -> None:
        """Record kills and stops the peers fired on themselves."""
        for slot in self.slots:
            p = slot.proc
            if p is None:
                continue
            events = slot.fault_events
            if not slot.kill_recorded and p.poll() == -signal.SIGKILL:
                kill = next((e for e in events if e.action == "kill"), None)
                if kill is not None:
                    slot.kill_recorded = True
                    events.remove(kill)
                    self._record("kill", slot.index, kill.source, f"fault at step {int(kill.when)}")
            elif slot.stopped():
                stops = [e for e in events if e.action == "stop"]
                if stops and slot.stop_recorded == 0:
                    slot.stop_recorded = 1
                    events.remove(stops[0])
                    self._record(
                        "stop", slot.index, stops[0].source, f"fault at step {int(stops[0].when)}"
                    )
            elif slot.stop_recorded:
                slot.stop_recorded = 0  # continued; a later stop fault is recorded again

    def _due(self, p: _Pending) -> bool:
        if p.clock == "step":
            return self.run_step >= p.when
        return self.t0 is not None and time.time() - self.t0 >= p.when

    def _apply(self, p: _Pending, coordinator: Any, token: str) -> bool:
        """Apply a due event; False to keep it pending (its precondition is not met yet)."""
        slot = self.slots[p.slot]
        how = f"at {p.clock} {p.when:g}"
        if p.action == "join":
            if slot.alive():
                if p.source == "random":
                    self._record("join", p.slot, p.source, how, skipped="the peer is running")
                    return True
                return False  # its kill (a fault at a later step) has not fired yet
            self._spawn(slot, p.when if p.clock == "step" else self.run_step, coordinator, token)
            self._record("join", p.slot, p.source, how)
            return True
        if p.action == "cont":
            if slot.stopped():
                _signal_group(slot.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
                slot.stop_recorded = 0
                self._record("cont", p.slot, p.source, how)
                return True
            if slot.alive() and p.source == "scenario":
                return False  # its stop (a fault) has not fired yet
            self._record("cont", p.slot, p.source, how, skipped="the peer is not stopped")
            return True
        if not slot.alive():
            self._record(p.action, p.slot, p.source, how, skipped="the peer is not running")
            return True
        if p.action == "kill":
            self.launcher.kill(slot.proc)
            slot.proc.wait(10)  # type: ignore[union-attr]
            slot.kill_recorded = True
            self._record("kill", p.slot, p.source, how)
            return True
        if slot.stopped():
            self._record("stop", p.slot, p.source, how, skipped="the peer is already stopped")
            return True
        _signal_group(slot.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        slot.stop_recorded = 1
        self._record("stop", p.slot, p.source, how)
        return True

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import secrets

        from isthmus.coordinator.membership import MembershipConfig
        from isthmus.coordinator.server import Coordinator, CoordinatorConfig

        cfg = self.cfg
        self._plan()
        token = secrets.token_hex(16)
        with self.launcher.coordinator_context():
            coordinator = Coordinator(
                CoordinatorConfig(
                    token=token,
                    host=self.launcher.coordinator_host,
                    port=0,
                    membership=MembershipConfig(
                        start_peers=cfg.peers,
                        start_timeout=120.0,
                        heartbeat_timeout=cfg.heartbeat_timeout,
                        commit_timeout=max(60.0, 4 * cfg.collective_timeout),
                    ),
                    heartbeat_interval=min(0.5, cfg.heartbeat_timeout / 3),
                )
            ).start()
        sampler = _LinkSampler(self.net, self.run_dir / "links.jsonl", self.opts.sample_interval_s)
        peers: list[Any] = []
        try:
            sampler.start()
            for i in self.starting:
                self._spawn(self.slots[i], 0, coordinator, token)
            initial_loss, n_params = _initial_eval_loss(cfg)
            self._watch(coordinator, token)
        finally:
            for slot in self.slots:
                p = slot.proc
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        _signal_group(p.pid, signal.SIGCONT)
                    self.launcher.kill(p)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(10)
            sampler.stop()
            events = coordinator.events()
            status = coordinator.status()
            coordinator.stop()
            self._churn_file.close()
        for slot in self.slots:
            peers.extend(slot.incarnations)
        wall = time.monotonic() - self.started
        summary = _summarize(cfg, peers, events, status, self.run_dir, initial_loss, n_params, wall)
        summary.update(self._lab_summary(peers, events, sampler))
        _write_outputs(cfg, peers, events, summary, self.run_dir)
        self._append_report(summary)
        return summary

    def _watch(self, coordinator: Any, token: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        console = Console(stderr=True)
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("peers {task.fields[peers]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.opts.progress,
        )
        deadline = time.monotonic() + self.opts.timeout_s
        with progress:
            task = progress.add_task(
                self.scenario.run.name, total=self.cfg.steps, loss="-", peers=0
            )
            while True:
                alive = [s for s in self.slots if s.alive()]
                if not alive:
                    break
                # with every remaining peer frozen the run step cannot advance: only a timed cont
                # (or one already due) can still wake one
                if all(s.stopped() for s in alive) and not any(
                    p.action == "cont" and (p.clock == "seconds" or self._due(p))
                    for p in self.pending
                ):
                    console.print("every remaining peer is stopped and none will continue: ending")
                    break
                if time.monotonic() > deadline:
                    console.print(f"[red]lab run timed out after {self.opts.timeout_s:.0f}s")
                    break
                st = coordinator.status(events=0)
                if self.t0 is None and st["epoch"] >= 1:
                    self.t0 = time.time()
                active = [p for p in st["peers"] if p["state"] == "active"]
                steps = [int(p["info"].get("step", 0)) for p in active]
                self.run_step = max([self.run_step, *steps])
                self._observe_faults()
                for p in list(self.pending):
                    if self._due(p) and self._apply(p, coordinator, token):
                        self.pending.remove(p)
                losses = [float(p["info"]["loss"]) for p in active if "loss" in p["info"]]
                fields: dict[str, Any] = {"peers": st["world"]}
                if losses:
                    fields["loss"] = f"{sum(losses) / len(losses):.3f}"
                progress.update(task, completed=min(self.run_step, self.cfg.steps), **fields)
                time.sleep(0.1)
            self._observe_faults()
            for p in self.pending:
                if p.clock == "seconds" and p.source == "random":
                    continue  # scheduled past the end of the run: never due
                self._record(
                    p.action,
                    p.slot,
                    p.source,
                    f"at {p.clock} {p.when:g}",
                    skipped="the run ended first",
                )
            for slot in self.slots:
                for p in slot.fault_events:
                    self._record(
                        p.action,
                        slot.index,
                        p.source,
                        f"fault at step {int(p.when)}",
                        skipped="the peer never reached that step",
                    )
            progress.update(task, completed=self.cfg.steps)

    # -- measurements ----------------------------------------------------------------------------
    def _lab_summary(
        self, peers: list[Any], events: list[dict[str, Any]], sampler: _LinkSampler
    ) -> dict[str, Any]:
        epochs = [e for e in events if e["kind"] == "epoch"]
        t0 = epochs[0]["ts"] if epochs else (self.t0 or time.time())
        finals: dict[str, dict[str, Any]] = {}
        accounted: dict[str, int] = {}
        records: dict[str, list[dict[str, Any]]] = {}
        for p in peers:
            records[p.name] = _read_jsonl(self.run_dir / f"{p.name}.jsonl")
            f = self.run_dir / f"{p.name}.final.json"
            if f.exists():
                finals[p.name] = json.loads(f.read_text())
                accounted[p.name] = int(finals[p.name]["bytes_sent"])
            elif records[p.name]:
                accounted[p.name] = int(records[p.name][-1]["bytes_sent"])
            else:
                accounted[p.name] = 0
        per_slot_accounted = {
            f"peer{s.index}": sum(accounted[p.name] for p in s.incarnations) for s in self.slots
        }
        out: dict[str, Any] = {
            "scenario": {
                "name": self.scenario.run.name,
                "source": self.scenario.source,
                "description": self.scenario.description,
            },
            "network": {
                **self.net_info,
                "rates": [format_rate(r) for r in self.scenario.network.rates_bps],
            },
            "churn_applied": self.applied,
            "churn_skipped": self.skipped,
            "bytes_check": _bytes_check(sampler, per_slot_accounted, self.net is not None),
            "round_latency_s": _round_latency(finals),
            "world_size": [[round(e["ts"] - t0, 3), e["world"]] for e in epochs],
            "time_lost_to_recovery_s": _time_lost(events, self.applied, t0),
            "train_wall_s": _train_wall(records, t0),
            "eval": _eval_curve(records, t0, self.opts.target_loss),
            "link_samples": sum(1 for _ in (self.run_dir / "links.jsonl").open())
            if (self.run_dir / "links.jsonl").exists()
            else 0,
        }
        kills = [a for a in self.applied if a["action"] == "kill"]
        out["kills"] = len(kills)
        return out

    def _append_report(self, s: dict[str, Any]) -> None:
        report = self.run_dir / "report.md"
        if not report.exists():
            return
        net = s["network"]
        lines = [
            "",
            "## Lab",
            "",
            f"Scenario `{s['scenario']['source']}`: {s['scenario']['description'].strip()}",
            "",
            f"Network: **{net['mode']}**"
            + (f" (fell back: {net['reason']})" if net["mode"] == "loopback" else "")
            + f"; peer links {', '.join(net['rates'])}.",
            "",
        ]
        bc = s["bytes_check"]
        if bc.get("per_peer"):
            lines += [
                "| peer | wire tx (B) | payload on the wire (B) | isthmus accounting (B) "
                "| wire vs accounting | payload vs accounting |",
                "|---|---|---|---|---|---|",
            ]

            def pct(x: float | None) -> str:
                return "-" if x is None else f"{100 * x:+.1f}%"

            for name, r in bc["per_peer"].items():
                lines.append(
                    f"| {name} | {r['wire_tx_bytes']:,} | {r['wire_payload_bytes']:,} | "
                    f"{r['accounted_bytes']:,} | {pct(r['rel_diff'])} | "
                    f"{pct(r['rel_diff_payload'])} |"
                )
            lines += [
                "",
                f"Data plane (payload minus control plane) vs accounting, all peers: "
                f"{pct(bc['rel_diff_data_plane'])}. {bc['note']}",
                "",
            ]
        else:
            lines += [bc["note"], ""]
        if s["churn_applied"] or s["churn_skipped"]:
            lines += ["| t (s) | action | peer | how |", "|---|---|---|---|"]
            for c in s["churn_applied"] + s["churn_skipped"]:
                how = c["how"] + (f" (skipped: {c['skipped']})" if "skipped" in c else "")
                lines.append(f"| {c['t']} | {c['action']} | {c['peer']} | {how} |")
            lines.append("")
        with report.open("a") as f:
            f.write("\n".join(lines) + "\n")


def _rel(a: float, b: float) -> float | None:
    return None if b <= 0 else round((a - b) / b, 4)


FRAME_HEADER_BYTES = 66
"""Bytes of headers on every TCP segment on the emulated links: Ethernet 14 + IPv4 20 + TCP 32
(20 plus the 12-byte timestamp option Linux uses by default). A pure ACK is exactly this."""


def _payload(bytes_: int, packets: int) -> int:
    return bytes_ - FRAME_HEADER_BYTES * packets


def _bytes_check(
    sampler: _LinkSampler, accounted: dict[str, int], per_peer: bool
) -> dict[str, Any]:
    """Wire bytes (interface counters) against isthmus's accounting, per peer and in total.

    ``wire_tx_bytes`` is what the link carried; ``wire_payload_bytes`` removes one
    :data:`FRAME_HEADER_BYTES` per packet (so pure ACKs count zero), leaving the TCP payload;
    the control plane (whatever the coordinator received) is subtracted for the data-plane total.
    """
    acc_total = sum(accounted.values())
    if not per_peer:
        lo0, lo1 = sampler.first.get("lo"), sampler.last.get("lo")
        lo = (lo1["tx_bytes"] - lo0["tx_bytes"]) if lo0 and lo1 else None
        return {
            "accounted_total": acc_total,
            "loopback_bytes": lo,
            "note": "loopback fall-back: every process on this machine shares `lo`, so its "
            "counter cannot be attributed to peers (shown for reference only).",
        }

    def delta(name: str, key: str) -> int:
        a, b = sampler.first.get(name), sampler.last.get(name)
        return int(b[key] - a[key]) if a is not None and b is not None else 0

    rows: dict[str, dict[str, Any]] = {}
    for name, acc in accounted.items():
        if name not in sampler.last:
            continue
        tx, rx = delta(name, "tx_bytes"), delta(name, "rx_bytes")
        payload = _payload(tx, delta(name, "tx_packets"))
        rows[name] = {
            "wire_tx_bytes": tx,
            "wire_rx_bytes": rx,
            "wire_tx_packets": delta(name, "tx_packets"),
            "wire_payload_bytes": payload,
            "accounted_bytes": acc,
            "rel_diff": _rel(tx, acc),
            "rel_diff_payload": _rel(payload, acc),
        }
    ctl_up = delta("coordinator", "rx_bytes")
    ctl_up_payload = _payload(ctl_up, delta("coordinator", "rx_packets"))
    wire_total = sum(r["wire_tx_bytes"] for r in rows.values())
    payload_total = sum(r["wire_payload_bytes"] for r in rows.values())
    data_plane = payload_total - ctl_up_payload
    return {
        "per_peer": rows,
        "wire_tx_total": wire_total,
        "accounted_total": acc_total,
        "rel_diff_total": _rel(wire_total, acc_total),
        "control_plane_up_bytes": ctl_up,
        "control_plane_down_bytes": delta("coordinator", "tx_bytes"),
        "data_plane_payload_bytes": data_plane,
        "rel_diff_data_plane": _rel(data_plane, acc_total),
        "note": "wire = the peer's link counters: Ethernet/IP/TCP headers, the ACKs for what it "
        "received and its control traffic to the coordinator included. payload = wire minus "
        f"{FRAME_HEADER_BYTES} header bytes per packet. accounting = the payload isthmus's Group "
        "counted. The data-plane figure also subtracts the control plane (heartbeats, round "
        "requests, rendezvous store: the payload the coordinator received).",
    }


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def _round_latency(finals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Committed rounds' duration (round formed to commit answered), the slowest peer per round."""
    per_round: dict[int, float] = {}
    aborted: dict[tuple[int, int], float] = {}
    for f in finals.values():
        for r in f.get("rounds", []):
            d = float(r["t_end"]) - float(r["t_start"])
            if r["outcome"] == "committed":
                per_round[r["round"]] = max(per_round.get(r["round"], 0.0), d)
            else:
                key = (r["round"], r["epoch"])
                aborted[key] = max(aborted.get(key, 0.0), d)
    xs = list(per_round.values())
    if not xs:
        return {"rounds": 0}
    return {
        "rounds": len(xs),
        "mean": round(sum(xs) / len(xs), 4),
        "p50": round(_percentile(xs, 0.5), 4),
        "p90": round(_percentile(xs, 0.9), 4),
        "max": round(max(xs), 4),
        "aborted_attempts": len(aborted),
        "aborted_attempts_s": round(sum(aborted.values()), 3),
    }


def _time_lost(
    events: list[dict[str, Any]], applied: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """For each failure (a kill or stop applied, or an eviction), the seconds until the next
    committed round after it; overlapping windows are merged for the total."""
    commits = sorted(e["ts"] for e in events if e["kind"] == "commit")
    starts = [a["ts"] for a in applied if a["action"] in ("kill", "stop")]
    starts += [e["ts"] for e in events if e["kind"] == "dead"]
    windows = []
    for s in sorted(starts):
        nxt = next((c for c in commits if c > s), None)
        if nxt is not None:
            windows.append((s, nxt))
    total, end = 0.0, -math.inf
    for s, e in windows:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return {
        "total": round(total, 3),
        "windows": [[round(s - t0, 3), round(e - s, 3)] for s, e in windows],
    }


def _train_wall(records: dict[str, list[dict[str, Any]]], t0: float) -> float | None:
    last = [r["ts"] for recs in records.values() for r in recs if "ts" in r]
    return round(max(last) - t0, 3) if last else None


def _eval_curve(
    records: dict[str, list[dict[str, Any]]], t0: float, target: float | None
) -> dict[str, Any]:
    """Mean eval loss over peers at each eval step, with when it was reached, and the first time
    it fell to ``target``."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for recs in records.values():
        for r in recs:
            if "eval_loss" in r and math.isfinite(r["eval_loss"]):
                by_step.setdefault(int(r["step"]), []).append((float(r["eval_loss"]), r["ts"]))
    curve = []
    for step in sorted(by_step):
        vals = by_step[step]
        curve.append(
            [
                step,
                round(max(ts for _, ts in vals) - t0, 3),
                round(sum(v for v, _ in vals) / len(vals), 5),
            ]
        )
    out: dict[str, Any] = {"curve": curve, "target_loss": target}
    if target is not None:
        hit = next((c for c in curve if c[2] <= target), None)
        out["time_to_target_s"] = hit[1] if hit else None
        out["step_at_target"] = hit[0] if hit else None
    return out
