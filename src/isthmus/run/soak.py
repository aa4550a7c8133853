"""``isthmus lab soak``: one scenario for a fixed time, judged on progress, parity and hangs.

A soak is a lab run (:func:`~isthmus.run.lab_run.run_lab`) ended by the clock: ``--minutes`` becomes
the run's timeout, so a scenario for soaking sets ``steps`` higher than the time allows (see
``scenarios/soak_*.toml``). While it runs, a sampler reads every peer process's RSS, thread count
and open descriptors from ``/proc`` (``resources.jsonl``) and watches each process's step records
for progress. Afterwards the run directory gets ``soak.json``, ``soak.md`` and two plots.

It fails (exit code 1 from the command) when

* two consecutive commits lie further apart than ``--max-stall`` seconds (also from the first
  round to the first commit, and from the last commit to the end of the run),
* any parity check failed, or
* a peer process hung: it was running (not stopped by the scenario) and wrote no step record for
  ``hang_s`` while others did, or it was still alive after the run ended.

Times are compared as Unix timestamps (``ts``) only. The ``t`` fields of the run's files count
from different origins (``events.jsonl`` from the coordinator's start, ``churn.jsonl`` from the
first round); subtracting one from the other adds the peers' start-up time to every interval.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from isthmus.extras import MissingExtra
from isthmus.lab.scenario import Scenario
from isthmus.run.lab_run import LabOptions, run_lab
from isthmus.run.record import RunDir, read_jsonl
from isthmus.run.report import pyplot

__all__ = ["SoakOptions", "SoakReport", "analyze", "run_soak"]

log = logging.getLogger("isthmus.soak")


@dataclass(kw_only=True)
class SoakOptions:
    """How long to soak and what counts as a failure."""

    minutes: float
    """Length of the run (its timeout); peers still running then are stopped."""
    max_stall_s: float
    """Longest allowed time between two commits."""
    hang_s: float | None = None
    """A running peer without a step record for this long (while others progress) is hung;
    default: ``max(60, 10 * max_stall_s)``."""
    sample_s: float = 2.0
    """How often peer processes are sampled."""
    top: int = 10
    """How many of the longest stalls the report details."""

    def __post_init__(self) -> None:
        for name in ("minutes", "max_stall_s", "sample_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.hang_s is not None and self.hang_s <= 0:
            raise ValueError(f"hang_s must be positive, got {self.hang_s!r}")
        if self.top < 1:
            raise ValueError(f"top must be >= 1, got {self.top}")

    @property
    def hang_bound_s(self) -> float:
        return self.hang_s if self.hang_s is not None else max(60.0, 10 * self.max_stall_s)


# ---------------------------------------------------------------------------- sampling


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return out


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def peer_processes(run_dir: RunDir) -> dict[int, str]:
    """Live processes running a peer job of ``run_dir``: pid -> peer name."""
    root = run_dir.path.resolve()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "isthmus.run.job" not in args or not args[-1].endswith(".job.json"):
            continue
        job = Path(args[-1])
        if job.resolve().parent == root:
            out[int(entry)] = job.name[: -len(".job.json")]
    return out


class Sampler:
    """Samples every peer process of ``run_dir`` on a thread: resources to ``resources.jsonl``,
    and hangs (a running process whose step records stop growing while others' grow)."""

    def __init__(self, run_dir: RunDir, *, every_s: float, hang_s: float) -> None:
        self.run_dir, self.every_s, self.hang_s = run_dir, every_s, hang_s
        self.hung: list[dict[str, Any]] = []
        self._progress: dict[int, tuple[int, float]] = {}  # pid -> (records size, since)
        self._flagged: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="isthmus-soak", daemon=True)
        # Opened at the first row: the lab refuses a directory that already holds .jsonl files.
        self._file: Any = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._file is not None:
            self._file.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sample()
            except Exception as e:  # a sampling hiccup must not end the soak
                log.warning("sampling peer processes failed: %s", e)

    def sample(self) -> list[dict[str, Any]]:
        now = time.time()
        rows, moved = [], False
        for pid, name in peer_processes(self.run_dir).items():
            try:
                st, state = _status(pid), _state(pid)
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue  # it exited meanwhile
            try:
                size = self.run_dir.records_path(name).stat().st_size
            except OSError:
                size = 0
            last, since = self._progress.get(pid, (-1, now))
            if size != last or state in ("T", "t"):  # a stopped process is not hung
                moved |= size != last and last >= 0
                since = now
            self._progress[pid] = (size, since)
            rows.append(
                {
                    "ts": round(now, 3),
                    "name": name,
                    "pid": pid,
                    "state": state,
                    "rss_mb": round(st.get("VmRSS", 0) / 1024, 2),
                    "threads": st.get("Threads", 0),
                    "fds": fds,
                    "quiet_s": round(now - since, 1),
                }
            )
        for r in rows:
            if moved and r["quiet_s"] > self.hang_s and r["pid"] not in self._flagged:
                self._flagged.add(r["pid"])
                self.hung.append({**r, "why": f"no step record for {r['quiet_s']:.0f}s"})
        if rows and self._file is None:
            self._file = (self.run_dir.path / "resources.jsonl").open("a")
        for r in rows:
            self._file.write(json.dumps(r) + "\n")
        if rows:
            self._file.flush()
        return rows


# ---------------------------------------------------------------------------- analysis


@dataclass
class SoakReport:
    """What a soak measured (``soak.json``) and its verdict."""

    scenario: str
    minutes: float
    max_stall_s: float
    ok: bool = False
    reasons: list[str] = field(default_factory=list)
    rounds_committed: int = 0
    rounds_aborted: int = 0
    parity_failures: int = 0
    resyncs: int = 0
    failures: int = 0
    """SIGKILLs and SIGSTOPs applied."""
    longest_stall_s: float = 0.0
    stalls_over_bound: int = 0
    stalls: list[dict[str, Any]] = field(default_factory=list)
    """The longest gaps between commits, with the events around them."""
    failure_to_commit_s: dict[str, float | None] = field(default_factory=dict)
    """From each kill or stop to the next commit: median, p99, max."""
    detection_s: dict[str, float | None] = field(default_factory=dict)
    """From each stop to the stopped process's eviction."""
    eviction_to_commit_s: dict[str, float | None] = field(default_factory=dict)
    """From each eviction of a member to the next commit (the abort releasing the survivors)."""
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    hung: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "p99": None, "max": None}
    v = sorted(values)
    p99 = v[min(len(v) - 1, round(0.99 * (len(v) - 1)))]
    return {
        "n": len(v),
        "median": round(statistics.median(v), 3),
        "p99": round(p99, 3),
        "max": round(v[-1], 3),
    }


def _end_of_run(events: list[dict[str, Any]]) -> float | None:
    """When the run was ended: the first of the departures that close the event log (the
    launcher stops every peer at once; their departures land within a second or two)."""
    i = len(events)
    while i > 0 and events[i - 1]["kind"] in ("dead", "left"):
        if i < len(events) and events[i]["ts"] - events[i - 1]["ts"] > 2.0:
            break
        i -= 1
    return events[i]["ts"] if i < len(events) else None


def _around(
    events: list[dict[str, Any]], churn: list[dict[str, Any]], a: float, b: float, t0: float
) -> list[str]:
    keep = ("dead", "left", "quiet", "register", "epoch", "abort", "resync", "parity_failure")
    lines = []
    for e in events:
        if a <= e["ts"] <= b and e["kind"] in keep:
            what = e.get("name") or e.get("members") or ""
            if e["kind"] == "resync":
                what = "to " + ", ".join(str(t.get("dst")) for t in e.get("transfers", []))
            elif e["kind"] == "abort":
                what = f"round {e.get('round')}"
            why = e.get("reason", "")
            lines.append((e["ts"], f"{e['ts'] - t0:8.2f}s {e['kind']} {what} {why}".rstrip()[:160]))
    for c in churn:
        if a <= c["ts"] <= b and "skipped" not in c:
            lines.append((c["ts"], f"{c['ts'] - t0:8.2f}s churn: {c['action']} {c['name']}"))
    return [text for _, text in sorted(lines)]


def _resources(rows: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per process that lived through the soak (sampled past ``warmup_s`` after it appeared):
    first (after warm-up), last and largest RSS, threads and descriptors."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(f"{r['name']} (pid {r['pid']})", []).append(r)
    out = {}
    for key, rs in by.items():
        later = [r for r in rs if r["ts"] - rs[0]["ts"] >= warmup_s]
        if len(later) < 2:
            continue
        first, last = later[0], later[-1]
        out[key] = {
            "lived_s": round(last["ts"] - rs[0]["ts"], 1),
            **{
                f"{m}_{k}": v
                for m in ("rss_mb", "threads", "fds")
                for k, v in (
                    ("first", first[m]),
                    ("last", last[m]),
                    ("max", max(r[m] for r in later)),
                    ("growth", round(last[m] - first[m], 2)),
                )
            },
        }
    return out


def analyze(
    run_dir: RunDir,
    opts: SoakOptions,
    *,
    scenario: str = "",
    hung: Sequence[dict[str, Any]] = (),
) -> SoakReport:
    """Measure a finished soak's run directory (see the module docstring for the verdict).
    Raises FileNotFoundError if it has no summary."""
    summary = run_dir.summary()
    events = sorted(run_dir.events(), key=lambda e: e["ts"])
    churn = run_dir.churn()
    rows = read_jsonl(run_dir.path / "resources.jsonl")
    rep = SoakReport(scenario=scenario, minutes=opts.minutes, max_stall_s=opts.max_stall_s)
    rep.rounds_committed, rep.rounds_aborted = summary.rounds_committed, summary.rounds_aborted
    rep.parity_failures, rep.resyncs = summary.parity_failures, summary.resyncs
    rep.wall_s, rep.hung = summary.wall_s, list(hung)
    epochs = [e["ts"] for e in events if e["kind"] == "epoch"]
    commits = [e["ts"] for e in events if e["kind"] == "commit"]
    t0 = epochs[0] if epochs else (events[0]["ts"] if events else 0.0)
    end = _end_of_run(events)
    marks = [t0, *commits] + (
        [end] if end is not None and (not commits or end > commits[-1]) else []
    )
    gaps = sorted(((b - a, a, b) for a, b in itertools.pairwise(marks)), reverse=True)
    rep.longest_stall_s = round(gaps[0][0], 3) if gaps else 0.0
    rep.stalls_over_bound = sum(1 for g in gaps if g[0] > opts.max_stall_s)
    for gap, a, b in gaps[: opts.top]:
        rep.stalls.append(
            {
                "gap_s": round(gap, 3),
                "from_s": round(a - t0, 3),
                "to_s": round(b - t0, 3),
                "events": _around(events, churn, a - 1.0, b + 0.5, t0),
            }
        )
    failures = [c for c in churn if c["action"] in ("kill", "stop") and "skipped" not in c]
    rep.failures = len(failures)
    to_commit, detect = [], []
    for c in failures:
        nxt = next((t for t in commits if t > c["ts"]), None)
        if nxt is not None:
            to_commit.append(nxt - c["ts"])
        dead = next(
            (
                e["ts"]
                for e in events
                if e["kind"] == "dead" and e.get("name") == c["name"] and e["ts"] > c["ts"]
            ),
            None,
        )
        # a stop counts only if the eviction came while the process was stopped: one stopped
        # while it was not a member (between an eviction and its registration) is never evicted
        resumed = next(
            (
                x["ts"]
                for x in churn
                if x["action"] == "cont" and x.get("name") == c["name"] and x["ts"] > c["ts"]
            ),
            float("inf"),
        )
        if c["action"] == "stop" and dead is not None and dead < resumed:
            detect.append(dead - c["ts"])
    evictions = [e["ts"] for e in events if e["kind"] == "abort" and "dead" in e.get("reason", "")]
    after = [n - t for t in evictions if (n := next((x for x in commits if x > t), None))]
    rep.failure_to_commit_s = _stats(to_commit)
    rep.detection_s = _stats(detect)
    rep.eviction_to_commit_s = _stats(after)
    rep.resources = _resources(rows, warmup_s=min(60.0, opts.minutes * 6))
    if rep.stalls_over_bound:
        rep.reasons.append(
            f"{rep.stalls_over_bound} stall(s) longer than {opts.max_stall_s}s "
            f"(longest {rep.longest_stall_s}s)"
        )
    if rep.parity_failures:
        rep.reasons.append(f"{rep.parity_failures} parity failure(s)")
    if rep.hung:
        rep.reasons.append(f"{len(rep.hung)} hung peer process(es)")
    if not commits:
        rep.reasons.append("no round committed")
    rep.ok = not rep.reasons
    return rep


# ---------------------------------------------------------------------------- report


def _plots(run_dir: RunDir, rows: list[dict[str, Any]], t0: float) -> list[str]:
    plt = pyplot()

    written = []
    if rows:
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        by: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by.setdefault(f"{r['name']} ({r['pid']})", []).append(r)
        for ax, (key, label) in zip(
            axes, (("rss_mb", "RSS (MB)"), ("threads", "threads"), ("fds", "open fds")), strict=True
        ):
            for name, rs in sorted(by.items()):
                ax.plot([r["ts"] - t0 for r in rs], [r[key] for r in rs], label=name, lw=1)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("seconds since the first round")
        if len(by) <= 12:
            axes[0].legend(fontsize=7, ncol=3)
        fig.suptitle("peer processes over the soak")
        fig.tight_layout()
        fig.savefig(run_dir.path / "soak_resources.png", dpi=110)
        plt.close(fig)
        written.append("soak_resources.png")
    events = run_dir.events()
    commits = sorted(e["ts"] for e in events if e["kind"] == "commit")
    if len(commits) > 1:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.plot(
            [b - t0 for b in commits[1:]], [b - a for a, b in itertools.pairwise(commits)], lw=0.8
        )
        for c in run_dir.churn():
            if "skipped" not in c:
                colour = {"kill": "black", "stop": "red"}.get(c["action"], "green")
                ax.axvline(c["ts"] - t0, color=colour, alpha=0.25, lw=0.8)
        ax.set_xlabel(
            "seconds since the first round (lines: kill black, stop red, join/cont green)"
        )
        ax.set_ylabel("time since previous commit (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(run_dir.path / "soak_commits.png", dpi=110)
        plt.close(fig)
        written.append("soak_commits.png")
    return written


def _fmt(stats: Mapping[str, float | None]) -> str:
    if not stats.get("n"):
        return "-"
    return (
        f"median {stats['median']} s, p99 {stats['p99']} s, max {stats['max']} s (n={stats['n']})"
    )


def write_report(run_dir: RunDir, rep: SoakReport) -> Path:
    """``soak.json``, ``soak.md`` and the plots in ``run_dir``; returns the path of soak.md."""
    run_dir.write_json("soak.json", rep.to_json())
    events = run_dir.events()
    epochs = [e["ts"] for e in events if e["kind"] == "epoch"]
    t0 = min(epochs) if epochs else 0.0
    try:
        plots = _plots(run_dir, read_jsonl(run_dir.path / "resources.jsonl"), t0)
    except MissingExtra as e:  # the verdict and the figures do not need the plots
        log.warning("soak plots skipped: %s", e)
        plots = []
    verdict = "PASS" if rep.ok else "FAIL: " + "; ".join(rep.reasons)
    lines = [
        f"# Soak: {rep.scenario}",
        "",
        f"**{verdict}**",
        "",
        f"{rep.minutes} min, stall bound {rep.max_stall_s} s. Rounds committed "
        f"{rep.rounds_committed}, aborted {rep.rounds_aborted}, resyncs {rep.resyncs}, parity "
        f"failures {rep.parity_failures}, failures applied (kills and stops) {rep.failures}.",
        "",
        f"- longest stall: {rep.longest_stall_s} s; stalls over the bound: {rep.stalls_over_bound}",
        f"- failure to the next commit: {_fmt(rep.failure_to_commit_s)}",
        f"- SIGSTOP to eviction: {_fmt(rep.detection_s)}",
        f"- eviction (abort) to the next commit: {_fmt(rep.eviction_to_commit_s)}",
        "",
        "## Longest stalls",
        "",
    ]
    for s in rep.stalls:
        lines += [f"### {s['gap_s']} s, from {s['from_s']} s to {s['to_s']} s", "", "```"]
        lines += s["events"] or ["(no event)"]
        lines += ["```", ""]
    lines += [
        "## Peer processes",
        "",
        "| process | lived (s) | RSS MB first / last / max | threads first / last / max "
        "| fds first / last / max |",
        "|---|---|---|---|---|",
    ]
    for name, r in sorted(rep.resources.items()):
        lines.append(
            f"| {name} | {r['lived_s']} | {r['rss_mb_first']} / {r['rss_mb_last']} / "
            f"{r['rss_mb_max']} | {r['threads_first']} / {r['threads_last']} / "
            f"{r['threads_max']} | {r['fds_first']} / {r['fds_last']} / {r['fds_max']} |"
        )
    if rep.hung:
        lines += ["", "## Hung peer processes", ""]
        lines += [f"- {h['name']} (pid {h['pid']}): {h['why']}" for h in rep.hung]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    path = run_dir.path / "soak.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- the command


def run_soak(
    scenario: Scenario,
    opts: SoakOptions,
    lab: LabOptions | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[SoakReport, RunDir]:
    """Run ``scenario`` for ``opts.minutes`` and judge it; writes the lab's run directory plus
    the soak's files. Raises what :func:`~isthmus.run.lab_run.run_lab` raises (a bad scenario or
    setting, a network that cannot be built; KeyboardInterrupt after tearing everything down)."""
    over = dict(overrides or {})
    over["timeout"] = opts.minutes * 60.0
    over.setdefault(
        "run_dir", str(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{scenario.run.name}")
    )
    run_dir = RunDir(over["run_dir"])
    if run_dir.path.exists() and any(run_dir.path.glob("*.jsonl")):
        raise FileExistsError(f"{run_dir} already holds a run's results; choose another --run-dir")
    sampler = Sampler(run_dir, every_s=opts.sample_s, hang_s=opts.hang_bound_s)
    sampler.start()
    try:
        run_lab(scenario, lab, overrides=over)
    finally:
        sampler.stop()
    hung = list(sampler.hung)
    for pid, name in peer_processes(run_dir).items():  # the launcher's teardown missed it
        hung.append({"name": name, "pid": pid, "why": "still running after the run ended"})
    rep = analyze(run_dir, opts, scenario=scenario.source or scenario.run.name, hung=hung)
    write_report(run_dir, rep)
    return rep, run_dir
