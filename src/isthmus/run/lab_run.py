"""``isthmus lab run``: one scenario end to end, the same launcher inside network namespaces.

What happens, in order:

1. **Config.** The scenario's :class:`~isthmus.run.config.RunConfig` (read with it by
   :func:`~isthmus.lab.scenario.load_scenario`) gets the command line's overrides
   (:func:`lab_config`), validated before anything is built.
2. **Network.** :func:`~isthmus.lab.links.open_network` builds one namespace per peer and one for
   the coordinator on a bridge, each link shaped with tc tbf at the scenario's rate, or falls back
   to loopback without shaping and says so (``network.mode`` in the summary), unless ``netns``
   was demanded.
3. **Coordinator.** Embedded in this process, as in the demo, but started from *inside* the
   coordinator's namespace (:class:`NamespaceSpawner`): its sockets live there, reachable at the
   bridge address from every peer namespace, while this process's main thread stays in the host
   namespace to run ``ip``/``tc``, read counters and own the teardown (one process owns the
   network, so :class:`~isthmus.lab.wan.WanNetwork`'s teardown covers every exit path).
4. **Peers** run the built-in job inside their namespaces, Gloo bound to the namespace's address,
   through :func:`~isthmus.run.builtin_run.run_builtin`, the demo's own path; or, when the
   scenario names a script (``[job]``, ``isthmus lab run --script``), the user's own peer script
   through :func:`~isthmus.run.script_run.launch_script`, the path of ``isthmus run``, with
   ``ISTHMUS_HOSTNAME`` and the run's ``ISTHMUS_CONNECTIONS``/``ISTHMUS_PROBE_LINKS`` in its
   environment. Both go through the one :class:`~isthmus.run.launch.Launcher`.
5. **Churn and faults.** The scenario's ``[[churn]]`` and ``[random_churn]`` become a
   :class:`~isthmus.lab.churn_plan.ChurnPlan` applied by :class:`~isthmus.run.churn_hook.ChurnHook`
   (:func:`lab_churn`); timed events count from the first round. In the built-in job
   ``kill``/``stop`` at a step are faults the peer fires on itself, and ``[[fault]]`` entries go
   to each slot's first process; a script's step-clock kills and stops are applied from outside
   once a peer reported the step, and a script cannot take ``[[fault]]`` or ``[[byzantine]]``
   (refused before anything starts, :mod:`isthmus.lab.jobspec`).
6. **Measurements.** :class:`~isthmus.lab.links.LinkSampler` records every link's counters; the
   summary gets a :class:`~isthmus.run.record.LabSummary` (bytes on the wire against isthmus's
   accounting, round latency, world size, time lost to recovery, eval curve), and ``report.md``
   a lab section.

Failures: a bad scenario or override raises a :class:`~isthmus.spec.SpecError` (a ValueError)
before anything starts; a network that cannot be built raises :class:`~isthmus.lab.netns.LabError`
(or falls back, see 2). Ctrl-C and errors tear the network down and stop every peer first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab.churn_plan import Planned
from isthmus.lab.jobspec import JobSpec
from isthmus.lab.links import NETWORK_MODES, LinkSampler, open_network
from isthmus.lab.netns import inside_namespace
from isthmus.lab.rates import format_rate
from isthmus.lab.scenario import Scenario
from isthmus.lab.wan import WanNetwork
from isthmus.run import measure
from isthmus.run.builtin_run import publish, run_builtin, with_short_h
from isthmus.run.churn_hook import ChurnHook
from isthmus.run.config import RunConfig, apply_overrides
from isthmus.run.launch import Hook, Launcher, Outcome, Script, Spawner
from isthmus.run.record import LabSummary, RunDir, Summary
from isthmus.run.script_run import StepRecords, launch_script
from isthmus.settings import Checked, setting

__all__ = [
    "LabOptions",
    "NamespaceSpawner",
    "lab_churn",
    "lab_config",
    "lab_script",
    "run_lab",
    "scenario_steps",
]


@dataclass(kw_only=True)
class LabOptions(Checked):
    """How to run a scenario where the scenario file and the run config say nothing."""

    network: str = setting(
        "auto",
        choices=NETWORK_MODES,
        help="""auto: namespaces if possible, else loopback (with a message); netns: namespaces
        or fail (LabUnavailable); loopback: never build namespaces (no shaping, no per-peer
        counters).""",
    )
    prefix: str = setting(
        "isth", help="Prefix of the namespace names (1-12 lowercase letters/digits)."
    )
    sample_interval_s: float = setting(
        0.5, gt=0, help="How often link counters are sampled into links.jsonl (seconds)."
    )
    tee: bool = setting(
        True,
        help="""With a user's script: print what its peers write, each line prefixed with its
        peer, as `isthmus run` does (the run directory's logs hold it either way). The built-in
        job's peers are never echoed.""",
    )


def scenario_steps(scenario: Scenario, *, batch_size: int) -> int:
    """Inner steps per peer for the scenario: ``run.steps``, or ``run.tokens`` divided by the
    tokens one step of all starting peers consumes (peers at the start x batch x block size)."""
    return scenario.steps_for(batch_size=batch_size)


def _events(scenario: Scenario, duration_s: float) -> list[Planned]:
    out = [
        Planned(action=e.action, slot=e.peer, clock=e.clock, when=e.when, source="scenario")  # type: ignore[arg-type]
        for e in scenario.churn
    ]
    if scenario.random_churn is not None:
        for e in scenario.random_churn.schedule(peers=scenario.peers, duration_s=duration_s):
            out.append(
                Planned(action=e.action, slot=e.peer, clock="seconds", when=e.when, source="random")  # type: ignore[arg-type]
            )
    return out


def checkpoint_dir(scenario: Scenario, run: RunConfig, run_dir: Path) -> str | None:
    """Where the run's checkpoints go: a ``[checkpoint] dir`` that is a relative path lands inside
    the run directory (so every lab run keeps its own); an absolute path, a URL or a
    ``--checkpoint-dir`` given on the command line is used as it is."""
    d = run.checkpoint.checkpoint_dir
    c = scenario.checkpoint
    if d is None or c is None or d != c.dir or "://" in d or Path(d).is_absolute():
        return d
    return str(run_dir.resolve() / d)


def lab_config(scenario: Scenario, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The run the lab starts for ``scenario``: its :attr:`~Scenario.config` with the demo's short
    ``sync_every`` for a strategy that has one and whose options do not name it, then
    ``overrides`` (flat names or dotted paths) applied. ``steps`` follows ``run.tokens`` and the
    final batch size unless overridden; the name stays the scenario's. Raises
    :class:`~isthmus.spec.SpecError` naming a bad setting."""
    over = {k: v for k, v in (overrides or {}).items() if k != "steps"}
    base = scenario.config
    options = with_short_h(base.strategy.name, base.strategy.options)
    cfg = apply_overrides(
        base, {"option": options, **over} if options != base.strategy.options else over
    )
    steps = (overrides or {}).get("steps") or scenario.steps_for(batch_size=cfg.data.batch_size)
    return apply_overrides(cfg, {"steps": steps, "name": base.name})


class NamespaceSpawner(Spawner):
    """Starts slot ``i``'s processes inside its namespace of ``net`` with Gloo bound to its
    address, and the embedded coordinator inside the coordinator's namespace."""

    separate_hosts = True  # TLS, join tokens: as across real machines

    def __init__(self, net: WanNetwork) -> None:
        self.net = net
        self.coordinator_host = net.coordinator.ip

    def coordinator_context(self) -> contextlib.AbstractContextManager[Any]:
        return inside_namespace(self.net.coordinator.netns)

    def hostname(self, slot: int) -> str | None:
        # hostname, not interface: Gloo binds and advertises exactly this address
        return self.net.peers[slot].ip

    def popen(
        self, slot: int, argv: list[str], env: dict[str, str], log: Any
    ) -> subprocess.Popen[bytes]:
        # ip netns exec execs python itself, so the process we hold *is* the peer and signals
        # reach it; a process group of its own, so Ctrl-C reaches the runner only
        return self.net.popen(
            slot, argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


class _Links(Hook):
    """Link counters sampled for the length of the run."""

    def __init__(self, sampler: LinkSampler) -> None:
        self.sampler = sampler

    def start(self, launcher: Launcher) -> None:
        self.sampler.start()

    def stop(self, launcher: Launcher) -> None:
        self.sampler.stop()


def lab_churn(
    scenario: Scenario, run: RunConfig, *, log_path: Any = None, script: bool = False
) -> ChurnHook:
    """The churn hook of a lab run: the scenario's ``[[churn]]`` and ``[random_churn]`` events,
    and its ``[[fault]]`` entries handed to each slot's first process (a script's session reads
    them from ``ISTHMUS_FAULTS``). For a ``script`` the churn's step-clock kills and stops are
    applied from outside when due rather than fired by the peer itself."""
    return ChurnHook(
        _events(scenario, run.timeouts.run_timeout),
        static_faults=run.faults.peer_faults,
        log_path=log_path,
        self_fired=not script,
    )


def lab_script(
    scenario: Scenario, run: RunConfig, job: JobSpec | Script | None = None
) -> Script | None:
    """The program a lab run's peers run when it is a user's script: ``job`` (a
    :class:`~isthmus.lab.jobspec.JobSpec` or a ready :class:`~isthmus.run.programs.Script`), else
    the scenario's ``[job]``; None: the built-in job. The script's environment gets the run's
    ``ISTHMUS_CONNECTIONS``, ``ISTHMUS_PROBE_LINKS``, ``ISTHMUS_MESH``, ``ISTHMUS_STALL_S`` and
    ``ISTHMUS_LATE_S`` (what its own ``SessionConfig`` says wins). Raises :class:`~isthmus.spec.SpecError` naming the scenario's key for what a script
    cannot take (``[[fault]]``, ``[[byzantine]]``, ``[checkpoint]``) and FileNotFoundError for a
    script that does not exist."""
    if isinstance(job, Script):
        scenario.with_job(JobSpec(script=str(job.path), args=tuple(job.args)))  # the checks
        program = job
    else:
        spec = scenario.with_job(job).job if job is not None else scenario.job
        if spec is None:
            return None
        # an island's ranks are the agent's children: all in the peer's namespace
        program = Script(spec.script, list(spec.args), nproc_per_peer=spec.nproc_per_peer)
    s = run.strategy
    program.settings = {
        "ISTHMUS_CONNECTIONS": str(s.connections),
        "ISTHMUS_PROBE_LINKS": "1" if s.probe_links else "0",
        "ISTHMUS_MESH": "1" if s.mesh else "0",
        "ISTHMUS_STALL_S": repr(float(run.timeouts.stall_s)),
        "ISTHMUS_LATE_S": repr(float(run.timeouts.late_s)),
        **program.settings,
    }
    return program


def run_lab(
    scenario: Scenario,
    opts: LabOptions | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    script: JobSpec | Script | None = None,
) -> Summary:
    """Run ``scenario`` and return its summary (also written to the run directory). The peers
    run ``script`` if given (a :class:`~isthmus.lab.jobspec.JobSpec` or a
    :class:`~isthmus.run.programs.Script`), else the scenario's ``[job]`` script, else the
    built-in job (see :func:`lab_script`).

    Raises ValueError (a :class:`~isthmus.spec.SpecError` naming the key) for settings that
    cannot work, FileNotFoundError for a script that does not exist, FileExistsError if the run
    directory already holds a run, :class:`~isthmus.lab.netns.LabUnavailable` when
    ``network="netns"`` cannot be honoured, and re-raises KeyboardInterrupt after tearing
    everything down.
    """
    opts = opts or LabOptions()
    run = lab_config(scenario, overrides)
    program = lab_script(scenario, run, script)
    run_dir = RunDir.create(run.output.run_dir, run.name)
    if run.checkpoint.checkpoint_dir is not None:
        run = apply_overrides(run, {"checkpoint_dir": checkpoint_dir(scenario, run, run_dir.path)})
    scenario_json = scenario.to_json()
    if program is not None:
        scenario_json["job"] = {"script": str(program.path), "args": list(program.args)}
    run_dir.write_json("scenario.json", scenario_json)
    churn = lab_churn(
        scenario, run, log_path=run_dir.path / "churn.jsonl", script=program is not None
    )
    with open_network(scenario.network, mode=opts.network, prefix=opts.prefix) as (net, info):
        sampler = LinkSampler(net, run_dir.path / "links.jsonl", opts.sample_interval_s)
        spawner = NamespaceSpawner(net) if net is not None else None
        if program is None:
            summary, outcome, _ = run_builtin(
                run,
                spawner=spawner,
                hooks=[_Links(sampler)],
                churn=churn,
                run_dir=run_dir,
                slots=scenario.peers,
            )
        else:
            summary, outcome = _run_script(
                program, run, run_dir, spawner, churn, sampler, tee=opts.tee
            )
    summary.lab = _lab_summary(
        scenario, info, outcome, run_dir, sampler, churn, run, net is not None
    )
    publish(summary, run_dir, also=run.output.summary_json)
    _append_report(run_dir, summary)
    return summary


def _run_script(
    program: Script,
    run: RunConfig,
    run_dir: RunDir,
    spawner: Spawner | None,
    churn: ChurnHook,
    sampler: LinkSampler,
    *,
    tee: bool,
) -> tuple[Summary, Outcome]:
    """The user's script in every slot, through the launcher ``isthmus run`` uses."""
    slots = run.peers
    run_dir.write_json(
        "config.json",
        {
            "program": str(program.path),
            "args": list(program.args),
            "peers": slots,
            "steps": run.steps,
            "timeouts": dataclasses.asdict(run.timeouts),
        },
    )
    return launch_script(
        program,
        run_dir=run_dir,
        slots=slots,
        starting=churn.starting(slots),
        timeouts=run.timeouts,
        spawner=spawner,
        hooks=[churn, _Links(sampler), StepRecords(run_dir)],
        steps=run.steps,
        label=f"{run.name}: {program.path.name}",
        progress=run.output.progress,
        stragglers=run.stragglers,
        tee=tee,
    )


def _lab_summary(
    scenario: Scenario,
    info: dict[str, Any],
    outcome: Outcome,
    run_dir: RunDir,
    sampler: LinkSampler,
    churn: ChurnHook,
    run: RunConfig,
    per_peer: bool,
) -> LabSummary:
    events = outcome.events
    epochs = [e for e in events if e["kind"] == "epoch"]
    t0 = epochs[0]["ts"] if epochs else (outcome.t0 or 0.0)
    finals = {}
    accounted: dict[str, int] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    # what each session last told the coordinator (a script's peers write no result file)
    reported = {
        str(p.get("name")): int((p.get("info") or {}).get("bytes_sent", 0))
        for p in outcome.status.get("peers", [])
    }
    for inc in outcome.incarnations:
        records[inc.name] = run_dir.records(inc.name)
        result = run_dir.result(inc.name)
        if result is not None:
            finals[inc.name] = result
            accounted[inc.name] = result.bytes_sent
        else:
            last = int(records[inc.name][-1]["bytes_sent"]) if records[inc.name] else 0
            accounted[inc.name] = max(last, reported.get(inc.name, 0))
    per_slot = {
        f"peer{s.index}": sum(accounted[i.name] for i in s.incarnations) for s in outcome.slots
    }
    links = run_dir.path / "links.jsonl"
    return LabSummary(
        scenario={
            "name": scenario.run.name,
            "source": scenario.source,
            "description": scenario.description,
        },
        network={**info, "rates": [format_rate(r) for r in scenario.network.rates_bps]},
        churn_applied=churn.applied,
        churn_skipped=churn.skipped,
        bytes_check=measure.bytes_check(sampler.first, sampler.last, per_slot, per_peer),
        round_latency_s=measure.round_latency(finals),
        world_size=[[round(e["ts"] - t0, 3), e["world"]] for e in epochs],
        time_lost_to_recovery_s=measure.time_lost(events, churn.applied, t0),
        train_wall_s=measure.train_wall(records, t0),
        eval=measure.eval_curve(records, t0, run.eval.target_loss),
        link_samples=sum(1 for _ in links.open()) if links.exists() else 0,
    )


def _latency_note(net: Mapping[str, Any]) -> str:
    """Round trips, loss and sites of the network, for the report's one line about it."""
    out = ""
    imps = net.get("impairments")
    if imps:
        out += "; round trips between peers' links " + ", ".join(
            f"{x['rtt_ms']:g} ms"
            + (f" +- {x['jitter_ms']:g}" if x["jitter_ms"] else "")
            + (f" loss {x['loss']:g}" if x["loss"] else "")
            for x in imps
        )
    sites = net.get("sites")
    if sites:
        names = {tuple(s["peers"]): s["name"] for s in sites["sites"]}
        out += "; sites " + ", ".join(f"{n} (peers {list(p)})" for p, n in names.items())
        for link in sites["links"]:
            imp = link["impairment"]
            rate = format_rate(link["rate_bps"])
            out += f"; {link['sites'][0]}-{link['sites'][1]} {rate}, RTT {imp['rtt_ms']:g} ms"
            if imp["loss"]:
                out += f", loss {imp['loss']:g}"
    return out


def _append_report(run_dir: RunDir, s: Summary) -> None:
    report = run_dir.path / "report.md"
    if not report.exists() or s.lab is None:
        return
    lab = s.lab
    net = lab.network
    lines = [
        "",
        "## Lab",
        "",
        f"Scenario `{lab.scenario['source']}`: {lab.scenario['description'].strip()}",
        "",
        f"Network: **{net['mode']}**"
        + (f" (fell back: {net['reason']})" if net["mode"] == "loopback" else "")
        + f"; peer links {', '.join(net['rates'])}"
        + _latency_note(net)
        + ".",
        "",
    ]
    bc = lab.bytes_check
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
    if lab.churn_applied or lab.churn_skipped:
        lines += ["| t (s) | action | peer | how |", "|---|---|---|---|"]
        for c in lab.churn_applied + lab.churn_skipped:
            how = c["how"] + (f" (skipped: {c['skipped']})" if "skipped" in c else "")
            lines.append(f"| {c['t']} | {c['action']} | {c['peer']} | {how} |")
        lines.append("")
    with report.open("a") as f:
        f.write("\n".join(lines) + "\n")
