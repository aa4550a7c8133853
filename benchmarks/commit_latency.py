"""Round latency with the waiting path (``--no-pipeline-commit``) and the pipelined commit
(the default), in the lab (run as root).

For each strategy and round trip it writes a scenario (4 peers, 100 Mbit/s links, the tiny
GPT, 40 steps; DiLoCo with H = 5), runs ``isthmus lab run`` on it with the waiting path and
with the pipelined commit, back to back (``--reps N`` pairs, the order alternating from pair to
pair: waiting first, then pipelined first, ...), with ``--step-delay`` seconds of emulated
compute after every step, and prints the median interval between two steps of a peer (all
peers, steps 5 and later), the coordinator's count of aborted rounds and the 1-minute load
average as the run started: for DDP every step is a round; for DiLoCo the round's cost is a
boundary step's interval minus an inner step's. Every run of a strategy and round trip must
end on the same digest (the math is the same), which it checks.

    sudo .venv/bin/python benchmarks/commit_latency.py --rtt-ms 50,100 --strategies ddp,diloco
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SCENARIO = """description = "Round latency: {strategy}, {rtt} ms RTT."
[run]
name = "commit_{strategy}_{rtt}"
steps = {steps}
seed = 0
model = "tiny"
[strategy]
name = "{strategy}"
{options}
[network]
peers = 4
rate = "100mbit"
rtt_ms = {rtt}
"""


def intervals(run_dir: Path, every: int) -> dict[str, float | None]:
    """Median ms between consecutive steps of one peer, over every peer: all steps, the
    steps that end a phase of ``every`` (boundary) and the others (inner)."""
    out: dict[str, list[float]] = {"all": [], "boundary": [], "inner": []}
    for f in sorted(run_dir.glob("peer*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        recs = [r for r in recs if "step" in r and "ts" in r]
        for a, b in itertools.pairwise(recs):
            if b["step"] < 5:
                continue
            dt = (b["ts"] - a["ts"]) * 1000
            out["all"].append(dt)
            out["boundary" if (b["step"] + 1) % every == 0 else "inner"].append(dt)
    return {k: round(statistics.median(v), 1) if v else None for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", default="50,100")
    ap.add_argument("--strategies", default="ddp,diloco")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-delay", type=float, default=0.3)
    ap.add_argument("--reps", type=int, default=1, help="pairs per strategy and round trip")
    ap.add_argument("--out", default="runs/commit-latency")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for strategy in a.strategies.split(","):
        every = 5 if strategy == "diloco" else 1
        options = "[strategy.options]\nsync_every = 5\n" if strategy == "diloco" else ""
        for rtt in a.rtt_ms.split(","):
            sc = out / f"{strategy}_{rtt}.toml"
            text = SCENARIO.format(strategy=strategy, rtt=rtt, steps=a.steps, options=options)
            sc.write_text(text)
            digests = {}
            modes = [("waiting", ["--no-pipeline-commit"]), ("pipelined", [])]
            for rep in range(a.reps):
                for mode, extra in modes[:: 1 if rep % 2 == 0 else -1]:
                    run_dir = out / f"{strategy}_{rtt}_{mode}_{rep}"
                    argv = [sys.executable, "-m", "isthmus.cli", "lab", "run", str(sc)]
                    argv += ["--no-progress", "--run-dir", str(run_dir)]
                    argv += ["--step-delay", str(a.step_delay), *extra]
                    load = os.getloadavg()[0]  # the box's 1-minute load as the run starts
                    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
                    summary = json.loads((run_dir / "summary.json").read_text())
                    digests[f"{mode}{rep}"] = summary["final_digest"]
                    figures = {**intervals(run_dir, every), "aborted": summary["rounds_aborted"]}
                    figures["load"] = round(load, 1)
                    print(strategy, rtt, rep, mode, json.dumps(figures), flush=True)
            if len(set(digests.values())) != 1:
                print(f"  digests differ: {digests}", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
