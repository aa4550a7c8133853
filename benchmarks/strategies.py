"""Low-communication strategies side by side; the figures in docs/BENCHMARKS.md.

The tiny (or default) GPT trained by ``--peers`` local peer processes (``isthmus demo`` without
faults) once per strategy, every strategy with the same token budget (the same number of steps,
peers and batch size): DDP, local SGD, DiLoCo, Streaming DiLoCo, eager DiLoCo, CO2 (and its
ablation rows), SparseLoCo and DeMo. For each
run the table gives the final eval loss (and its gap to DDP), the bytes all peers sent (and how
many times fewer than DDP), the peak bytes one peer sent in one round (and its share of DiLoCo's),
and for the overlapped strategies the measured ``overlap_fraction`` (over every reduction, and in
parentheses over the steady state: without the blocking start-up round and final flush) with the
two times it compares:
the mean communication time of one reduction (issue to completion) and the compute it overlaps
(the inner steps between issue and wait times the median step time).

Example (the command behind docs/BENCHMARKS.md)::

    python benchmarks/strategies.py --peers 4 --model tiny --steps 300 --sync-every 20 \
        --fragments 2 --overlap 2 --alpha 0.5 --json runs/bench-strategies/fp32.json
    python benchmarks/strategies.py --peers 4 --model tiny --steps 300 --sync-every 20 \
        --fragments 2 --overlap 2 --alpha 0.5 --compression e3m0 \
        --only localsgd,diloco,streaming,eager,co2 --json runs/bench-strategies/e3m0.json

Eager DiLoCo has three rows: ``eager`` (isthmus's default, each phase starting from the predicted
outer step), ``eager-paper`` (the paper's eager update, with outer lr 1.0 and no momentum, the best
found for it) and ``eager-delayed`` (the naive one-step-delayed scheme, same outer settings).

Rows are printed as JSON lines as they finish, then the markdown table. With ``--only`` a
subset runs (the ratios to DDP and DiLoCo need those rows: pass ``--baseline FILE`` with an
earlier ``--json`` output to take them from there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from isthmus.run.builtin_run import run_demo
from isthmus.run.record import Summary


def configs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    h = args.sync_every
    return [
        ("ddp", "ddp", {}),
        ("localsgd", "localsgd", {"sync_every": h}),
        ("diloco", "diloco", {"sync_every": h}),
        (
            "streaming",
            "streaming",
            {
                "sync_every": h,
                "fragments": args.fragments,
                "overlap": args.overlap,
                "alpha": args.alpha,
            },
        ),
        (
            "streaming-balanced",
            "streaming",
            {
                "sync_every": h,
                "fragments": args.fragments,
                "overlap": args.overlap,
                "alpha": args.alpha,
                "pattern": "balanced",
            },
        ),
        ("eager", "eager", {"sync_every": h}),
        (
            "eager-paper",
            "eager",
            {
                "sync_every": h,
                "start": "paper",
                "anchor": 0.0,
                "outer_lr": 1.0,
                "outer_momentum": 0.0,
            },
        ),
        (
            "eager-delayed",
            "eager",
            {
                "sync_every": h,
                "start": "theta",
                "anchor": 0.0,
                "outer_lr": 1.0,
                "outer_momentum": 0.0,
            },
        ),
        ("co2", "co2", {"sync_every": h}),
        # CO2's ablation (issue 22): clipping off, a gap penalty of 2, and no staleness (CO2's
        # outer step, heavy-ball beta 0.2 and lr 1.0, applied at once: DiLoCo with that optimizer)
        ("co2-noclip", "co2", {"sync_every": h, "clip": None}),
        ("co2-penalty2", "co2", {"sync_every": h, "gap_penalty": 2.0}),
        (
            "co2-nostale",
            "diloco",
            {"sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.2, "nesterov": False},
        ),
        ("sparseloco", "sparseloco", {"sync_every": h}),
        ("demo", "demo", {}),
    ]


SELF_COMPRESSED = ("ddp", "sparseloco", "demo")
"""Strategies that take no ``--compression``: DDP's baseline is plain, and SparseLoCo and DeMo
compress their own messages."""


def parse_sets(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``ROW.KEY=VALUE`` (VALUE as JSON when it parses, else a string) -> {row: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        target, sep, value = spec.partition("=")
        row, dot, key = target.partition(".")
        if not sep or not dot or not row or not key:
            raise SystemExit(f"--set takes ROW.KEY=VALUE (e.g. eager.outer_lr=0.7), got {spec!r}")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(row, {})[key] = parsed
    return out


def overlapped_steps(strategy: str, options: dict[str, Any]) -> int:
    """Inner steps a reduction runs behind (issue to wait)."""
    if strategy in ("streaming", "sparseloco"):
        return int(options.get("overlap", 0))
    if strategy in ("eager", "co2"):
        return int(options["sync_every"])
    return 0


def measure(summary: Summary) -> dict[str, float]:
    """Median step time and mean communication time per reduction, from the run directory."""
    run = Path(summary.run_dir)
    gaps: list[float] = []
    steady: list[float] = []
    comm = 0.0
    reductions = 0
    for final in sorted(run.glob("*.final.json")):
        f = json.loads(final.read_text())
        comm += float(f["strategy"].get("comm_s", 0.0))
        if "steady_overlap_fraction" in f["strategy"]:
            steady.append(float(f["strategy"]["steady_overlap_fraction"]))
        reductions += sum(1 for r in f["rounds"] if r["outcome"] == "committed")
        recs = [
            json.loads(x)
            for x in final.with_suffix("").with_suffix(".jsonl").read_text().splitlines()
        ]
        ts = [r["t"] for r in recs]
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    return {
        "step_s": statistics.median(gaps) if gaps else 0.0,
        "comm_per_reduction_s": comm / reductions if reductions else 0.0,
        "steady_overlap_fraction": statistics.mean(steady) if steady else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--model", default="tiny", choices=("tiny", "default"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--sync-every", type=int, default=20, help="H (tau for CO2)")
    ap.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's P")
    ap.add_argument("--overlap", type=int, default=2, help="Streaming DiLoCo's tau")
    ap.add_argument("--alpha", type=float, default=0.5, help="Streaming DiLoCo's mixing")
    ap.add_argument(
        "--compression",
        default=None,
        help="compress the outer gradients of every strategy but DDP (e.g. e3m0, int8)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="ROW.KEY=VALUE",
        help="override one option of one row (repeatable), e.g. eager.outer_momentum=0.9",
    )
    ap.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds; a member quiet for a third of it is left out of a round, which a heavily "
        "loaded machine can cause (the row then warns): raise it there to keep runs deterministic",
    )
    ap.add_argument("--only", default="", help="comma-separated subset of the strategies")
    ap.add_argument("--out", default="runs/bench-strategies", help="run directories go here")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument(
        "--baseline",
        default=None,
        help="an earlier --json file: its ddp and diloco rows are the reference of the ratios",
    )
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    overrides = parse_sets(args.set)
    rows: list[dict[str, Any]] = []
    for label, strategy, options in configs(args):
        if only and label not in only:
            continue
        options = {**options, **overrides.get(label, {})}
        s = run_demo(
            {
                "peers": args.peers,
                "strategy": strategy,
                "steps": args.steps,
                "option": dict(options),
                "compression": None if strategy in SELF_COMPRESSED else args.compression,
                "model": args.model,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "corpus_bytes": args.corpus_bytes,
                "heartbeat_timeout": args.heartbeat_timeout,
                "run_dir": str(out / label),
                "progress": False,
            }
        )
        m = measure(s)
        k = overlapped_steps(strategy, options)
        row = {
            "strategy": label,
            "options": options,
            "compression": s.compression,
            "final_eval_loss": s.final_eval_loss,
            "bytes_sent_total": s.bytes_sent_total,
            "peak_bytes_per_round": s.peak_bytes_per_round,
            "overlap_fraction": s.overlap_fraction,
            "steady_overlap_fraction": m["steady_overlap_fraction"],
            "comm_per_reduction_s": m["comm_per_reduction_s"],
            "overlapped_compute_s": k * m["step_s"],
            "step_s": m["step_s"],
            "rounds_committed": s.rounds_committed,
            "peers_final": s.peers_final,
            "wall_s": s.wall_s,
            # a peer left out of a round (quiet under load) and resynced changes the run: its
            # loss is then not the deterministic one of this configuration
            "resyncs": s.resyncs,
            "rounds_aborted": s.rounds_aborted,
        }
        if s.resyncs or s.rounds_aborted:
            print(
                f"warning: {label}'s membership changed during the run ({s.resyncs} resyncs, "
                f"{s.rounds_aborted} aborted rounds): its loss is not the deterministic one; "
                "run it again on a quieter machine or with a larger --heartbeat-timeout",
                flush=True,
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    if args.json:  # first: the rows are the measurement, the table only presents them
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    base = json.loads(Path(args.baseline).read_text()) if args.baseline else []
    print(table([r for r in rows if r["final_eval_loss"] is not None], base))
    return 0


def steady(r: dict[str, Any]) -> str:
    v = r.get("steady_overlap_fraction")
    return "" if v is None or v != v else f" ({v:.3f})"  # v != v: NaN, not an overlapped strategy


def label(r: dict[str, Any]) -> str:
    comp = r.get("compression")
    return r["strategy"] + (f" + {comp}" if comp and comp != "none" else "")


def table(rows: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None) -> str:
    by = {r["strategy"]: r for r in (baseline or [])}
    by.update({r["strategy"]: r for r in rows})
    ddp = by.get("ddp")
    dl = by.get("diloco")
    head = (
        "| strategy | eval loss | vs DDP | bytes (all peers) | DDP / bytes | peak bytes/round | "
        "peak / DiLoCo's | overlap_fraction (steady) | comm per reduction | compute overlapped | "
        "wall s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        loss = r["final_eval_loss"]
        gap = f"{100 * (loss / ddp['final_eval_loss'] - 1):+.1f}%" if ddp and loss else ""
        fewer = (
            f"{ddp['bytes_sent_total'] / r['bytes_sent_total']:.0f}x"
            if ddp and r["bytes_sent_total"]
            else ""
        )
        peak = (
            f"{r['peak_bytes_per_round'] / dl['peak_bytes_per_round']:.2f}"
            if dl and dl["peak_bytes_per_round"]
            else ""
        )
        ov = r["overlapped_compute_s"]
        lines.append(
            f"| {label(r)} | {loss:.4f} | {gap} | {r['bytes_sent_total']:,} | {fewer} | "
            f"{r['peak_bytes_per_round']:,} | {peak} | {r['overlap_fraction']:.3f}{steady(r)} | "
            f"{1000 * r['comm_per_reduction_s']:.1f} ms | "
            f"{f'{1000 * ov:.0f} ms' if ov else '-'} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
