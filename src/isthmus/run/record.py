"""The typed record of a run: :class:`RunDir` (what a run directory holds) and :class:`Summary`.

A run directory holds, per peer ``<name>``: ``<name>.jsonl`` (one record per step),
``<name>.log`` (its stdout and stderr), ``<name>.job.json`` (what it was told to do) and, when it
finished, ``<name>.final.json`` (:class:`PeerResult`) and ``<name>.state.pt`` (its shared state);
for the run: ``metrics.jsonl`` (every peer's records), ``events.jsonl`` (the coordinator's
membership events), ``config.json``, ``summary.json`` (:class:`Summary`), the plots and
``report.md``, and in lab runs ``links.jsonl``, ``churn.jsonl`` and ``scenario.json``.

The CLI, the lab, reports and benchmarks read these through this module, never by key.
``Summary.to_json()`` writes ``summary.json``'s flat layout (lab runs add their keys at the top
level), and ``Summary.from_json`` reads any ``summary.json`` of that layout, ignoring keys it
does not know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LATE_JOINER_EXIT", "LabSummary", "PeerResult", "RunDir", "Summary", "read_jsonl"]

LATE_JOINER_EXIT = 4
"""A peer's exit status when the run was over before it could join (``RunFinished``): a peer
restarted near the end arrives after the last round, which is not a failure of the run."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a file, one per line; a torn last line (a peer killed mid-write) and
    blank lines are skipped; a missing file is empty."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(kw_only=True)
class PeerResult:
    """What a finished peer of the built-in job writes to ``<name>.final.json``."""

    name: str
    peer_id: int | None
    step: int
    revision: int
    digest: str
    """xxh3 of the shared state (names and bytes)."""
    model_digest: str
    """xxh3 of the model's whole state_dict (parameters and buffers)."""
    eval_loss: float
    bytes_sent: int
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    restores: int = 0
    """Times the coordinator had this peer load a checkpoint's shared state mid-run (no live
    peer held the run's state)."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """Every round attempt: round, epoch, world, outcome, reason, t_start, t_end, bytes, ..."""
    wall_s: float = 0.0
    strategy: dict[str, Any] = field(default_factory=dict)
    """The strategy's metrics (overlap_fraction, nonfinite_skips, rejected_updates, ...)."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """The checkpointer's metrics (checkpoints_written, checkpoint_stall_s, ...), if any."""
    resumed_from: int | None = None
    """The revision of the checkpoint this peer resumed from (None: not resumed)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeerResult:
        return cls(**_known(cls, data))


@dataclass(kw_only=True)
class LabSummary:
    """What a lab run adds to the summary (written at the top level of ``summary.json``)."""

    scenario: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    """mode (netns or loopback), reason, rates_mbit, rates, coordinator_rate_mbit, ..."""
    churn_applied: list[dict[str, Any]] = field(default_factory=list)
    churn_skipped: list[dict[str, Any]] = field(default_factory=list)
    bytes_check: dict[str, Any] = field(default_factory=dict)
    round_latency_s: dict[str, Any] = field(default_factory=dict)
    world_size: list[list[float]] = field(default_factory=list)
    time_lost_to_recovery_s: dict[str, Any] = field(default_factory=dict)
    train_wall_s: float | None = None
    eval: dict[str, Any] = field(default_factory=dict)
    link_samples: int = 0


@dataclass(kw_only=True)
class Summary:
    """A finished run in numbers (``summary.json``)."""

    strategy: str
    strategy_options: dict[str, Any] = field(default_factory=dict)
    compression: str = "none"
    aggregator: str = "mean"
    steps: int | None = None
    model_parameters: int | None = None
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    rounds_committed: int = 0
    rounds_aborted: int = 0
    parity_checks: int = 0
    parity_failures: int = 0
    resyncs: int = 0
    isolations: int = 0
    """Times a live peer was left out because a member could not reach it (or it a member)."""
    isolated: list[dict[str, Any]] = field(default_factory=list)
    """Each isolation and re-admission: ``{"t", "name", "event", "reason"}`` (event is
    ``isolated`` or ``readmitted``), in the coordinator's time."""
    peers_final: int = 0
    """Peers that finished holding the majority's bit-identical state."""
    peers_started: int = 0
    kills: int = 0
    joins: int = 0
    restarts: int = 0
    """Crashed peer processes the launcher started again (``--max-restarts``)."""
    bytes_sent_total: int = 0
    bytes_sent_ddp_equivalent: int = 0
    bytes_per_step_per_peer: int = 0
    """Median, over the finished peers' committed rounds, of the bytes one peer sent in one
    round (a resync's transfer in a round is rare and leaves the median alone)."""
    recovery_s: list[float] = field(default_factory=list)
    peak_bytes_per_round: int = 0
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    overlap_fraction: float = 0.0
    nonfinite_skips: int = 0
    rejected_updates: int = 0
    byzantine: dict[str, str] = field(default_factory=dict)
    final_digest: str | None = None
    final_model_digest: str | None = None
    wall_s: float = 0.0
    run_dir: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    late_joiners: list[str] = field(default_factory=list)
    """Processes that came after the run had ended (exit :data:`LATE_JOINER_EXIT`)."""
    program: str = "isthmus.run.job"
    """What each peer ran: the built-in job, or the user's script."""
    checkpoints_written: int = 0
    """Complete checkpoints written during the run."""
    checkpoint_stall_s: float = 0.0
    """Time the peers' training threads spent blocked by saving, summed over peers."""
    resumed_from_round: int | None = None
    """The round the run resumed at (the checkpoint's revision); None when not resumed."""
    stragglers: int = 0
    """Times a peer was flagged as a straggler (``straggler`` events)."""
    link_anomalies: int = 0
    """Slow synchronizations or named slow links (``link_anomaly`` events)."""
    lab: LabSummary | None = None

    @property
    def ok(self) -> bool:
        """At least one peer finished and every finished peer holds the same state."""
        return self.peers_final > 0 and self.parity_failures == 0

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lab"}
        d = json.loads(json.dumps(d))  # deep copy, JSON types only
        if self.lab is not None:
            d.update(json.loads(json.dumps(dataclasses.asdict(self.lab))))
            d["kills"] = self.kills
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        lab_keys = {f.name for f in dataclasses.fields(LabSummary)}
        lab = None
        if "network" in data:  # a lab run's summary
            lab = LabSummary(**{k: data[k] for k in lab_keys if k in data})
        return cls(**_known(cls, {k: v for k, v in data.items() if k != "lab"}), lab=lab)


class RunDir:
    """A run directory (see the module docstring). Paths are properties; readers tolerate files
    that a killed peer left half-written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | Path | None, name: str) -> RunDir:
        """Make a fresh run directory (default ``runs/<time>-<name>``).

        Raises FileExistsError if it already holds a run's results."""
        p = Path(path) if path else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
        if p.exists() and any(p.glob("*.jsonl")):
            raise FileExistsError(f"{p} already holds a run's results; choose another --run-dir")
        p.mkdir(parents=True, exist_ok=True)
        return cls(p)

    def __str__(self) -> str:
        return str(self.path)

    # -- per peer -------------------------------------------------------------------------------
    def job(self, name: str) -> Path:
        return self.path / f"{name}.job.json"

    def log(self, name: str) -> Path:
        return self.path / f"{name}.log"

    def records_path(self, name: str) -> Path:
        return self.path / f"{name}.jsonl"

    def final_path(self, name: str) -> Path:
        return self.path / f"{name}.final.json"

    def state_path(self, name: str) -> Path:
        return self.path / f"{name}.state.pt"

    def records(self, name: str) -> list[dict[str, Any]]:
        """Peer ``name``'s per-step records."""
        return read_jsonl(self.records_path(name))

    def result(self, name: str) -> PeerResult | None:
        """Peer ``name``'s final record, or None if it did not finish (or wrote a torn file)."""
        p = self.final_path(name)
        try:
            return PeerResult.from_json(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError, TypeError):
            return None

    def tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of peer ``name``'s log (what it said before it exited)."""
        try:
            text = self.log(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # -- the run --------------------------------------------------------------------------------
    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "metrics.jsonl")

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "events.jsonl")

    def links(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "links.jsonl")

    def churn(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "churn.jsonl")

    def summary(self) -> Summary:
        """The run's summary. Raises FileNotFoundError naming the directory if there is none."""
        if not self.summary_path.exists():
            raise FileNotFoundError(
                f"{self.path} is not a finished run directory (no summary.json)"
            )
        return Summary.from_json(json.loads(self.summary_path.read_text()))

    def write_jsonl(self, filename: str, records: list[dict[str, Any]]) -> None:
        with (self.path / filename).open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def write_json(self, filename: str, data: Any) -> None:
        (self.path / filename).write_text(json.dumps(data, indent=1, default=str))

    def write_summary(self, summary: Summary, also: str | None = None) -> None:
        """``summary.json``, and a copy at ``also`` if given."""
        text = json.dumps(summary.to_json(), indent=1)
        self.summary_path.write_text(text)
        if also:
            Path(also).parent.mkdir(parents=True, exist_ok=True)
            Path(also).write_text(text)
