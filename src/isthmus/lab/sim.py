"""An analytic simulator: how long a training run takes at 8 to 10,000 peers, from a few measurements.

The lab measures what one machine can: compute time per step, bytes per round, achieved link
rates at 2-6 peers. This module extrapolates with a deliberately simple model whose every term can
be checked by hand (docs/LAB.md has the derivations):

* collective time for ``B`` payload bytes per peer over ``n`` peers with link rate ``bw`` (bit/s,
  each direction, the slowest link governs) times ``efficiency`` (payload share of the wire) and
  one-way latency ``L`` per message (alpha-beta model, Hockney 1994):

  - ``ring``: ``2(n-1) L + 2(n-1)/n * 8B/bw`` (reduce-scatter then all-gather; Patarasuk and
    Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009);
  - ``tree``: binomial reduce then broadcast, each of ``ceil(log2 n)`` levels moves the whole
    buffer: ``2 ceil(log2 n) (L + 8B/bw)``; latency-optimal, bandwidth-poor;
  - ``hierarchical``: groups of ``g`` peers (default ``round(sqrt(n))``), ``m = ceil(n/g)``
    groups: reduce-scatter inside groups, ring all-reduce of each ``B/g`` shard across groups,
    all-gather inside groups: ``2(g-1) L_in + 2(g-1)/g * 8B/bw_in + 2(m-1) L + 2(m-1)/m * 8B/(g bw)``;
  - ``gossip``: each peer sends its ``B`` to ``k`` neighbours over its one uplink: ``L + 8kB/bw``.

* rounds: a strategy communicates once every ``steps_per_round`` inner steps (DDP 1, DiLoCo and
  local SGD ``H``, streaming DiLoCo ``H/P`` with ``B/P`` bytes per fragment). A fraction
  ``overlap`` of the compute between two rounds can run while the round's collective is in
  flight (streaming: ``tau / (H/P)``; eager and CO2: all of it; DDP with bucketing: the backward
  pass, if you set it). Hidden time is ``min(T_round, overlap * steps_per_round * compute)``; the
  rest stalls the peers. Step time = compute + exposed time / steps_per_round.

* failures: Poisson, independent, ``rate`` per peer per hour, so ``n * rate`` for the run. Each
  costs ``recovery_s`` (detection, a new epoch, state transfer to a replacement) plus one round's
  communication (the aborted round is retried in full; survivors keep their inner progress, as
  isthmus aborts rounds, not steps). With ``phi = failures per second * cost``, a run needing
  ``W`` seconds of failure-free time takes ``W / (1 - phi)``; at ``phi >= 1`` it never finishes
  (reported as infinity).

Not modelled: contention between communication and compute for CPU or memory bandwidth,
stragglers other than the slowest link, TCP slow start, congestion between unrelated flows
sharing a bottleneck, and the coordinator's own round trips (one per round, small next to ``L``
times the ring's hops). :func:`validate` compares predictions with lab measurements so these
gaps show up as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ALGORITHMS",
    "COLUMNS",
    "DEFAULT_PEERS",
    "METRICS",
    "FailureModel",
    "NetworkModel",
    "SimResult",
    "Simulator",
    "StrategyProfile",
    "ValidationRow",
    "collective_bytes",
    "collective_time",
    "format_table",
    "rows",
    "strategy_profile",
    "validate",
]

ALGORITHMS = ("ring", "tree", "hierarchical", "gossip")
DEFAULT_PEERS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 10_000)


def _finite(value: float, name: str, *, minimum: float = 0.0, strict: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value <= minimum):
        bound = f"above {minimum:g}" if strict else f"at least {minimum:g}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class StrategyProfile:
    """How a strategy communicates, independent of the network. Build one with
    :func:`strategy_profile` or directly for a strategy not listed there."""

    name: str
    """Label for tables."""
    bytes_per_round: float
    """Payload bytes each peer contributes to one round's all-reduce (after compression)."""
    steps_per_round: float = 1.0
    """Inner steps between two rounds: DDP 1, DiLoCo H, streaming H/P."""
    overlap: float = 0.0
    """Fraction (0..1) of the compute between two rounds that runs while a round is in flight."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _finite(self.bytes_per_round, "bytes_per_round")
        _finite(self.steps_per_round, "steps_per_round", strict=True)
        _finite(self.overlap, "overlap")
        if self.overlap > 1:
            raise ValueError(f"overlap is a fraction of the compute, 0..1; got {self.overlap}")


def strategy_profile(
    name: str,
    *,
    model_bytes: float,
    sync_every: int = 1,
    fragments: int = 1,
    overlap_steps: float = 0.0,
    compression_ratio: float = 1.0,
    ddp_overlap: float = 0.0,
    zo_bytes: float = 1.0,
) -> StrategyProfile:
    """The communication profile of a known strategy.

    ``model_bytes``: bytes of the synchronized state (parameters or outer gradient, fp32 = 4 per
    parameter); ``compression_ratio``: compressed/uncompressed size (int8 0.25, 4-bit 0.125,
    top-1% with indices about 0.02); ``sync_every``: H; ``fragments``: P (streaming);
    ``overlap_steps``: tau (streaming); ``ddp_overlap``: share of a DDP step's compute that
    overlaps its all-reduce (bucketed backward: up to about 2/3).

    * ``ddp``: every step, the whole (compressed) gradient.
    * ``diloco``, ``localsgd``, ``gossip``: every H steps, no overlap (gossip also wants
      ``NetworkModel(algorithm="gossip")``).
    * ``streaming``: one of P fragments every H/P steps, ``B/P`` bytes, overlap ``tau/(H/P)``.
    * ``eager``, ``co2``: every H steps, the all-reduce overlaps the next H steps entirely.
    * ``zo``: every step, ``zo_bytes`` per peer whatever the model (its quantized projected
      gradients: 1 byte by default); the round is modelled as an all-reduce of them, so its
      latency term (``2 (n - 1)`` hops) is an upper bound for zo's ring all-gather (``n - 1``).

    Raises ``ValueError`` for an unknown name or out-of-range numbers (e.g. ``tau >= H/P``).
    """
    _finite(model_bytes, "model_bytes", strict=True)
    _finite(compression_ratio, "compression_ratio", strict=True)
    if compression_ratio > 1:
        raise ValueError(
            f"compression_ratio is compressed/original size, at most 1; got {compression_ratio}"
        )
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every (H) must be a positive int, got {sync_every!r}")
    if not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments (P) must be a positive int, got {fragments!r}")
    _finite(overlap_steps, "overlap_steps")
    _finite(ddp_overlap, "ddp_overlap")
    payload = model_bytes * compression_ratio
    if name == "ddp":
        return StrategyProfile(
            name=name, bytes_per_round=payload, steps_per_round=1.0, overlap=ddp_overlap
        )
    if name in ("diloco", "localsgd", "gossip"):
        return StrategyProfile(
            name=name, bytes_per_round=payload, steps_per_round=float(sync_every)
        )
    if name == "zo":
        _finite(zo_bytes, "zo_bytes")
        return StrategyProfile(name=name, bytes_per_round=zo_bytes, steps_per_round=1.0)
    if name in ("eager", "co2"):
        return StrategyProfile(
            name=name, bytes_per_round=payload, steps_per_round=float(sync_every), overlap=1.0
        )
    if name == "streaming":
        if sync_every % fragments:
            raise ValueError(
                f"sync_every (H={sync_every}) must be a multiple of fragments (P={fragments})"
            )
        between = sync_every / fragments
        if overlap_steps >= between:
            raise ValueError(
                f"overlap_steps (tau={overlap_steps:g}) must be below H/P = {between:g}, or a "
                "fragment's sync would still be in flight when the next one starts"
            )
        return StrategyProfile(
            name=name,
            bytes_per_round=payload / fragments,
            steps_per_round=between,
            overlap=overlap_steps / between,
        )
    raise ValueError(
        f"unknown strategy {name!r}; known: ddp, diloco, localsgd, gossip, eager, co2, "
        f"streaming, zo"
    )


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """Links and the collective algorithm."""

    bandwidth_bps: float | tuple[float, ...]
    """Link rate of every peer (one number) or of each peer (one per peer), bit/s, each direction."""
    latency_s: float = 0.0
    """One-way latency of one message between two peers, seconds."""
    algorithm: str = "ring"
    """``ring``, ``tree``, ``hierarchical`` or ``gossip`` (see the module docstring)."""
    efficiency: float = 0.95
    """Payload share of the link rate (TCP/IP headers on 1500-byte frames, and ACKs). The
    default, 0.95, is what Gloo's ring reaches over the lab's tbf links on a quiet machine
    (docs/BENCHMARKS.md, "1. isthmus all-reduce vs raw Gloo: 4 peers, 100 Mbit/s links,
    32 MB")."""
    group_size: int | None = None
    """Hierarchical: peers per group (a machine, a site); default ``round(sqrt(n))``."""
    intra_bandwidth_bps: float | None = None
    """Hierarchical: link rate inside a group; default ``bandwidth_bps``."""
    intra_latency_s: float | None = None
    """Hierarchical: latency inside a group; default ``latency_s``."""
    gossip_degree: int = 2
    """Gossip: neighbours each peer sends to per round."""

    def __post_init__(self) -> None:
        if isinstance(self.bandwidth_bps, (list, tuple)):
            if not self.bandwidth_bps:
                raise ValueError("bandwidth_bps is empty; give one rate or one per peer")
            rates = tuple(
                _finite(b, f"bandwidth_bps[{i}]", strict=True)
                for i, b in enumerate(self.bandwidth_bps)
            )
            object.__setattr__(self, "bandwidth_bps", rates)
        else:
            _finite(self.bandwidth_bps, "bandwidth_bps", strict=True)
        _finite(self.latency_s, "latency_s")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}"
            )
        _finite(self.efficiency, "efficiency", strict=True)
        if self.efficiency > 1:
            raise ValueError(
                f"efficiency is a share of the link rate, at most 1; got {self.efficiency}"
            )
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size!r}")
        if self.intra_bandwidth_bps is not None:
            _finite(self.intra_bandwidth_bps, "intra_bandwidth_bps", strict=True)
        if self.intra_latency_s is not None:
            _finite(self.intra_latency_s, "intra_latency_s")
        if not isinstance(self.gossip_degree, int) or self.gossip_degree < 1:
            raise ValueError(f"gossip_degree must be a positive int, got {self.gossip_degree!r}")

    def slowest_bps(self, peers: int) -> float:
        """The link rate that paces a collective over ``peers`` peers (the slowest one).

        Raises ``ValueError`` if per-peer rates were given for a different number of peers.
        """
        if isinstance(self.bandwidth_bps, tuple):
            if len(self.bandwidth_bps) != peers:
                raise ValueError(
                    f"{len(self.bandwidth_bps)} per-peer rates for {peers} peers; give one rate to "
                    "sweep over peer counts"
                )
            return min(self.bandwidth_bps)
        return float(self.bandwidth_bps)


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Independent failures (Poisson) and what each one costs."""

    failures_per_peer_per_hour: float = 0.0
    """Failure rate of one peer (0.01/h: a preemptible cloud VM lasting about four days)."""
    recovery_s: float = 30.0
    """Detection plus a new epoch plus state transfer to a replacement, per failure."""

    def __post_init__(self) -> None:
        _finite(self.failures_per_peer_per_hour, "failures_per_peer_per_hour")
        _finite(self.recovery_s, "recovery_s")


def _group_shape(peers: int, network: NetworkModel) -> tuple[int, int]:
    g = network.group_size or max(1, round(math.sqrt(peers)))
    g = min(g, peers)
    return g, math.ceil(peers / g)


def collective_time(nbytes: float, peers: int, network: NetworkModel) -> float:
    """Seconds one collective over ``nbytes`` of payload per peer takes (module docstring).

    Zero for one peer. Raises ``ValueError`` for negative or non-finite sizes.
    """
    _finite(nbytes, "nbytes")
    if not isinstance(peers, int) or peers < 1:
        raise ValueError(f"peers must be a positive int, got {peers!r}")
    if peers == 1:
        return 0.0
    n = peers
    bw = network.slowest_bps(n) * network.efficiency
    lat = network.latency_s
    bits = 8.0 * nbytes
    if network.algorithm == "ring":
        return 2 * (n - 1) * lat + 2 * (n - 1) / n * bits / bw
    if network.algorithm == "tree":
        levels = math.ceil(math.log2(n))
        return 2 * levels * (lat + bits / bw)
    if network.algorithm == "gossip":
        k = min(network.gossip_degree, n - 1)
        return lat + k * bits / bw
    g, m = _group_shape(n, network)
    bw_in = (network.intra_bandwidth_bps or network.slowest_bps(n)) * network.efficiency
    lat_in = network.latency_s if network.intra_latency_s is None else network.intra_latency_s
    inside = 2 * (g - 1) * lat_in + 2 * (g - 1) / g * bits / bw_in
    across = 2 * (m - 1) * lat + 2 * (m - 1) / m * (bits / g) / bw
    return inside + across


def collective_bytes(nbytes: float, peers: int, network: NetworkModel) -> float:
    """Payload bytes one peer sends in one collective (average over peers for ``tree``)."""
    _finite(nbytes, "nbytes")
    n = peers
    if n <= 1:
        return 0.0
    if network.algorithm in ("ring", "tree"):
        # a binomial reduce and broadcast each make n-1 sends in total, the ring's volume on average
        return 2 * (n - 1) / n * nbytes
    if network.algorithm == "gossip":
        return min(network.gossip_degree, n - 1) * nbytes
    g, m = _group_shape(n, network)
    return 2 * (g - 1) / g * nbytes + 2 * (m - 1) / m * nbytes / g


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """The prediction for one peer count. Times are seconds."""

    peers: int
    strategy: str
    algorithm: str
    steps: int
    compute_s: float
    """Compute per inner step (the input)."""
    round_comm_s: float
    """One round's collective."""
    comm_s_per_step: float
    """Communication per step, hidden or not (round time / steps per round)."""
    exposed_comm_s_per_step: float
    """The part of it that stalls the peers."""
    step_s: float
    """Wall-clock per step, failures included (``inf`` if failures outpace progress)."""
    step_s_no_failures: float
    total_s: float
    """``steps * step_s``."""
    utilization: float
    """Share of wall-clock spent computing: ``compute_s / step_s``."""
    bytes_per_peer_per_step: float
    """Payload bytes one peer sends per step, on average."""
    failures_per_hour: float
    failure_overhead: float
    """Expected share of time lost to failures (``phi``); 1 or more: the run never finishes."""

    @property
    def hidden_comm_s_per_step(self) -> float:
        """Communication per step that overlaps compute."""
        return self.comm_s_per_step - self.exposed_comm_s_per_step


@dataclass(frozen=True, kw_only=True)
class Simulator:
    """Measured inputs plus models; :meth:`predict` gives one peer count, :meth:`sweep` many."""

    compute_s_per_step: float
    """Measured compute of one inner step on one peer (forward, backward, optimizer)."""
    strategy: StrategyProfile
    network: NetworkModel
    failures: FailureModel = FailureModel()

    def __post_init__(self) -> None:
        _finite(self.compute_s_per_step, "compute_s_per_step", strict=True)

    def predict(self, peers: int, *, steps: int = 1000) -> SimResult:
        """Predict a run of ``steps`` inner steps on ``peers`` peers. Raises ``ValueError`` for
        a non-positive count or per-peer rates that do not match ``peers``."""
        if not isinstance(peers, int) or isinstance(peers, bool) or peers < 1:
            raise ValueError(f"peers must be a positive int, got {peers!r}")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        c = self.compute_s_per_step
        s = self.strategy
        t_round = collective_time(s.bytes_per_round, peers, self.network)
        hidden = min(t_round, s.overlap * s.steps_per_round * c)
        exposed = (t_round - hidden) / s.steps_per_round
        step_plain = c + exposed
        failures_per_hour = peers * self.failures.failures_per_peer_per_hour
        phi = failures_per_hour / 3600.0 * (self.failures.recovery_s + t_round)
        step = step_plain / (1.0 - phi) if phi < 1.0 else math.inf
        return SimResult(
            peers=peers,
            strategy=s.name,
            algorithm=self.network.algorithm,
            steps=steps,
            compute_s=c,
            round_comm_s=t_round,
            comm_s_per_step=t_round / s.steps_per_round,
            exposed_comm_s_per_step=exposed,
            step_s=step,
            step_s_no_failures=step_plain,
            total_s=steps * step,
            utilization=c / step,
            bytes_per_peer_per_step=collective_bytes(s.bytes_per_round, peers, self.network)
            / s.steps_per_round,
            failures_per_hour=failures_per_hour,
            failure_overhead=phi,
        )

    def sweep(self, peers: Sequence[int] = DEFAULT_PEERS, *, steps: int = 1000) -> list[SimResult]:
        """:meth:`predict` for each peer count."""
        return [self.predict(n, steps=steps) for n in peers]


# ---------------------------------------------------------------------------- tables


def _num(x: float) -> str:
    # three significant digits, never exponent notation (999.7 would print as "1e+03")
    return f"{x:.0f}" if x >= 999.5 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 1e-3:
        return f"{_num(seconds * 1e6)} us"
    if seconds < 1:
        return f"{_num(seconds * 1e3)} ms"
    if seconds < 120:
        return f"{_num(seconds)} s"
    if seconds < 2 * 3600:
        return f"{_num(seconds / 60)} min"
    if seconds < 2 * 86400:
        return f"{_num(seconds / 3600)} h"
    return f"{_num(seconds / 86400)} d"


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{_num(nbytes / scale)} {unit}"
    return f"{_num(nbytes)} B"


COLUMNS = (
    "peers",
    "strategy",
    "algorithm",
    "step",
    "comm/step",
    "exposed/step",
    "util",
    "total",
    "sent/peer/step",
    "failures/h",
)


def rows(results: Sequence[SimResult]) -> list[dict[str, str]]:
    """Human-readable table rows (column order :data:`COLUMNS`), for the CLI and reports."""
    out = []
    for r in results:
        out.append(
            {
                "peers": str(r.peers),
                "strategy": r.strategy,
                "algorithm": r.algorithm,
                "step": _duration(r.step_s),
                "comm/step": _duration(r.comm_s_per_step),
                "exposed/step": _duration(r.exposed_comm_s_per_step),
                "util": f"{100 * r.utilization:.1f}%",
                "total": _duration(r.total_s),
                "sent/peer/step": _size(r.bytes_per_peer_per_step),
                "failures/h": f"{r.failures_per_hour:.3g}",
            }
        )
    return out


def format_table(table: Sequence[Mapping[str, str]]) -> str:
    """Align rows (as from :func:`rows`) into a plain-text table with a header line."""
    if not table:
        return ""
    cols = list(table[0])
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in table)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in cols) for r in table]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- validation

METRICS = (
    "step_s",
    "comm_s_per_step",
    "exposed_comm_s_per_step",
    "utilization",
    "total_s",
    "round_comm_s",
    "bytes_per_peer_per_step",
)


@dataclass(frozen=True, kw_only=True)
class ValidationRow:
    """One measured number next to its prediction."""

    peers: int
    metric: str
    predicted: float
    measured: float
    rel_error: float
    """``(predicted - measured) / measured``: positive means the model is pessimistic."""


def validate(sim: Simulator, measured_rows: Sequence[Mapping[str, float]]) -> list[ValidationRow]:
    """Compare :meth:`Simulator.predict` with lab measurements, metric by metric.

    Each measured row needs ``peers`` and at least one of :data:`METRICS` (``total_s`` also
    needs ``steps``); other keys (labels) are ignored. Raises ``ValueError`` naming the row for a
    missing peer count, no known metric, or a measured value that is not finite and positive.
    """
    out: list[ValidationRow] = []
    for i, row in enumerate(measured_rows):
        if "peers" not in row:
            raise ValueError(f"measured row {i} has no 'peers': {dict(row)}")
        peers = row["peers"]
        if not isinstance(peers, int) or isinstance(peers, bool):
            raise ValueError(f"measured row {i}: peers must be an int, got {peers!r}")
        metrics = [m for m in METRICS if m in row]
        if not metrics:
            raise ValueError(f"measured row {i} has none of the metrics {', '.join(METRICS)}")
        steps = row.get("steps", 1000)
        if "total_s" in row and "steps" not in row:
            raise ValueError(f"measured row {i}: total_s needs the number of steps ('steps')")
        pred = sim.predict(peers, steps=int(steps))
        for m in metrics:
            measured = _finite(row[m], f"measured row {i}: {m}", strict=True)
            predicted = float(getattr(pred, m))
            out.append(
                ValidationRow(
                    peers=peers,
                    metric=m,
                    predicted=predicted,
                    measured=measured,
                    rel_error=(predicted - measured) / measured,
                )
            )
    return out
