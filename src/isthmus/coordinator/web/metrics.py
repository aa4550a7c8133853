"""``/metrics``: the run in the Prometheus text format, built with ``prometheus_client``.

Each coordinator has a registry of its own (two coordinators in one process, as in tests, never
share series). Most families are read from ``/v1/status`` at scrape time by :class:`RunCollector`,
so a scrape always agrees with the status and with the run's summary: the membership counters
(``isthmus_rounds_committed_total``, ``isthmus_rounds_aborted_total``,
``isthmus_parity_checks_total``, ``isthmus_parity_failures_total``, ``isthmus_resyncs_total``,
evictions, registrations, leaves, refusals), the world size, epoch and revision, every peer's bytes
sent by operation (as reported with its heartbeats and when it leaves), its steps per second, last
loss and state revision, stragglers and checkpoints. The round duration histogram
(``isthmus_round_duration_seconds``, by outcome) is observed by the dashboard's watcher as rounds
finish.

A peer that registered again under the same name (after an eviction) keeps one series: its
session's byte counters carry over, so the latest registration's values are the peer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from isthmus.coordinator.web.view import RunView

__all__ = ["CONTENT_TYPE", "RunCollector", "RunMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The text exposition format's content type (``prometheus_client.CONTENT_TYPE_LATEST``, whose
value differs between releases)."""

ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Round durations span milliseconds (DDP on one machine) to minutes (a big outer step on a WAN)."""

COUNTER_HELP = {
    "registrations": "Peer registrations (a peer that registers again counts again).",
    "rounds_committed": "Rounds committed by every member.",
    "rounds_aborted": "Rounds aborted (a member failed, died or was evicted).",
    "parity_checks": "Formations that compared the members' state hashes.",
    "parity_failures": "In-sync peers whose state differed from the majority's.",
    "resyncs": "Peers that received tensors before a round (joiners, stale or corrupt peers).",
    "evictions": "Peers evicted (crashed, stopped, cut off or timed out).",
    "leaves": "Peers that left the run cleanly.",
    "refusals": "Peers refused for a shared state that does not match the run's.",
    "isolations": "Peers left out because a member could not reach them (or they it).",
    "readmissions": "Isolated peers taken back after probes found their links up again.",
}


def _latest_by_name(peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per peer name: its latest registration (highest id)."""
    by: dict[str, dict[str, Any]] = {}
    for p in peers:
        name = str(p.get("name"))
        if name not in by or int(p.get("id", -1)) > int(by[name].get("id", -1)):
            by[name] = p
    return [by[n] for n in sorted(by)]


class RunCollector(Collector):
    """Families read from the coordinator's status (and the view's peer rows) at scrape time.

    ``status()`` returns ``/v1/status``'s dict; ``now()`` the coordinator's clock. Raises
    nothing of its own: a peer's malformed heartbeat info is shown as missing, not as an error.
    """

    def __init__(
        self, status: Callable[[], dict[str, Any]], view: RunView, now: Callable[[], float]
    ) -> None:
        self._status = status
        self._view = view
        self._now = now

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        counters = st.get("counters", {})
        for name, help_text in COUNTER_HELP.items():
            yield CounterMetricFamily(
                f"isthmus_{name}", help_text, value=float(counters.get(name, 0))
            )
        yield GaugeMetricFamily(
            "isthmus_world_size", "Live members of the current epoch.", value=st.get("world", 0)
        )
        yield GaugeMetricFamily(
            "isthmus_epoch", "Current membership epoch.", value=st.get("epoch", 0)
        )
        yield GaugeMetricFamily(
            "isthmus_revision",
            "Committed rounds (the shared state's revision).",
            value=st.get("revision", 0),
        )
        yield GaugeMetricFamily(
            "isthmus_isolated_peers",
            "Live peers left out because a member cannot reach them (or they it).",
            value=len(st.get("isolated") or {}),
        )
        states = GaugeMetricFamily("isthmus_peers", "Peers known, by state.", labels=["state"])
        by_state: dict[str, int] = {}
        for p in st.get("peers", []):
            by_state[str(p.get("state"))] = by_state.get(str(p.get("state")), 0) + 1
        for state in ("active", "dead", "left", "refused"):
            states.add_metric([state], by_state.get(state, 0))
        yield states
        yield from self._peer_families(st)
        yield from self._checkpoint_families(st.get("checkpoint") or {})

    def _peer_families(self, st: dict[str, Any]) -> Iterator[Metric]:
        rows = _latest_by_name(self._view.peer_rows(self._now(), st))
        sent = CounterMetricFamily(
            "isthmus_peer_bytes_sent",
            "Bytes a peer put on the wire for collectives, by operation (its own accounting).",
            labels=["peer", "op"],
        )
        speed = GaugeMetricFamily(
            "isthmus_peer_steps_per_second", "Training steps per second (recent).", labels=["peer"]
        )
        loss = GaugeMetricFamily("isthmus_peer_loss", "Last reported loss.", labels=["peer"])
        revision = GaugeMetricFamily(
            "isthmus_peer_revision", "The peer's shared-state revision.", labels=["peer"]
        )
        heartbeat = GaugeMetricFamily(
            "isthmus_peer_heartbeat_age_seconds",
            "Seconds since the peer's last sign of life.",
            labels=["peer"],
        )
        straggled = CounterMetricFamily(
            "isthmus_peer_straggler_rounds",
            "Rounds at which this peer was the last member to begin.",
            labels=["peer"],
        )
        waited = CounterMetricFamily(
            "isthmus_peer_straggler_wait_seconds",
            "Time the other members waited for this peer at those rounds.",
            labels=["peer"],
        )
        for r in rows:
            name = str(r["name"])
            for op, n in sorted(r["bytes_by_op"].items()):
                sent.add_metric([name, op], float(n))
            straggled.add_metric([name], float(r["straggled"]))
            waited.add_metric([name], float(r["straggle_s"]))
            if r["state"] != "active":
                continue  # gauges of a peer that is gone would only go stale
            if r["steps_per_s"] is not None:
                speed.add_metric([name], r["steps_per_s"])
            if r["loss"] is not None:
                loss.add_metric([name], r["loss"])
            if r["revision"] is not None:
                revision.add_metric([name], r["revision"])
            heartbeat.add_metric([name], float(r["last_heartbeat_s"] or 0.0))
        yield from (sent, speed, loss, revision, heartbeat, straggled, waited)

    @staticmethod
    def _checkpoint_families(ck: dict[str, Any]) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "isthmus_checkpoints_written",
            "Complete checkpoints written.",
            value=ck.get("written", 0),
        )
        yield CounterMetricFamily(
            "isthmus_checkpoint_part_failures",
            "Checkpoint parts that peers failed to write.",
            value=ck.get("failures", 0),
        )
        latest = ck.get("latest")
        if latest:
            yield GaugeMetricFamily(
                "isthmus_checkpoint_latest_revision",
                "Revision of the latest complete checkpoint.",
                value=latest.get("revision", 0),
            )


class RunMetrics:
    """One coordinator's registry: the status-backed families and the round duration histogram."""

    def __init__(
        self, status: Callable[[], dict[str, Any]], view: RunView, now: Callable[[], float]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RunCollector(status, view, now))
        self.round_duration = Histogram(
            "isthmus_round_duration_seconds",
            "Time from a round's formation to its commit or abort.",
            labelnames=["outcome"],
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        for outcome in ("committed", "aborted"):
            self.round_duration.labels(outcome)  # both series exist from the start

    def observe(self, outcome: str, seconds: float) -> None:
        self.round_duration.labels(outcome).observe(seconds)

    def render(self) -> bytes:
        """The text exposition of every family."""
        return generate_latest(self.registry)
