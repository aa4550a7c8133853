"""Fine-tuning with ``zo`` against DDP from the same pre-trained model (issue 18).

Runs ``isthmus demo`` three times on the same peers and steps, each starting from the demo's
pre-trained model (:mod:`isthmus.run.pretrain`; trained on the stdlib files after the run's
corpus, so the run's corpus is held out from it): DDP (AdamW, the demo's lr), ``zo`` with data
parallelism, and ``zo`` with perturbation pairs (DistZO2). Prints the eval loss on the held-out
corpus against steps and against bytes, the bytes per step per peer, and the steps per second of
each (from the peers' own step records, startup excluded).

    python benchmarks/zo_finetune.py --model tiny --peers 4 --steps 100 --out /tmp/zo-bench
    python benchmarks/zo_finetune.py --report ddp=DIR zo=DIR pairs=DIR   # existing run dirs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RUNS = {
    "ddp": {"strategy": "ddp"},
    "zo": {"strategy": "zo"},
    "pairs": {"strategy": "zo", "option": {"pairing": "perturbation"}},
}


def _records(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(run_dir.glob("peer*.jsonl")):
        out[f.stem] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def report(run_dir: Path) -> dict[str, Any]:
    """Eval-loss curve, bytes and steps per second of one run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    recs = _records(run_dir)
    first = recs[min(recs)]
    curve = [
        (r["step"] + 1, round(r["eval_loss"], 4), r["bytes_sent"])
        for r in first
        if "eval_loss" in r
    ]
    rates = [(len(rs) - 1) / (rs[-1]["t"] - rs[0]["t"]) for rs in recs.values() if len(rs) > 1]
    return {
        "initial_eval_loss": summary["initial_eval_loss"],
        "final_eval_loss": summary["final_eval_loss"],
        "curve_step_loss_bytes_peer0": curve,
        "bytes_per_step_per_peer_median": summary["bytes_per_step_per_peer"],
        "bytes_sent_all_peers": summary["bytes_sent_total"],
        "steps_per_s_mean_over_peers": round(sum(rates) / len(rates), 3) if rates else None,
        "parity_failures": summary["parity_failures"],
        "peers_final": summary["peers_final"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "default"])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default="zo-finetune")
    ap.add_argument("--report", nargs="*", metavar="NAME=DIR", help="only report these run dirs")
    args = ap.parse_args()
    dirs: dict[str, Path] = {}
    if args.report:
        dirs = {k: Path(v) for k, v in (x.split("=", 1) for x in args.report)}
    else:
        from isthmus.run.builtin_run import demo_config, run_demo
        from isthmus.run.pretrain import pretrained_start

        base = {"model": args.model, "peers": args.peers, "steps": args.steps}
        start = str(pretrained_start(demo_config({**base, "strategy": "zo"})))
        for name, extra in RUNS.items():
            dirs[name] = Path(args.out) / name
            run_demo(
                {
                    **base,
                    **extra,
                    "eval_every": args.eval_every,
                    "init_from": start,
                    "run_dir": str(dirs[name]),
                    "progress": False,
                }
            )
    print(json.dumps({name: report(d) for name, d in dirs.items()}, indent=1))


if __name__ == "__main__":
    main()
