"""A slow peer among fast ones: DDP, DiLoCo with a fixed H and time-budgeted DiLoCo (issue 17).

``--peers`` local peers train the tiny (or default) GPT for the same number of steps (the run's
step counter) with one peer slowed ``--factor`` times for the whole run (``--fault
N:slow:F``); for each strategy the table gives the wall-clock at which the peers' mean eval loss
first reached ``--target`` (from the eval curve), the final eval loss, the wall time, and the
slow peer's and a fast peer's inner steps. A fourth run measures detection: DDP with the slow
peer slowed only over ``--bout`` steps; the figure is the time from the bout's first step (the
slow peer's record of it) to the coordinator's ``straggler`` event.

Example (the command behind /tmp/notes/bench-17.md)::

    python benchmarks/elastic.py --peers 4 --steps 200 --sync-every 10 --target 3.2 \
        --step-delay 0.02 --json runs/bench-elastic.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from isthmus.cli import main as cli_main
from isthmus.run.measure import eval_curve
from isthmus.run.record import RunDir


def _run(name: str, root: Path, argv: list[str]) -> RunDir:
    out = root / name
    code = cli_main(["demo", "--no-progress", "--run-dir", str(out), *argv])
    if code != 0:
        raise SystemExit(f"{name}: the demo exited with {code}; see {out}")
    return RunDir(out)


def _records(rd: RunDir, peers: int) -> dict[str, list[dict[str, Any]]]:
    return {f"peer{i}": rd.records(f"peer{i}") for i in range(peers)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--target", type=float, default=3.2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--step-delay", type=float, default=0.02)
    ap.add_argument("--bout", default="40-80")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--root", default="runs/bench-elastic")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    root = Path(a.root)
    slow = a.peers - 1
    common = [
        "--peers", str(a.peers), "--steps", str(a.steps), "--model", a.model,
        "--eval-every", str(a.eval_every), "--step-delay", str(a.step_delay),
        "--target-loss", str(a.target),
    ]  # fmt: skip
    fault = ["--fault", f"{slow}:slow:{a.factor}"]
    h = f"sync_every={a.sync_every}"
    runs = {
        "ddp": ["--strategy", "ddp", *fault],
        "diloco (H fixed)": ["--strategy", "diloco", "--option", h, *fault],
        "diloco (time budget)": [
            "--strategy",
            "diloco",
            "--option",
            h,
            "--option",
            "inner_budget=time",
            *fault,
        ],
    }
    rows = []
    for name, extra in runs.items():
        t = time.monotonic()
        rd = _run(name.replace(" ", "_").replace("(", "").replace(")", ""), root, common + extra)
        s = rd.summary()
        recs = _records(rd, a.peers)
        t0 = min(r["ts"] - r["t"] for rs in recs.values() for r in rs[:1])
        curve = eval_curve(recs, t0, a.target)
        slow_res, fast_res = rd.result(f"peer{slow}"), rd.result("peer0")
        phases = {
            k: (res.strategy.get("phase_steps") if res is not None else None)
            for k, res in (("slow", slow_res), ("fast", fast_res))
        }
        row = {
            "strategy": name,
            "time_to_target_s": curve.get("time_to_target_s"),
            "step_at_target": curve.get("step_at_target"),
            "final_eval_loss": s.final_eval_loss,
            "wall_s": s.wall_s,
            "bench_s": round(time.monotonic() - t, 1),
            "peers_final": s.peers_final,
            "parity_failures": s.parity_failures,
            "stragglers_flagged": s.stragglers,
            "inner_steps_slow": sum(phases["slow"] or []) or None,
            "inner_steps_fast": sum(phases["fast"] or []) or None,
            "curve": curve["curve"],  # [step, seconds, mean eval loss]
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    # detection: a bout on the slow peer, DDP
    start, end = (int(x) for x in a.bout.split("-"))
    rd = _run(
        "ddp_bout",
        root,
        [*common, "--strategy", "ddp", "--fault", f"{slow}:slow:{a.factor}@{start}-{end}"],
    )
    recs = rd.records(f"peer{slow}")
    began = next(r["ts"] for r in recs if r["step"] >= start) - 0.0
    # the record of step `start` is written after it: its start is the record of step start-1
    before = [r["ts"] for r in recs if r["step"] == start - 1]
    began = before[0] if before else began
    flags = [e for e in rd.events() if e["kind"] == "straggler"]
    cleared = [e for e in rd.events() if e["kind"] == "straggler_cleared"]
    detect = {
        "bout_steps": a.bout,
        "flags": [(e["name"], e["step"], round(e["ts"] - began, 2)) for e in flags],
        "cleared": [(e["name"], e["step"]) for e in cleared],
        "time_to_flag_s": round(flags[0]["ts"] - began, 2) if flags else None,
    }
    print(json.dumps(detect), flush=True)
    print()
    print("| strategy | time to eval loss", a.target, "(s) | final eval loss | wall (s) |",
          "inner steps slow / fast | stragglers flagged | parity |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        steps = (
            f"{r['inner_steps_slow']} / {r['inner_steps_fast']}" if r["inner_steps_slow"] else "-"
        )
        parity = f"{r['peers_final']} peers, {r['parity_failures']} failures"
        print(
            f"| {r['strategy']} | {r['time_to_target_s']} | {r['final_eval_loss']} | "
            f"{r['wall_s']} | {steps} | {r['stragglers_flagged']} | {parity} |"
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rows": rows, "detection": detect}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
