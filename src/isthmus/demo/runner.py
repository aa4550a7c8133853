"""``isthmus demo``: an embedded coordinator and N local peer processes training the tiny GPT.

The demo is the main end-to-end job. It starts a coordinator in this process, launches one
``python -m isthmus.job`` process per peer, shows a live progress bar (step, loss, peers, bytes),
applies the requested faults (``--kill PEER@STEP`` is a SIGKILL the peer fires on itself at that
step; ``--join STEP`` launches a new peer once the run reaches that step), and at the end checks
that every surviving peer holds bit-identical shared state, prints a summary and writes a run
directory: ``metrics.jsonl`` (every peer's per-step records), ``events.jsonl`` (the
coordinator's membership events), ``summary.json``, per-peer logs and a loss plot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from isthmus.comm.group import wire_bytes
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.job import TrainJob, build_corpus, model_config

__all__ = ["DemoConfig", "check_strategy", "run_demo"]

log = logging.getLogger("isthmus.demo")

DEFAULT_STEPS = {"ddp": 150, "diloco": 200}
# Strategies that sync every H inner steps; the demo's short runs use H = 20 (their library
# defaults, 48-50, suit long runs). Streaming DiLoCo then syncs one of 2 fragments every 10 steps.
PERIODIC = ("diloco", "localsgd", "streaming", "eager", "co2")


def demo_options(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the demo's (and the lab's) short-run default H = 20 for the periodic
    strategies when they do not name ``sync_every``."""
    if strategy in PERIODIC and "sync_every" not in options:
        return {**options, "sync_every": 20}
    return dict(options)


def check_strategy(
    name: str,
    model: str,
    steps: int,
    options: dict[str, Any],
    *,
    compression: str | None = None,
    aggregator: str | None = None,
    byzantine_f: int = 0,
) -> None:
    """Build the strategy once, without a network, exactly as every peer will (the run's length
    added for gossip, as :func:`isthmus.job._strategy_options` does), so a bad option, a bad
    compressor or aggregator spec or an impossible fragment count fails here with the factory's
    message instead of crashing every peer process. Raises ``ValueError``."""
    import torch

    from isthmus.models import GPT
    from isthmus.strategies import make_strategy

    opts = dict(options)
    if name == "gossip":
        opts.setdefault("total_steps", steps)
    net = GPT(model_config(model), seed=0)
    s = make_strategy(
        name,
        None,
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-3),
        compression=compression,
        aggregator=aggregator,
        byzantine_f=byzantine_f,
        **opts,
    )
    with contextlib.suppress(Exception):  # nothing to settle without a session
        s.finish()


@dataclass(kw_only=True)
class DemoConfig:
    """Settings of one demo run (the command line fills these)."""

    peers: int = 3
    strategy: str = "diloco"
    steps: int | None = None
    """Training steps for the run (default: 150 for ddp, 200 for the others)."""
    kills: list[tuple[int, int]] = field(default_factory=list)
    """(peer index, step) pairs: that peer SIGKILLs itself when it reaches the step."""
    joins: list[int] = field(default_factory=list)
    """Steps at which a new peer process is launched."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    compression: str | None = None
    aggregator: str | None = None
    byzantine_f: int = 0
    model: str = "default"
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0
    corpus_bytes: int = 2_000_000
    shard: str = "interleaved"
    """How the corpus is split across peers: ``interleaved`` (IID) or ``contiguous`` (each peer
    a different part of the corpus: non-IID)."""
    run_dir: str | None = None
    summary_json: str | None = None
    heartbeat_timeout: float = 3.0
    collective_timeout: float = 30.0
    step_delay: float = 0.0
    progress: bool = True
    timeout_s: float = 1800.0
    """Bound on the whole run; peers still running after it are killed."""
    extra_faults: dict[int, list[str]] = field(default_factory=dict)
    """More fault specs per peer index (see :mod:`isthmus.comm.faults`), for tests and the lab."""
    byzantine: dict[int, str] = field(default_factory=dict)
    """Peer index -> attack spec: that peer sends forged updates (see TrainJob.attack)."""

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"--peers must be >= 1, got {self.peers}")
        if self.steps is None:
            self.steps = DEFAULT_STEPS.get(self.strategy, 200)
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.shard not in ("interleaved", "contiguous"):
            raise ValueError(f"--shard must be interleaved or contiguous, got {self.shard!r}")
        from isthmus.strategies import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        self.strategy_options = demo_options(self.strategy, self.strategy_options)
        # Fail here, not in every peer process, on bad options or specs.
        check_strategy(
            self.strategy,
            self.model,
            self.steps,
            self.strategy_options,
            compression=self.compression,
            aggregator=self.aggregator,
            byzantine_f=self.byzantine_f,
        )
        from isthmus.comm.faults import Fault
        from isthmus.reduce.aggregate.attacks import make_attack

        # (which peers exist is the caller's to check: the lab numbers peers that join later)
        for spec in self.byzantine.values():
            make_attack(spec)
        for specs in self.extra_faults.values():
            for spec in specs:
                Fault.parse(spec)
        for peer, step in self.kills:
            if not 0 <= peer < self.peers + len(self.joins):
                raise ValueError(
                    f"--kill {peer}@{step}: there is no peer {peer} (peers are numbered from 0; "
                    f"{self.peers} start and {len(self.joins)} join)"
                )
            if not 0 <= step < self.steps:
                raise ValueError(f"--kill {peer}@{step}: step must be in 0..{self.steps - 1}")
        for step in self.joins:
            if not 0 <= step < self.steps:
                raise ValueError(f"--join {step}: step must be in 0..{self.steps - 1}")
        if len(self.kills) >= self.peers + len(self.joins):
            raise ValueError("every peer would be killed: leave at least one alive")


class _Peer:
    def __init__(
        self, index: int, job: TrainJob, proc: subprocess.Popen[bytes], started: float
    ) -> None:
        self.index = index
        self.job = job
        self.proc = proc
        self.started = started
        # killed by the demo's own teardown (timeout, Ctrl-C), not by a requested fault
        self.torn_down = False

    @property
    def name(self) -> str:
        return self.job.name


class LocalLauncher:
    """Starts peer processes on this machine. The lab subclasses it to start each peer in its own
    network namespace (and to point Gloo at that namespace's interface via ``job_fields``)."""

    coordinator_host = "127.0.0.1"

    def job_fields(self, index: int) -> dict[str, Any]:
        """Extra :class:`TrainJob` fields for peer ``index`` (e.g. ``hostname``)."""
        return {}

    def coordinator_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around starting the embedded coordinator (the lab enters the coordinator's
        network namespace there, so that it listens on the emulated network)."""
        return contextlib.nullcontext()

    def popen(self, index: int, argv: list[str], log: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the peers itself
        )

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _spawn(
    index: int,
    cfg: DemoConfig,
    coordinator: Coordinator,
    token: str,
    run_dir: Path,
    launcher: LocalLauncher,
    *,
    name: str | None = None,
    faults: list[str] | None = None,
) -> _Peer:
    """Launch peer ``index`` (``name`` default ``peer<index>``; ``faults`` default: this peer's
    ``--kill`` steps plus ``cfg.extra_faults``)."""
    if faults is None:
        faults = [f"kill@step:step={s}" for p, s in cfg.kills if p == index]
        faults += cfg.extra_faults.get(index, [])
    job = TrainJob(
        coordinator=coordinator.address,
        token=token,
        name=name or f"peer{index}",
        out_dir=str(run_dir),
        strategy=cfg.strategy,
        strategy_options=dict(cfg.strategy_options),
        compression=cfg.compression,
        aggregator=cfg.aggregator,
        byzantine_f=cfg.byzantine_f,
        steps=cfg.steps or 1,
        model=cfg.model,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
        corpus_bytes=cfg.corpus_bytes,
        shard=cfg.shard,
        faults=faults,
        collective_timeout=cfg.collective_timeout,
        step_delay=cfg.step_delay,
        attack=cfg.byzantine.get(index),
        **launcher.job_fields(index),
    )
    path = run_dir / f"{job.name}.job.json"
    path.write_text(job.to_json())
    logf = (run_dir / f"{job.name}.log").open("wb")
    proc = launcher.popen(index, [sys.executable, "-m", "isthmus.job", str(path)], logf)
    logf.close()
    return _Peer(index, job, proc, time.monotonic())


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _initial_eval_loss(cfg: DemoConfig) -> tuple[float, int]:
    import torch

    from isthmus.data import evaluate
    from isthmus.models import GPT

    torch.set_num_threads(1)
    job = TrainJob(
        coordinator="x:1",
        token="x",
        name="init",
        out_dir=".",
        model=cfg.model,
        corpus_bytes=cfg.corpus_bytes,
        seed=cfg.seed,
    )
    corpus = build_corpus(job)
    model = GPT(model_config(cfg.model), seed=cfg.seed)
    return evaluate(
        model, corpus, batch_size=cfg.batch_size, n_batches=job.eval_batches
    ), model.num_parameters()


def run_demo(cfg: DemoConfig, *, launcher: LocalLauncher | None = None) -> dict[str, Any]:
    """Run the demo end to end and return the summary (also written to the run directory).

    ``launcher`` starts the peer processes (default: plain local processes)."""
    launcher = launcher or LocalLauncher()
    t_start = time.monotonic()
    run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}")
    if run_dir.exists() and any(run_dir.glob("*.jsonl")):
        raise FileExistsError(f"{run_dir} already holds a run's results; choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    with launcher.coordinator_context():
        coordinator = Coordinator(
            CoordinatorConfig(
                token=token,
                host=launcher.coordinator_host,
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
    peers: list[_Peer] = []
    pending_joins = sorted(cfg.joins)
    try:
        for i in range(cfg.peers):
            peers.append(_spawn(i, cfg, coordinator, token, run_dir, launcher))
        initial_loss, n_params = _initial_eval_loss(cfg)
        _watch(cfg, coordinator, peers, pending_joins, token, run_dir, initial_loss, launcher)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping peers", file=sys.stderr)
        raise
    finally:
        for p in peers:
            if p.proc.poll() is None:
                p.torn_down = True
                launcher.kill(p.proc)
                # bounded, and never stops the teardown of the others and the coordinator
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(10)
        events = coordinator.events()
        status = coordinator.status()
        coordinator.stop()
    summary = _summarize(
        cfg, peers, events, status, run_dir, initial_loss, n_params, time.monotonic() - t_start
    )
    _write_outputs(cfg, peers, events, summary, run_dir)
    return summary


def _watch(
    cfg: DemoConfig,
    coordinator: Coordinator,
    peers: list[_Peer],
    pending_joins: list[int],
    token: str,
    run_dir: Path,
    initial_loss: float,
    launcher: LocalLauncher,
) -> None:
    """Poll until every peer process has exited, launching joiners and updating the display."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("peers {task.fields[peers]}"),
        TextColumn("sent {task.fields[sent]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not cfg.progress,
        transient=False,
    )
    deadline = time.monotonic() + cfg.timeout_s
    next_index = cfg.peers
    with progress:
        task = progress.add_task(
            cfg.strategy, total=cfg.steps, loss=f"{initial_loss:.3f}", peers=0, sent="0 B"
        )
        while any(p.proc.poll() is None for p in peers):
            if time.monotonic() > deadline:
                console.print(f"[red]demo timed out after {cfg.timeout_s:.0f}s; stopping peers")
                break
            st = coordinator.status(events=0)
            active = [p for p in st["peers"] if p["state"] == "active"]
            step = max((int(p["info"].get("step", 0)) for p in st["peers"]), default=0)
            losses = [float(p["info"]["loss"]) for p in active if "loss" in p["info"]]
            sent = sum(int(p["info"].get("bytes_sent", 0)) for p in st["peers"])
            while pending_joins and step >= pending_joins[0]:
                pending_joins.pop(0)
                peers.append(_spawn(next_index, cfg, coordinator, token, run_dir, launcher))
                console.print(f"step {step}: peer{next_index} joins")
                next_index += 1
            fields: dict[str, Any] = {"sent": _fmt_bytes(sent)}
            if losses:
                fields["loss"] = f"{sum(losses) / len(losses):.3f}"
            if active:
                fields["peers"] = st["world"]
            progress.update(task, completed=min(step, cfg.steps or step), **fields)
            time.sleep(0.25)
        progress.update(task, completed=cfg.steps)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _summarize(
    cfg: DemoConfig,
    peers: list[_Peer],
    events: list[dict[str, Any]],
    status: dict[str, Any],
    run_dir: Path,
    initial_loss: float,
    n_params: int,
    wall_s: float,
) -> dict[str, Any]:
    finals: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    for p in peers:
        records[p.name] = _read_jsonl(run_dir / f"{p.name}.jsonl")
        f = run_dir / f"{p.name}.final.json"
        if p.proc.returncode == 0 and f.exists():
            finals[p.name] = json.loads(f.read_text())
    # Bit-identical at the end: the shared state and the model parameters (the latter matters for
    # strategies whose shared state does not hold the parameters, e.g. gossip after its merge).
    digests = [(f["digest"], f.get("model_digest")) for f in finals.values()]
    majority = max(set(digests), key=digests.count) if digests else None
    in_parity = [n for n, f in finals.items() if (f["digest"], f.get("model_digest")) == majority]
    counters = status.get("counters", {})
    # Bytes: finished peers report exactly; killed peers' last per-step record is the best known.
    sent = 0
    for p in peers:
        if p.name in finals:
            sent += int(finals[p.name]["bytes_sent"])
        elif records[p.name]:
            sent += int(records[p.name][-1]["bytes_sent"])
    # What plain data parallel would have sent for the same steps and the same membership.
    param_bytes = n_params * 4
    world_at: dict[int, int] = {}
    for recs in records.values():
        for r in recs:
            world_at[r["step"]] = max(world_at.get(r["step"], 0), int(r["world"]))
    ddp_equiv = sum(w * wire_bytes("all_reduce", param_bytes, w) for w in world_at.values())
    # every peer that died by SIGKILL (--kill, or a kill in --fault); not those the demo's
    # teardown stopped (a run that timed out)
    killed = [p for p in peers if p.proc.returncode == -signal.SIGKILL and not p.torn_down]
    recovery = _recovery_times(events, killed)
    final_losses = [f["eval_loss"] for n, f in finals.items() if n in in_parity]
    return {
        "strategy": cfg.strategy,
        "strategy_options": cfg.strategy_options,
        "compression": cfg.compression or "none",
        "aggregator": cfg.aggregator or "mean",
        "steps": cfg.steps,
        "model_parameters": n_params,
        "initial_eval_loss": round(initial_loss, 6),
        "final_eval_loss": round(final_losses[0], 6) if final_losses else None,
        "rounds_committed": int(counters.get("rounds_committed", 0)),
        "rounds_aborted": int(counters.get("rounds_aborted", 0)),
        "parity_checks": int(counters.get("parity_checks", 0)),
        "parity_failures": int(counters.get("parity_failures", 0)) + (len(finals) - len(in_parity)),
        "resyncs": int(counters.get("resyncs", 0)),
        "peers_final": len(in_parity),
        "peers_started": len(peers),
        "kills": len(killed),
        "joins": len(peers) - cfg.peers,
        "bytes_sent_total": sent,
        "bytes_sent_ddp_equivalent": ddp_equiv,
        "recovery_s": recovery,
        "peak_bytes_per_round": max(
            (int(r.get("bytes", 0)) for f in finals.values() for r in f["rounds"]), default=0
        ),
        "bytes_by_op": _sum_dicts([f.get("bytes_by_op", {}) for f in finals.values()]),
        "overlap_fraction": round(
            sum(f["strategy"].get("overlap_fraction", 0.0) for f in finals.values()) / len(finals),
            4,
        )
        if finals
        else 0.0,
        "nonfinite_skips": sum(f["strategy"].get("nonfinite_skips", 0) for f in finals.values()),
        # rounds whose agreed update was not applied (non-finite sum, rule could not run); every
        # peer skips alike, so the largest count is the run's
        "rejected_updates": max(
            (f["strategy"].get("rejected_updates", 0) for f in finals.values()), default=0
        ),
        "byzantine": {f"peer{i}": a for i, a in cfg.byzantine.items()},
        "final_digest": majority[0] if majority else None,
        "final_model_digest": majority[1] if majority else None,
        "wall_s": round(wall_s, 2),
        "run_dir": str(run_dir),
        "exit_codes": {p.name: p.proc.returncode for p in peers},
        "late_joiners": [p.name for p in peers if p.proc.returncode == 4],
    }


def _sum_dicts(ds: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _recovery_times(events: list[dict[str, Any]], killed: list[_Peer]) -> list[float]:
    """Seconds from each killed peer's eviction to the next committed round."""
    names = {p.name for p in killed}
    out = []
    for i, e in enumerate(events):
        if e["kind"] == "dead" and e.get("name") in names:
            nxt = next((x for x in events[i + 1 :] if x["kind"] == "commit"), None)
            if nxt is not None:
                out.append(round(nxt["t"] - e["t"], 3))
    return out


def _write_outputs(
    cfg: DemoConfig,
    peers: list[_Peer],
    events: list[dict[str, Any]],
    summary: dict[str, Any],
    run_dir: Path,
) -> None:
    with (run_dir / "metrics.jsonl").open("w") as f:
        for p in peers:
            for r in _read_jsonl(run_dir / f"{p.name}.jsonl"):
                f.write(json.dumps({"peer": p.name, **r}) + "\n")
    with (run_dir / "events.jsonl").open("w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    text = json.dumps(summary, indent=1)
    (run_dir / "summary.json").write_text(text)
    if cfg.summary_json:
        Path(cfg.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.summary_json).write_text(text)
    with contextlib.suppress(Exception):
        from isthmus.lab.report import plot_run

        plot_run(run_dir)
