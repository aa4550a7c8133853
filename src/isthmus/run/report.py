"""Reports for a run directory: plots a person would rather look at than read, and a page.

Works on any run directory written by the launcher (demo, lab, ``isthmus run``): ``metrics.jsonl``
with one record per peer and step, ``events.jsonl`` with the coordinator's membership events,
``summary.json``, and in lab runs ``links.jsonl`` with interface counters; they are read by
:func:`~isthmus.run.report_data.load_run`. Writes:

* ``loss_vs_step.png``, ``loss_vs_time.png``, ``loss_vs_bytes.png``: training loss of every peer
  (thin lines) and their mean per step (thick), with eval loss points when recorded;
* ``world_size.png``: peers in the run over time, with kills/evictions, joins and aborted rounds;
* ``link_utilization.png`` (lab runs): each link's throughput against its shaped rate;
* ``report.md``: the summary as a table and the plots embedded;
* ``report.html``: the same on one self-contained page (plots inside it), with the events as a
  timeline (:mod:`isthmus.run.report_html`).

:func:`compare_runs` overlays several runs (``isthmus lab compare RUN...``) in ``compare.md``
and ``compare.html``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from isthmus.extras import require
from isthmus.run.report_data import LoadedRun, load_run
from isthmus.run.report_html import write_compare_html, write_html_report

__all__ = ["LoadedRun", "compare_runs", "load_run", "plot_run", "pyplot", "write_report"]


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (the Agg backend). Raises
    :class:`~isthmus.extras.MissingExtra` naming the ``lab`` extra when matplotlib is missing."""
    matplotlib = require("matplotlib", extra="lab", what="plotting a run")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _t0(run: LoadedRun) -> float:
    stamps = [r["ts"] for r in run.metrics if "ts" in r] + [
        e["ts"] for e in run.events if "ts" in e
    ]
    return min(stamps) if stamps else 0.0


def _mean_by_step(
    metrics: list[dict[str, Any]], key: str = "loss"
) -> tuple[list[int], list[float]]:
    by: dict[int, list[float]] = defaultdict(list)
    for r in metrics:
        v = r.get(key)
        if v is not None and math.isfinite(v):
            by[int(r["step"])].append(float(v))
    steps = sorted(by)
    return steps, [sum(by[s]) / len(by[s]) for s in steps]


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    if len(ys) < 2 * k:
        return ys
    out = []
    for i in range(len(ys)):
        w = ys[max(0, i - k) : i + k + 1]
        out.append(sum(w) / len(w))
    return out


def _label(run: LoadedRun) -> str:
    s = run.summary
    if s is None:
        return run.dir.name
    parts = [s.strategy or run.dir.name]
    if s.compression not in (None, "none"):
        parts.append(s.compression)
    if s.aggregator not in (None, "mean"):
        parts.append(s.aggregator)
    return " ".join(parts)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNG plots, ``report.md`` and ``report.html`` for one run; returns the files
    written. Raises FileNotFoundError naming the directory if it is not a run directory, and
    :class:`~isthmus.extras.MissingExtra` naming the ``lab`` extra without matplotlib."""
    plt = pyplot()

    run = load_run(run_dir)
    d: Path = run.dir
    t0 = _t0(run)
    by_peer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.metrics:
        by_peer[r.get("peer", "?")].append(r)
    for recs in by_peer.values():
        recs.sort(key=lambda r: (r.get("ts", 0.0), r["step"]))
    written: list[Path] = []

    # loss vs step / time / bytes
    for kind, xlabel in (
        ("step", "step"),
        ("time", "wall-clock (s)"),
        ("bytes", "bytes sent by this peer (MB)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for peer, recs in sorted(by_peer.items()):
            xs = [_x(r, kind, t0) for r in recs]
            ax.plot(xs, _smooth([r["loss"] for r in recs]), lw=0.8, alpha=0.6, label=peer)
            ev = [(_x(r, kind, t0), r["eval_loss"]) for r in recs if "eval_loss" in r]
            if ev:
                ax.scatter(*zip(*ev, strict=True), s=14, marker="o")
        if kind == "step":
            steps, mean = _mean_by_step(run.metrics)
            ax.plot(steps, _smooth(mean), color="black", lw=2, label="mean")
            s = run.summary
            if s is not None and s.final_eval_loss is not None and s.steps:
                ax.scatter(
                    [s.steps], [s.final_eval_loss], color="red", zorder=5, label="final eval"
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (smoothed)")
        ax.set_title(f"{_label(run)}: loss vs {kind}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run with no loss records has nothing to name
            ax.legend(fontsize=7, ncol=2)
        p = d / f"loss_vs_{kind}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    # world size with events
    epochs = [e for e in run.events if e["kind"] == "epoch"]
    if epochs:
        fig, ax = plt.subplots(figsize=(7, 3.2))

        def when(e: dict[str, Any]) -> float:
            return float(e["ts"]) - t0 if "ts" in e else float(e["t"])

        # the line runs on to the run's last event, so the final membership is visible
        xs = [when(e) for e in epochs] + [max(when(e) for e in run.events)]
        ys = [e["world"] for e in epochs] + [epochs[-1]["world"]]
        ax.step(xs, ys, where="post", color="black", label="peers in the run")
        marks = {
            "dead": ("red", "x", "evicted/killed"),
            "register": ("green", "^", "registered"),
            "abort": ("orange", "|", "round aborted"),
            "left": ("gray", "v", "left"),
        }
        top = max(e["world"] for e in epochs) + 0.5
        for kind, (color, marker, label) in marks.items():
            pts = [when(e) for e in run.events if e["kind"] == kind]
            if pts:
                ax.scatter(pts, [top] * len(pts), color=color, marker=marker, label=label, s=30)
        # the lab's churn actions (what was done to the peers, as opposed to what the
        # coordinator noticed): one row below the coordinator's events
        churn_marks = {
            "kill": ("darkred", "X"),
            "join": ("darkgreen", "P"),
            "stop": ("purple", "s"),
            "cont": ("teal", "D"),
        }
        for action, (color, marker) in churn_marks.items():
            pts = [
                float(c["ts"]) - t0
                for c in run.churn
                if c.get("action") == action and not c.get("skipped") and "ts" in c
            ]
            if pts:
                ax.scatter(
                    pts,
                    [top - 0.35] * len(pts),
                    color=color,
                    marker=marker,
                    s=28,
                    label=f"lab: {action}",
                )
        ax.set_xlabel("wall-clock (s)")
        ax.set_ylabel("peers")
        ax.set_ylim(0, top + 0.7)
        ax.set_title("membership over time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        p = d / "world_size.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    if run.links:
        p = _plot_links(run, d, t0, plt)
        written.append(p)
    images = [w.name for w in written]
    written.append(write_report(run, images))
    written.append(write_html_report(run, images, t0, f"Run report: {_label(run)}"))
    return written


def _x(r: dict[str, Any], kind: str, t0: float) -> float:
    if kind == "step":
        return float(r["step"])
    if kind == "time":
        return float(r["ts"]) - t0 if "ts" in r else float(r.get("t", 0.0))
    return float(r.get("bytes_sent", 0)) / 1e6


def _plot_links(run: LoadedRun, d: Path, t0: float, plt: Any) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.links:
        by[r["node"]].append(r)
    for node, recs in sorted(by.items()):
        recs.sort(key=lambda r: r["ts"])
        xs, ys = [], []
        for a, b in itertools.pairwise(recs):
            dt = b["ts"] - a["ts"]
            if dt > 0:
                xs.append(b["ts"] - t0)
                ys.append(8 * (b["tx_bytes"] - a["tx_bytes"]) / dt / 1e6)
        (line,) = ax.plot(xs, ys, lw=1, label=f"{node} tx")
        rate = recs[0].get("rate_mbit")
        if rate:
            ax.axhline(rate, color=line.get_color(), ls="--", lw=0.8)
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("Mbit/s (dashed: shaped rate)")
    ax.set_title("link utilization")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    p = d / "link_utilization.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_report(run: LoadedRun, images: list[str]) -> Path:
    """``report.md``: the summary as a table, then the plots."""
    d: Path = run.dir
    lines = [
        f"# Run report: {_label(run)}",
        "",
        f"Run directory: `{d}`",
        "",
        "| key | value |",
        "|---|---|",
    ]
    for k, v in (run.summary.to_json() if run.summary is not None else {}).items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v)
        lines.append(f"| {k} | {v} |")
    lines.append("")
    for img in images:
        lines += [f"![{img}]({img})", ""]
    p = d / "report.md"
    p.write_text("\n".join(lines))
    return p


def compare_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Overlay several runs: mean loss against step, wall-clock and total bytes; a table of their
    summaries in ``compare.md``, and all of it with each run's timeline in ``compare.html``.
    Returns the files written. Raises FileNotFoundError naming a directory that is not a run's,
    and :class:`~isthmus.extras.MissingExtra` naming the ``lab`` extra without matplotlib."""
    plt = pyplot()

    runs = [load_run(r) for r in run_dirs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in ("step", "time", "bytes"):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in runs:
            t0 = _t0(run)
            steps, mean = _mean_by_step(run.metrics)
            if kind == "step":
                xs = steps
            else:
                per_step: dict[int, float] = {}
                for r in run.metrics:
                    x = _x(r, "time", t0) if kind == "time" else 0.0
                    per_step[int(r["step"])] = max(per_step.get(int(r["step"]), 0.0), x)
                if kind == "bytes":
                    total = _bytes_by_step(run.metrics)
                    xs = [total.get(s, 0.0) / 1e6 for s in steps]
                else:
                    xs = [per_step[s] for s in steps]
            ax.plot(xs, _smooth(mean), lw=1.5, label=_label(run))
        ax.set_xlabel(
            {"step": "step", "time": "wall-clock (s)", "bytes": "bytes sent by all peers (MB)"}[
                kind
            ]
        )
        if kind == "bytes":
            ax.set_xscale("symlog")
        ax.set_ylabel("mean training loss (smoothed)")
        ax.set_title(f"loss vs {kind}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        p = out / f"compare_loss_vs_{kind}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    keys = [
        "strategy",
        "compression",
        "aggregator",
        "final_eval_loss",
        "bytes_sent_total",
        "rounds_committed",
        "rounds_aborted",
        "parity_failures",
        "peers_final",
        "wall_s",
    ]
    lines = [
        "# Comparison",
        "",
        "| run | " + " | ".join(keys) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for run in runs:
        row = run.summary.to_json() if run.summary is not None else {}
        lines.append(f"| {run.dir.name} | " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    lines.append("")
    lines += [f"![{p.name}]({p.name})" for p in written]
    md = out / "compare.md"
    md.write_text("\n".join(lines) + "\n")
    page = write_compare_html(
        runs, [_label(r) for r in runs], [_t0(r) for r in runs], list(written), keys, out
    )
    written += [md, page]
    return written


def _bytes_by_step(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Total bytes sent by all peers up to each step (each peer's running counter, summed)."""
    last: dict[str, float] = {}
    total: dict[int, float] = {}
    for r in sorted(metrics, key=lambda r: (r["step"], r.get("peer", ""))):
        last[r.get("peer", "?")] = float(r.get("bytes_sent", 0))
        total[int(r["step"])] = sum(last.values())
    return total
