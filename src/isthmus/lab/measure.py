"""What a lab run measured, in the simulator's terms: the bridge from ``isthmus lab run`` to
:mod:`isthmus.lab.sim`.

:func:`measure_run` reads a run directory (``summary.json``, the peers' ``*.final.json`` and
``*.jsonl``) and extracts the simulator's inputs (compute per step, payload bytes per round, link
rate, strategy shape) and the figures to check it against (wall-clock per step, round latency,
bytes per step). :func:`validate_runs` predicts each run with those inputs and returns the
relative errors, which docs/BENCHMARKS.md reports for 2 to 6 peers.

How each number is taken:

* ``compute_s_per_step``: the median time between two consecutive step records of one peer when no
  round committed in between (the revision did not change). That is compute measured under the
  lab's own CPU sharing (all peers on one machine). DDP communicates every step, so a DDP run has
  none; borrow it from a run of another strategy at the same peer count (``compute_s=``).
* ``bytes_per_round``: the payload ``B`` one peer contributes per round, from the wire bytes
  isthmus accounted for a committed round: ``bytes x n / (2(n-1))`` (ring all-reduce).
* ``step_s``: per peer, (time of its last step record - time of its step-1 record) / steps in
  between; the mean over peers. Step 0 is left out: it holds group set-up and DiLoCo's catch-up.
* ``round_comm_s``: the median over committed rounds after the first of the slowest peer's round
  duration (round formed to commit answered: collectives plus the commit round trip).

Raises ``FileNotFoundError`` for a directory that is not a finished lab run and ``ValueError``
when the run has nothing to measure (no committed round, fewer than two peers).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab.sim import NetworkModel, Simulator, ValidationRow, strategy_profile, validate

__all__ = ["RunMeasurement", "measure_run", "simulator_for", "validate_runs"]


@dataclass(frozen=True, kw_only=True)
class RunMeasurement:
    """Simulator inputs and measured figures of one lab run (see the module docstring)."""

    run_dir: str
    strategy: str
    peers: int
    steps: int
    rate_bps: float | None
    """The slowest peer link; ``None`` for unshaped links or a loopback run."""
    sync_every: int
    fragments: int
    overlap_steps: float
    bytes_per_round: float
    compute_s_per_step: float | None
    step_s: float
    round_comm_s: float
    bytes_per_peer_per_step: float

    def measured_row(self) -> dict[str, Any]:
        """The row :func:`isthmus.lab.sim.validate` compares with."""
        return {
            "peers": self.peers,
            "steps": self.steps,
            "step_s": self.step_s,
            "round_comm_s": self.round_comm_s,
            "bytes_per_peer_per_step": self.bytes_per_peer_per_step,
        }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def measure_run(run_dir: str | Path) -> RunMeasurement:
    """Read one lab (or demo) run directory; see the module docstring for each figure."""
    d = Path(run_dir)
    if not (d / "summary.json").exists():
        raise FileNotFoundError(f"{d} is not a finished run directory (no summary.json)")
    summary = json.loads((d / "summary.json").read_text())
    names = [n for n, rc in summary.get("exit_codes", {}).items() if rc == 0]
    finals = [
        json.loads((d / f"{n}.final.json").read_text())
        for n in names
        if (d / f"{n}.final.json").exists()
    ]
    if not finals:
        raise ValueError(f"{d}: no peer finished, nothing to measure")
    committed = [
        r for f in finals for r in f["rounds"] if r["outcome"] == "committed" and r["world"] > 1
    ]
    if not committed:
        raise ValueError(f"{d}: no committed round with more than one peer")
    peers = statistics.mode(r["world"] for r in committed)
    # the slowest peer's duration per round; round 0 builds the groups and is left out
    per_round: dict[int, float] = {}
    payload: list[float] = []
    for r in committed:
        if r["world"] != peers:
            continue
        if r["round"] > 0:
            per_round[r["round"]] = max(per_round.get(r["round"], 0.0), r["t_end"] - r["t_start"])
        payload.append(r["bytes"] * peers / (2 * (peers - 1)))
    if not per_round:
        raise ValueError(f"{d}: a single committed round; run more steps to measure rounds")
    opts = summary.get("strategy_options", {})
    steps = int(summary["steps"])
    compute: list[float] = []
    step_times: list[float] = []
    for n in names:
        recs = sorted(_jsonl(d / f"{n}.jsonl"), key=lambda r: r["step"])
        for a, b in itertools.pairwise(recs):
            if b["revision"] == a["revision"] and b["step"] == a["step"] + 1:
                compute.append(b["ts"] - a["ts"])
        body = [r for r in recs if r["step"] >= 1]
        if len(body) >= 2:
            step_times.append(
                (body[-1]["ts"] - body[0]["ts"]) / (body[-1]["step"] - body[0]["step"])
            )
    if not step_times:
        raise ValueError(f"{d}: too few step records to measure a step time")
    rates = [r for r in summary.get("network", {}).get("rates_mbit", []) if r is not None]
    loopback = summary.get("network", {}).get("mode") != "netns"
    return RunMeasurement(
        run_dir=str(d),
        strategy=str(summary["strategy"]),
        peers=peers,
        steps=steps,
        rate_bps=None if loopback or not rates else min(rates) * 1e6,
        sync_every=int(opts.get("sync_every", 1)),
        fragments=int(opts.get("fragments", 1)),
        overlap_steps=float(opts.get("overlap", 0)),  # streaming DiLoCo's tau
        bytes_per_round=statistics.median(payload),
        compute_s_per_step=statistics.median(compute) if compute else None,
        step_s=statistics.mean(step_times),
        round_comm_s=statistics.median(per_round.values()),
        bytes_per_peer_per_step=statistics.mean(f["bytes_sent"] for f in finals) / steps,
    )


def simulator_for(
    m: RunMeasurement,
    *,
    compute_s: float | None = None,
    efficiency: float = 0.95,
    latency_s: float = 0.0,
) -> Simulator:
    """The simulator set up with a run's measured inputs (``compute_s`` overrides the run's own,
    needed for DDP). Raises ``ValueError`` without a compute time or a link rate."""
    compute = compute_s if compute_s is not None else m.compute_s_per_step
    if compute is None:
        raise ValueError(
            f"{m.run_dir}: no step without communication to time compute ({m.strategy} syncs "
            "every step); pass compute_s, e.g. from a DiLoCo run at the same peer count"
        )
    if m.rate_bps is None:
        raise ValueError(f"{m.run_dir}: unshaped or loopback run; the simulator needs a link rate")
    name = m.strategy
    model_bytes = m.bytes_per_round * (m.fragments if name == "streaming" else 1)
    profile = strategy_profile(
        name,
        model_bytes=model_bytes,
        sync_every=m.sync_every if name != "ddp" else 1,
        fragments=m.fragments if name == "streaming" else 1,
        overlap_steps=m.overlap_steps if name == "streaming" else 0.0,
    )
    return Simulator(
        compute_s_per_step=compute,
        strategy=profile,
        network=NetworkModel(bandwidth_bps=m.rate_bps, latency_s=latency_s, efficiency=efficiency),
    )


def validate_runs(
    measurements: Sequence[RunMeasurement],
    *,
    compute_by_peers: Mapping[int, float] | None = None,
    efficiency: float = 0.95,
    latency_s: float = 0.0,
) -> list[tuple[RunMeasurement, list[ValidationRow]]]:
    """Predict every run from its own inputs and compare. Runs without a compute time of their
    own (DDP) take ``compute_by_peers[peers]``, by default the compute measured in another of the
    given runs with the same peer count. Raises ``ValueError`` if none is available."""
    known = dict(compute_by_peers or {})
    for m in measurements:
        if m.compute_s_per_step is not None:
            known.setdefault(m.peers, m.compute_s_per_step)
    out = []
    for m in measurements:
        compute = m.compute_s_per_step if m.compute_s_per_step is not None else known.get(m.peers)
        sim = simulator_for(m, compute_s=compute, efficiency=efficiency, latency_s=latency_s)
        out.append((m, validate(sim, [m.measured_row()])))
    return out
