"""``report.html`` and ``compare.html``: a run (or several) on one self-contained page.

Everything the page shows is inside the file: the PNG plots as base64 ``data:`` URLs, the
timeline as inline SVG, the styles in a ``<style>`` element, no script. It opens offline, can be
mailed or attached to an issue, and prints (one column, plots kept whole on a page).

The timeline draws the world size (from the coordinator's epochs) against wall-clock time and
marks what happened to the membership: joins (a peer registered), kills and evictions, clean
leaves, aborted rounds, parity failures, resyncs and checkpoints, and on a second row what the
launcher or the lab did on purpose (``churn.jsonl``: kill, join, stop, continue). Below it the
same events are listed (commits are counted, not listed: there can be thousands).
"""

from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path
from typing import Any

from isthmus.run.report_data import LoadedRun

__all__ = ["timeline_svg", "write_compare_html", "write_html_report"]

# kind -> (colour, marker, label); the marker is drawn by _marker
MARKS: dict[str, tuple[str, str, str]] = {
    "register": ("#1f9d55", "up", "join (registered)"),
    "dead": ("#d64545", "x", "killed / evicted"),
    "left": ("#6b7280", "down", "left"),
    "refused": ("#a12a2a", "x", "refused"),
    "abort": ("#d98a00", "bar", "round aborted"),
    "parity_failure": ("#7c3aed", "diamond", "parity failure"),
    "resync": ("#0f9bb0", "dot", "resync"),
    "checkpoint": ("#2f6fde", "diamond", "checkpoint"),
}
CHURN_MARKS: dict[str, tuple[str, str]] = {
    "kill": ("#8b1a1a", "x"),
    "join": ("#13643a", "up"),
    "stop": ("#7c3aed", "bar"),
    "cont": ("#0f766e", "dot"),
}

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2330;
  margin: 24px auto; max-width: 1040px; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.muted { color: #6b7280; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 3px 10px 3px 0; border-bottom: 1px solid #e3e6eb;
  vertical-align: top; }
th { color: #6b7280; font-weight: 500; }
td.v { word-break: break-word; max-width: 640px; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 12px; }
figure { margin: 0; break-inside: avoid; }
figure img { width: 100%; border: 1px solid #e3e6eb; }
figcaption { color: #6b7280; font-size: 12px; }
svg text { font-size: 11px; fill: #4b5563; }
.timeline { break-inside: avoid; }
.events { max-height: 480px; overflow: auto; }
.kind { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; color: #fff; }
.ok { color: #1f9d55; } .bad { color: #d64545; }
@media print {
  body { margin: 0; max-width: none; }
  .plots { grid-template-columns: 1fr; }
  .events { max-height: none; overflow: visible; }
  h2 { break-after: avoid; }
}
"""


def _esc(v: object) -> str:
    return html.escape(str(v), quote=True)


def _when(e: dict[str, Any], t0: float) -> float:
    return float(e["ts"]) - t0 if "ts" in e else float(e.get("t", 0.0))


def _marker(kind: str, x: float, y: float, color: str, title: str) -> str:
    t = f"<title>{_esc(title)}</title>"
    if kind == "up":
        pts = f"{x - 5},{y + 4} {x + 5},{y + 4} {x},{y - 5}"
        return f'<polygon points="{pts}" fill="{color}">{t}</polygon>'
    if kind == "down":
        pts = f"{x - 5},{y - 4} {x + 5},{y - 4} {x},{y + 5}"
        return f'<polygon points="{pts}" fill="{color}">{t}</polygon>'
    if kind == "x":
        d = f"M{x - 4},{y - 4}L{x + 4},{y + 4}M{x - 4},{y + 4}L{x + 4},{y - 4}"
        return f'<path d="{d}" stroke="{color}" stroke-width="2.5">{t}</path>'
    if kind == "bar":
        return f'<rect x="{x - 1.5}" y="{y - 6}" width="3" height="12" fill="{color}">{t}</rect>'
    if kind == "diamond":
        pts = f"{x},{y - 5} {x + 5},{y} {x},{y + 5} {x - 5},{y}"
        return f'<polygon points="{pts}" fill="{color}">{t}</polygon>'
    return f'<circle cx="{x}" cy="{y}" r="3.5" fill="{color}">{t}</circle>'


def _describe(e: dict[str, Any]) -> str:
    """One line of an event's details, without bulky fields."""
    skip = {"t", "ts", "kind", "transfers", "members", "digest", "tensors"}
    parts = [f"{k} {v}" for k, v in e.items() if k not in skip and v not in (None, "", [], {})]
    if e.get("kind") == "resync":
        parts.append(
            "; ".join(
                f"{t.get('src')} -> {t.get('dst')}: {len(t.get('names', []))} tensors"
                for t in e.get("transfers", [])
            )
        )
    if e.get("kind") == "epoch":
        parts.append(f"members {e.get('members')}")
    return ", ".join(parts)


def timeline_svg(
    events: list[dict[str, Any]],
    churn: list[dict[str, Any]],
    t0: float,
    *,
    width: int = 1000,
    height: int = 210,
) -> str:
    """The membership timeline as an inline ``<svg>`` (see the module docstring); an empty
    string when there are no events."""
    if not events:
        return ""
    times = [_when(e, t0) for e in events] + [
        float(c["ts"]) - t0 for c in churn if "ts" in c and not c.get("skipped")
    ]
    lo, hi = min(0.0, *times), max(times)
    hi = hi if hi > lo else lo + 1.0
    left, right, top, bottom = 40, 16, 46, 30
    epochs = [e for e in events if e.get("kind") == "epoch"]
    ymax = max([int(e.get("world", 0)) for e in epochs] + [1]) + 1

    def x(t: float) -> float:
        return round(left + (t - lo) * (width - left - right) / (hi - lo), 2)

    def y(w: float) -> float:
        return round(height - bottom - w * (height - top - bottom) / ymax, 2)

    out = [
        # inline SVG in HTML needs no namespace: the page names no URL at all
        f'<svg class="timeline" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="membership timeline">'
    ]
    for w in range(ymax + 1):
        out.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(w)}" y2="{y(w)}" stroke="#eef0f3"/>'
        )
        out.append(f'<text x="{left - 8}" y="{y(w) + 4}" text-anchor="end">{w}</text>')
    step = _tick_step(hi - lo)
    tick = 0.0
    while tick <= hi:
        if tick >= lo:
            out.append(
                f'<text x="{x(tick)}" y="{height - 10}" text-anchor="middle">{tick:g}s</text>'
            )
        tick += step
    if epochs:
        d = f"M{x(_when(epochs[0], t0))},{y(epochs[0]['world'])}"
        for e in epochs[1:]:
            d += f"H{x(_when(e, t0))}V{y(e['world'])}"
        d += f"H{x(hi)}"
        out.append(f'<path d="{d}" fill="none" stroke="#1d2330" stroke-width="2"/>')
    row = 12  # the coordinator's events on one row, the launcher's below it
    for e in events:
        mark = MARKS.get(str(e.get("kind")))
        if mark is not None:
            color, shape, label = mark
            title = f"{_when(e, t0):.2f}s {label}: {_describe(e)}"
            out.append(_marker(shape, x(_when(e, t0)), row, color, title))
    for c in churn:
        mark2 = CHURN_MARKS.get(str(c.get("action")))
        if mark2 is not None and "ts" in c and not c.get("skipped"):
            title = f"{float(c['ts']) - t0:.2f}s launcher: {c.get('action')} {c.get('name', '')}"
            out.append(_marker(mark2[1], x(float(c["ts"]) - t0), row + 16, mark2[0], title))
    out.append("</svg>")
    return "".join(out)


def _tick_step(span: float) -> float:
    for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if span / s <= 10:
            return float(s)
    return 7200.0


def _legend(events: list[dict[str, Any]], churn: list[dict[str, Any]]) -> str:
    """The markers that appear, with their meaning."""
    kinds = {e.get("kind") for e in events}
    actions = {c.get("action") for c in churn if not c.get("skipped")}
    items = [
        f'<span class="kind" style="background:{c}">{_esc(label)}</span>'
        for kind, (c, _, label) in MARKS.items()
        if kind in kinds
    ]
    items += [
        f'<span class="kind" style="background:{c}">launcher: {_esc(a)}</span>'
        for a, (c, _) in CHURN_MARKS.items()
        if a in actions
    ]
    return '<p class="muted">' + " ".join(items) + " &mdash; line: peers in the run</p>"


def _events_table(events: list[dict[str, Any]], t0: float) -> str:
    commits = sum(1 for e in events if e.get("kind") == "commit")
    rows = [
        f"<tr><td>{_when(e, t0):.2f}s</td><td>{_esc(e.get('kind'))}</td>"
        f'<td class="v">{_esc(_describe(e))}</td></tr>'
        for e in events
        if e.get("kind") != "commit"
    ]
    return (
        f'<p class="muted">{commits} rounds committed (not listed); every other event:</p>'
        '<div class="events"><table><tr><th>time</th><th>event</th><th>details</th></tr>'
        + "".join(rows)
        + "</table></div>"
    )


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (
        f'<figure><img alt="{_esc(path.stem)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_esc(path.name)}</figcaption></figure>"
    )


def _page(title: str, body: list[str]) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{_esc(title)}</h1><p class="muted">written by isthmus {stamp}</p>'
        + "".join(body)
        + "</body></html>\n"
    )


def _summary_rows(summary: dict[str, Any]) -> str:
    rows = []
    for k, v in summary.items():
        text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
        cls = ""
        if k == "parity_failures":
            cls = ' class="ok"' if v == 0 else ' class="bad"'
        rows.append(f'<tr><th>{_esc(k)}</th><td class="v"{cls}>{_esc(text)}</td></tr>')
    return "<table>" + "".join(rows) + "</table>"


def write_html_report(run: LoadedRun, images: list[str], t0: float, title: str) -> Path:
    """Write ``report.html`` in the run directory (plots ``images``, files in it, embedded);
    returns its path. Raises OSError if the directory cannot be written."""
    d = run.dir
    body = [f"<p>Run directory: <code>{_esc(d)}</code></p>"]
    if run.summary is not None:
        body += ["<h2>Summary</h2>", _summary_rows(run.summary.to_json())]
    svg = timeline_svg(run.events, run.churn, t0)
    if svg:
        legend = _legend(run.events, run.churn)
        body += ["<h2>Timeline</h2>", legend, svg, _events_table(run.events, t0)]
    plots = [d / name for name in images if (d / name).suffix == ".png" and (d / name).exists()]
    if plots:
        body += ["<h2>Plots</h2>", '<div class="plots">', *(_img(p) for p in plots), "</div>"]
    p = d / "report.html"
    p.write_text(_page(title, body))
    return p


def write_compare_html(
    runs: list[LoadedRun],
    labels: list[str],
    starts: list[float],
    plots: list[Path],
    keys: list[str],
    out: Path,
) -> Path:
    """Write ``compare.html`` in ``out``: the runs' summaries side by side (one column per
    run), the overlaid ``plots`` embedded, and each run's timeline. Returns its path."""
    head = "".join(
        f'<th>{_esc(r.dir.name)}<br><span class="muted">{_esc(label)}</span></th>'
        for r, label in zip(runs, labels, strict=True)
    )
    rows = []
    for k in keys:
        cells = []
        for r in runs:
            v = r.summary.to_json().get(k, "") if r.summary is not None else ""
            text = json.dumps(v) if isinstance(v, (dict, list)) else v
            cells.append(f'<td class="v">{_esc(text)}</td>')
        rows.append(f"<tr><th>{_esc(k)}</th>{''.join(cells)}</tr>")
    body = [
        "<h2>Summaries</h2>",
        f"<table><tr><th></th>{head}</tr>{''.join(rows)}</table>",
        "<h2>Loss</h2>",
        '<div class="plots">',
        *(_img(p) for p in plots if p.suffix == ".png"),
        "</div>",
        "<h2>Timelines</h2>",
        _legend([e for r in runs for e in r.events], [c for r in runs for c in r.churn]),
    ]
    for r, label, t0 in zip(runs, labels, starts, strict=True):
        body += [
            f'<h3>{_esc(r.dir.name)} <span class="muted">{_esc(label)}</span></h3>',
            timeline_svg(r.events, r.churn, t0, height=170) or "<p>no events</p>",
        ]
    p = out / "compare.html"
    p.write_text(_page(f"Comparison of {len(runs)} runs", body))
    return p
