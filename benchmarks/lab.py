"""Reproduce the lab figures in docs/BENCHMARKS.md (needs root and iproute2; see docs/LAB.md).

    python benchmarks/lab.py allreduce [--out DIR]     # isthmus vs raw Gloo, 4 peers, 100 Mbit/s, 32 MB
    python benchmarks/lab.py targets [--out DIR]       # DDP, DiLoCo, Streaming DiLoCo: 4 peers, 10 Mbit/s
    python benchmarks/lab.py validate [--out DIR]      # simulator vs lab runs at 2-6 peers
    python benchmarks/lab.py report-targets --runs DIR # the targets table again, from saved runs

Each section writes JSON next to the runs in ``--out`` (default ``runs/bench-lab``) and prints a
markdown table. Timings depend on the machine and on whatever else runs on it: the figures in
the docs were taken on a 2-core machine shared with other jobs (load average noted there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from isthmus.lab.bench import BenchConfig, format_bench, run_bench
from isthmus.lab.scenario import load_scenario, parse_scenario
from isthmus.run.lab_run import LabOptions, run_lab
from isthmus.run.measure import measure_run, validate_runs
from isthmus.run.record import LabSummary, RunDir

ROOT = Path(__file__).resolve().parents[1]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def allreduce(out: Path, reps: int) -> None:
    """fp32 against raw Gloo, then int8 and 4-bit (int4, e3m0) against fp32, each in one run."""
    rows = []
    for compression in (None, "int8", "int4", "e3m0"):
        r = run_bench(
            BenchConfig(
                peers=4, rate_mbit=100, sizes_mb=(32.0,), reps=reps, compression=compression
            )
        )
        r["load_average"] = _load()
        rows.append(r)
        print(format_bench(r), flush=True)
    (out / "allreduce.json").write_text(json.dumps(rows, indent=1))
    print(
        "\n| run | gloo Mbit/s | isthmus Mbit/s | ratio | compressed | time (s) | fp32 (s) | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        comp = r.get("compression") or "-"
        print(
            f"| {comp} | {r['gloo_busbw_mbit']:.1f} | {r['isthmus_busbw_mbit']:.1f} | "
            f"{r['ratio_vs_gloo']:.3f} | {comp} | {r.get('time_s', '-')} | "
            f"{r.get('fp32_time_s', '-')} | {r.get('speedup_vs_fp32', '-')} |"
        )


TARGET_SCENARIOS = ("ddp_10mbit", "diloco_10mbit", "streaming_10mbit")


def targets(out: Path, steps: int, eval_every: int, target: float | None) -> None:
    """The three 10 Mbit/s scenarios; the time each needs to reach the target eval losses."""
    for name in TARGET_SCENARIOS:
        sc = load_scenario(ROOT / "scenarios" / f"{name}.toml")
        s = run_lab(
            sc,
            LabOptions(network="netns"),
            overrides={
                "run_dir": str(out / name),
                "steps": steps,
                "eval_every": eval_every,
                "progress": False,
            },
        )
        (out / name / "load_average.txt").write_text(_load())
        assert s.lab is not None
        print(f"{name}: train {s.lab.train_wall_s} s, final eval {s.final_eval_loss}", flush=True)
    report_targets(out, target)


def report_targets(out: Path, target: float | None) -> None:
    """Time to each target eval loss (the mean over peers at an eval step first at or below it)
    for the runs in ``out``; by default 3.0, 2.8, 2.6, 2.5 and the loosest of the best losses
    (every strategy reaches that one)."""
    summaries = {
        n: RunDir(out / n).summary()
        for n in TARGET_SCENARIOS
        if (out / n / "summary.json").exists()
    }
    labs = {n: s.lab or LabSummary() for n, s in summaries.items()}
    loosest = max(min(c[2] for c in lab.eval["curve"]) for lab in labs.values())
    goals = [target] if target is not None else [3.0, 2.8, 2.6, 2.5, loosest]
    rows = []
    for name, s in summaries.items():
        lab = labs[name]
        load = out / name / "load_average.txt"
        row: dict[str, Any] = {
            "scenario": name,
            "train_wall_s": lab.train_wall_s,
            "steps": s.steps,
            "final_eval_loss": s.final_eval_loss,
            "bytes_sent_total": s.bytes_sent_total,
            "rel_diff_data_plane": lab.bytes_check.get("rel_diff_data_plane"),
            "round_latency_p50_s": lab.round_latency_s.get("p50"),
            "load_average": load.read_text() if load.exists() else None,
            "time_to_target_s": {},
        }
        for goal in goals:
            hit = next((c for c in lab.eval["curve"] if c[2] <= goal), None)
            row["time_to_target_s"][f"{goal:.5g}"] = [hit[1], hit[0]] if hit else None
        rows.append(row)
    (out / "targets.json").write_text(json.dumps(rows, indent=1))
    head = " | ".join(f"to {g:.5g} (s @ step)" for g in goals)
    print(f"| scenario | {head} | train wall (s) | final eval | bytes sent | wire vs acct |")
    print("|---|" + "---|" * (len(goals) + 4))
    for r in rows:
        cells = []
        for g in goals:
            hit = r["time_to_target_s"][f"{g:.5g}"]
            cells.append(f"{hit[0]:.1f} @ {hit[1]}" if hit else "not reached")
        print(
            f"| {r['scenario']} | {' | '.join(cells)} | {r['train_wall_s']} | "
            f"{r['final_eval_loss']:.4f} | {r['bytes_sent_total']:,} | "
            f"{100 * (r['rel_diff_data_plane'] or 0):+.2f}% |"
        )


VALIDATION = """
[run]
name = "{name}"
steps = {steps}
model = "tiny"
[strategy]
name = "{strategy}"
{options}
[network]
peers = {peers}
rate = "10mbit"
"""


def validate(out: Path, peers: list[int]) -> None:
    """DDP and DiLoCo (H=10) at each peer count; predict each run from its own measurements."""
    dirs = []
    for n in peers:
        for strategy, steps, options in (
            ("diloco", 100, "[strategy.options]\nsync_every = 10"),
            ("ddp", 60, ""),
        ):
            name = f"val_{strategy}_{n}"
            text = VALIDATION.format(
                name=name, steps=steps, strategy=strategy, options=options, peers=n
            )
            run_dir = out / name
            run_lab(
                parse_scenario(text, source=name),
                LabOptions(network="netns"),
                overrides={"run_dir": str(run_dir), "progress": False},
            )
            dirs.append(run_dir)
            print(f"ran {name} (load {_load()})", flush=True)
    measured = [measure_run(d) for d in dirs]
    checked = validate_runs(measured)
    rows = []
    for m, vs in checked:
        for v in vs:
            rows.append(
                {
                    "run": Path(m.run_dir).name,
                    "strategy": m.strategy,
                    "peers": m.peers,
                    "compute_s": m.compute_s_per_step,
                    "metric": v.metric,
                    "predicted": v.predicted,
                    "measured": v.measured,
                    "rel_error": v.rel_error,
                }
            )
    (out / "validate.json").write_text(json.dumps(rows, indent=1))
    print("\n| strategy | peers | metric | predicted | measured | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['peers']} | {r['metric']} | {r['predicted']:.4g} | "
            f"{r['measured']:.4g} | {100 * r['rel_error']:+.1f}% |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("section", choices=["allreduce", "targets", "validate", "report-targets"])
    p.add_argument("--out", default="runs/bench-lab")
    p.add_argument("--reps", type=int, default=3, help="allreduce: repetitions")
    p.add_argument("--steps", type=int, default=500, help="targets: steps per scenario")
    p.add_argument("--eval-every", type=int, default=25, help="targets: eval interval")
    p.add_argument(
        "--target-loss", type=float, default=None, help="targets: default: reached by all"
    )
    p.add_argument("--peers", default="2,3,4,5,6", help="validate: peer counts")
    p.add_argument("--runs", default=None, help="report-targets: a directory written by targets")
    args = p.parse_args()
    if args.section == "report-targets":
        report_targets(Path(args.runs), args.target_loss)
        return 0
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}; load average {_load()}", flush=True)
    if args.section == "allreduce":
        allreduce(out, args.reps)
    elif args.section == "targets":
        targets(out, args.steps, args.eval_every, args.target_loss)
    else:
        validate(out, [int(x) for x in args.peers.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
