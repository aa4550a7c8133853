"""What a run measured: the lab's figures for the summary, and the simulator's inputs.

**Lab figures** (pure functions of a run's records, for :class:`~isthmus.run.record.LabSummary`):
:func:`bytes_check` compares each peer's bytes on the wire (link counters) with isthmus's own
accounting and splits off the control plane; :func:`round_latency` is the committed rounds'
duration (slowest peer per round); :func:`time_lost` is the time from each failure to the next
commit; :func:`eval_curve` is the mean eval loss over time, with the time to a target loss.

**Simulator inputs** (the bridge from ``isthmus lab run`` to :mod:`isthmus.lab.sim`):
:func:`measure_run` reads a run directory and extracts the simulator's inputs (compute per step,
payload bytes per round, link rate, strategy shape) and the figures to check it against
(wall-clock per step, round latency, bytes per step). :func:`validate_runs` predicts each run with
those inputs and returns the relative errors, which docs/BENCHMARKS.md reports for 2 to 6 peers.

How each simulator input is taken:
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
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab.sim import NetworkModel, Simulator, ValidationRow, strategy_profile, validate
from isthmus.run.record import PeerResult, RunDir

__all__ = [
    "FRAME_HEADER_BYTES",
    "RunMeasurement",
    "bytes_check",
    "eval_curve",
    "measure_run",
    "round_latency",
    "simulator_for",
    "time_lost",
    "train_wall",
    "validate_runs",
]


def _rel(a: float, b: float) -> float | None:
    return None if b <= 0 else round((a - b) / b, 4)


FRAME_HEADER_BYTES = 66
"""Bytes of headers on every TCP segment on the emulated links: Ethernet 14 + IPv4 20 + TCP 32
(20 plus the 12-byte timestamp option Linux uses by default). A pure ACK is exactly this."""


def _payload(bytes_: int, packets: int) -> int:
    return bytes_ - FRAME_HEADER_BYTES * packets


def bytes_check(
    first: dict[str, dict[str, Any]],
    last: dict[str, dict[str, Any]],
    accounted: dict[str, int],
    per_peer: bool,
) -> dict[str, Any]:
    """Wire bytes (interface counters) against isthmus's accounting, per peer and in total.

    ``wire_tx_bytes`` is what the link carried; ``wire_payload_bytes`` removes one
    :data:`FRAME_HEADER_BYTES` per packet (so pure ACKs count zero), leaving the TCP payload;
    the control plane (whatever the coordinator received) is subtracted for the data-plane total.
    """
    acc_total = sum(accounted.values())
    if not per_peer:
        lo0, lo1 = first.get("lo"), last.get("lo")
        lo = (lo1["tx_bytes"] - lo0["tx_bytes"]) if lo0 and lo1 else None
        return {
            "accounted_total": acc_total,
            "loopback_bytes": lo,
            "note": "loopback fall-back: every process on this machine shares `lo`, so its "
            "counter cannot be attributed to peers (shown for reference only).",
        }

    def delta(name: str, key: str) -> int:
        a, b = first.get(name), last.get(name)
        return int(b[key] - a[key]) if a is not None and b is not None else 0

    rows: dict[str, dict[str, Any]] = {}
    for name, acc in accounted.items():
        if name not in last:
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


def round_latency(finals: Mapping[str, PeerResult]) -> dict[str, Any]:
    """Committed rounds' duration (round formed to commit answered), the slowest peer per round."""
    per_round: dict[int, float] = {}
    aborted: dict[tuple[int, int], float] = {}
    for f in finals.values():
        for r in f.rounds:
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


def time_lost(
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


def train_wall(records: dict[str, list[dict[str, Any]]], t0: float) -> float | None:
    last = [r["ts"] for recs in records.values() for r in recs if "ts" in r]
    return round(max(last) - t0, 3) if last else None


def eval_curve(
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


# ---------------------------------------------------------------------------- the simulator


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


def measure_run(run_dir: str | Path) -> RunMeasurement:
    """Read one lab (or demo) run directory; see the module docstring for each figure."""
    d = RunDir(run_dir)
    summary = d.summary()
    names = [n for n, rc in summary.exit_codes.items() if rc == 0]
    finals = [f for f in (d.result(n) for n in names) if f is not None]
    if not finals:
        raise ValueError(f"{d}: no peer finished, nothing to measure")
    committed = [
        r for f in finals for r in f.rounds if r["outcome"] == "committed" and r["world"] > 1
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
    opts = summary.strategy_options
    steps = int(summary.steps or 0)
    compute: list[float] = []
    step_times: list[float] = []
    for n in names:
        recs = sorted(d.records(n), key=lambda r: r["step"])
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
    network = summary.lab.network if summary.lab is not None else {}
    rates = [r for r in network.get("rates_mbit", []) if r is not None]
    loopback = network.get("mode") != "netns"
    return RunMeasurement(
        run_dir=str(d),
        strategy=summary.strategy,
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
        bytes_per_peer_per_step=statistics.mean(f.bytes_sent for f in finals) / steps,
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
