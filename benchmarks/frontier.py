"""Eval loss against bytes on the wire: the communication frontier, from benchmarks/strategies.py.

Reads one or more ``--json`` outputs of ``benchmarks/strategies.py`` (the same budget: steps,
peers, batch, corpus) and writes a plot (loss against bytes, log scale) and a markdown table: per
row, the loss, its gap to DDP's, the bytes and DDP's bytes over them; per strategy, the largest
such ratio among its rows that stay within 1% and within 2% of DDP's loss. ``--extra
LABEL:LOSS:BYTES`` adds a point measured elsewhere (say where in the caption). Exits with an
error naming the file when no row is DDP (the ratios need it).

Example::

    python benchmarks/frontier.py runs/a.json runs/b.json --plot docs/benchmarks/frontier.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(paths: list[str], extra: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in paths:
        for r in json.loads(Path(p).read_text()):
            if r.get("final_eval_loss") is None:
                continue  # a failed run: no point
            label = r["strategy"]
            if r.get("compression") not in (None, "none"):
                label = f"{label} + {r['compression']}"
            rows.append(
                {"label": label, "loss": r["final_eval_loss"], "bytes": r["bytes_sent_total"]}
            )
    for e in extra:
        label, loss, nbytes = e.rsplit(":", 2)
        rows.append({"label": label, "loss": float(loss), "bytes": int(nbytes)})
    return rows


def family(label: str) -> str:
    """The strategy a row's label names: its first word, less a variant's suffix
    (``"diloco (H 20) + e3m0"``, ``"co2-penalty2"`` -> diloco, co2)."""
    return label.split(" ")[0].split("-")[0]


def table(rows: list[dict[str, Any]]) -> str:
    ddp = next((r for r in rows if r["label"] == "ddp"), None)
    if ddp is None:
        sys.exit("no ddp row in the inputs: the ratios are against DDP")
    out = [
        "| row | eval loss | vs DDP | bytes (all peers) | DDP / bytes |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r["bytes"]):
        gap = r["loss"] / ddp["loss"] - 1
        out.append(
            f"| {r['label']} | {r['loss']:.4f} | {gap:+.1%} | {r['bytes']:,} | "
            f"{ddp['bytes'] / r['bytes']:,.0f}x |"
        )
    out += ["", "| strategy | largest DDP / bytes within 1% | within 2% |", "|---|---|---|"]
    for fam in dict.fromkeys(family(r["label"]) for r in rows):
        best = {}
        for tol in (0.01, 0.02):
            ok = [
                ddp["bytes"] / r["bytes"]
                for r in rows
                if family(r["label"]) == fam and r["loss"] <= ddp["loss"] * (1 + tol)
            ]
            best[tol] = f"{max(ok):,.0f}x" if ok else "not reached"
        out.append(f"| {fam} | {best[0.01]} | {best[0.02]} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    # one colour per strategy, its points joined along its frontier (the points no row of fewer
    # bytes beats); the frontier's points are named by their settings, the others (beaten by a
    # point of the same strategy) stay unnamed so that the labels that matter stay legible
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(family(r["label"]), []).append(r)
    for i, (name, rs) in enumerate(sorted(by.items())):
        colour = f"C{i % 10}"
        ax.scatter(
            [r["bytes"] for r in rs], [r["loss"] for r in rs], s=30, color=colour, label=name
        )
        front, best = [], float("inf")
        for r in sorted(rs, key=lambda r: (r["bytes"], r["loss"])):
            if r["loss"] < best:
                best = r["loss"]
                front.append(r)
        if len(front) > 1:
            ax.plot([r["bytes"] for r in front], [r["loss"] for r in front], color=colour, lw=0.8)
        for j, r in enumerate(front):
            settings = r["label"].split(" ", 1)[1] if " " in r["label"] else ""
            if settings:
                ax.annotate(
                    settings,
                    (r["bytes"], r["loss"]),
                    fontsize=6.5,
                    color=colour,
                    xytext=(4, 3) if j % 2 == 0 else (-4, -9),  # neighbours on opposite sides
                    ha="left" if j % 2 == 0 else "right",
                    textcoords="offset points",
                )
    ddp = next(r for r in rows if r["label"] == "ddp")
    for tol, style in ((0.01, ":"), (0.02, "--")):
        ax.axhline(
            ddp["loss"] * (1 + tol),
            color="grey",
            linestyle=style,
            linewidth=0.8,
            label=f"DDP + {tol:.0%}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by all peers (log scale)")
    ax.set_ylabel("final eval loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("json", nargs="+", help="outputs of benchmarks/strategies.py --json")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL:LOSS:BYTES")
    ap.add_argument("--plot", default=None, help="write the plot (PNG) here")
    ap.add_argument("--title", default="eval loss against bytes on the wire")
    args = ap.parse_args(argv)
    rows = load(args.json, args.extra)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
