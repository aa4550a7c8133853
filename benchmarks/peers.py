"""isthmus side by side with torchft and hivemind, on the same lab links (issue 19, item 5).

Every system trains isthmus's tiny GPT on the same corpus, with the same batches per peer (isthmus's
``Corpus.batch`` for each peer's rank and step), the same AdamW (lr 1e-3, weight decay 0.1, betas
0.9/0.95), the same token budget (``--steps`` inner steps per peer) and the same eval (each peer's
model on the same 8 fixed eval batches every ``--eval-every`` steps; the mean over peers), over the
same emulated WAN (``--peers`` peers, ``--rate`` links with a ``--rtt-ms`` round trip between two
peers; the coordinator, lighthouse and start barrier half that away):

* isthmus-ddp: ``isthmus lab run`` with strategy ddp
* isthmus-diloco: diloco, H = ``--sync-every``, outer SGD Nesterov lr 0.7 momentum 0.9
* isthmus-streaming: streaming, H, ``--fragments`` P, overlap tau, alpha
* isthmus-diloco-e3m0, isthmus-streaming-e3m0: the two above with 4-bit outer gradients
  (isthmus's quantized all-reduce, ``compression = "e3m0"``)
* isthmus-sparseloco: sparseloco with H (its own top-k and 1-bit values, error feedback)
* torchft-ddp: torchft's Manager + DistributedDataParallel, lighthouse in the lab
* torchft-allreduce: the same data parallel with the gradients through manager.allreduce
* torchft-diloco: torchft.local_sgd.DiLoCo, one fragment, the same outer SGD
* torchft-streaming: the same class with P fragments, fragment_sync_delay tau, alpha
* torchft-diloco-bucketized, torchft-streaming-bucketized: the two above with
  use_bucketization=True (one flat all-reduce per sync instead of one per parameter tensor)
* hivemind-dp: hivemind.Optimizer, gradient averaging at a target batch of ``--target-batch``
  samples (default peers x batch x H)
* hivemind-local: the same with use_local_updates=True: parameter averaging
* hivemind-sync: gradient averaging at peers x batch: DDP's global batch

For each, a run without faults gives the eval curve, the wall-clock to each target loss (from the
moment every starting peer is ready: isthmus's first round, the others' start barrier), the final
eval loss at the budget and the bytes each peer's link sent (interface counters, the whole run);
a second run with ``--step-delay`` between steps SIGKILLs peer ``--victim`` ``--kill-at`` seconds
after the start and starts it again ``--join-at`` seconds after the start, and gives the time from
the kill to the next committed synchronization among the survivors and from the joiner's process
start to the first committed synchronization holding its update (definitions:
``benchmarks/peers_measure.py``). isthmus runs in this interpreter; torchft and hivemind in the
peers' virtual environment (``make bench-peers-env``), their workers written against their public
APIs (``peers_torchft.py``, ``peers_hivemind.py``). Needs root (network namespaces).

``--model default`` trains isthmus's default GPT (1.3M parameters) instead of the tiny one, and
``--model medium`` its 10.8M-parameter GPT (every system the same model);
``--network FILE`` takes the links from a scenario file's ``[network]`` (e.g.
``scenarios/two_region.toml``). ``--goodput S`` adds a third run per system, the main run's
budget under a SIGKILL of a random peer (not peer 0) every S seconds (``--fail-poisson``: at
exponential gaps of that mean) up to ``--fail-until``, each restarted ``--restart-after`` seconds
later; it reports the fraction of synchronizations committed, the theoretical fraction (one
attempt lost per failure) and the time to each target (``benchmarks/peers_goodput.py``).

    sudo .venv/bin/python benchmarks/peers.py [--systems a,b,...] [--no-faults] [--json FILE]
    .venv/bin/python benchmarks/peers.py --report FILE...  # the table again from --json files
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers_lab
from peers_goodput import nominal_fraction, step_time, time_fraction
from peers_measure import loosest_best, time_to_target

from isthmus.models.gpt import PRESETS

ROOT = Path(__file__).resolve().parent.parent

SYSTEMS = (
    "isthmus-ddp",
    "isthmus-diloco",
    "isthmus-streaming",
    "isthmus-diloco-e3m0",
    "isthmus-streaming-e3m0",
    "isthmus-sparseloco",
    "torchft-ddp",
    "torchft-allreduce",
    "torchft-diloco",
    "torchft-streaming",
    "torchft-diloco-bucketized",
    "torchft-streaming-bucketized",
    "hivemind-dp",
    "hivemind-local",
    "hivemind-sync",
)


def versions(python: str) -> dict[str, str]:
    """The packages each side ran: torch here, torch/torchft/hivemind in the peers' venv."""
    import torch

    out = {"python": platform.python_version(), "torch (isthmus)": torch.__version__}
    code = (
        "import importlib.metadata as m, json;"
        "print(json.dumps({p: m.version(p) for p in ('torch','torchft','hivemind','isthmus')}))"
    )
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        out.update({f"{k} (peers venv)": v for k, v in json.loads(res.stdout).items()})
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        out["peers venv"] = f"unreadable: {e}"
    return out


def targets_for(rows: list[dict[str, Any]], given: list[float]) -> list[float]:
    """The targets of the table: those given, and the tightest that every curve reaching all of
    them also reaches (a system that never gets near the given ones does not loosen it)."""
    curves = [r["curve"] for r in rows if r.get("curve")]
    if given:
        curves = [c for c in curves if time_to_target(c, min(given)) is not None]
    loose = loosest_best(curves)
    out = list(given)
    if loose is not None:
        loose = math.ceil(loose * 1e4) / 1e4  # rounded up: the curve that set it reaches it
        if all(abs(loose - g) > 1e-9 for g in out):
            out.append(loose)
    return out


def _cell(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(result: dict[str, Any]) -> str:
    """The markdown table of a result (``--json``'s contents)."""
    rows = result["main"]
    faults = {r["system"]: r for r in result.get("faults", [])}
    goals = targets_for(rows, result["setup"]["targets"])
    head = " | ".join(f"to {g:g} (s @ step)" for g in goals)
    lines = [
        f"| system | {head} | final eval | train wall (s) | tx per peer (MB) | "
        "kill -> commit without it (s) | join -> first contribution (s) (from ready) | broke |",
        "|---|" + "---|" * (len(goals) + 6),
    ]
    for r in rows:
        cells = []
        for g in goals:
            hit = time_to_target(r.get("curve") or [], g)
            cells.append(f"{hit[0]:.1f} @ {hit[1]}" if hit else "not reached")
        f = faults.get(r["system"], {})
        join = _cell(f.get("join_to_contribution_s"))
        if f.get("ready_to_contribution_s") is not None:
            join += f" ({f['ready_to_contribution_s']:.1f})"
        broke = "; ".join(r.get("errors", []) + f.get("errors", []))[:160]
        tx = r.get("tx_per_peer_mean")
        lines.append(
            f"| {r['system']} | {' | '.join(cells)} | {_cell(r.get('final_eval_loss'), '{:.4f}')} | "
            f"{_cell(r.get('train_wall_s'))} | {_cell(None if tx is None else tx / 1e6, '{:.2f}')} | "
            f"{_cell(f.get('kill_to_commit_s'), '{:.2f}')} | {join} | {broke or '-'} |"
        )
    return "\n".join(lines)


def goodput_table(result: dict[str, Any]) -> str:
    """The markdown table of the goodput runs (``--goodput``) of a result, or "" without any."""
    rows = result.get("goodput", [])
    if not rows:
        return ""
    main = {r["system"]: r for r in result["main"]}
    goals = targets_for(rows, result["setup"]["targets"])
    head = " | ".join(f"to {g:g} (s @ step)" for g in goals)
    lines = [
        f"| system | kills | committed / attempted | committed fraction | theoretical | "
        f"nominal (quiet step s) | {head} | final eval | train wall (s) | quiet wall (s) | "
        "quiet / train wall | tokens committed / quiet tokens | broke |",
        "|---|" + "---|" * (len(goals) + 11),
    ]
    for r in rows:
        cells = []
        for g in goals:
            hit = time_to_target(r.get("curve") or [], g)
            cells.append(f"{hit[0]:.1f} @ {hit[1]}" if hit else "not reached")
        frac = r.get("committed_fraction")
        theory = r.get("theoretical_fraction")
        counts = f"{r.get('syncs_committed', '-')} / {r.get('syncs_attempted', '-')}"
        broke = "; ".join(r.get("errors", []))[:160]
        quiet_row = main.get(r["system"], {})
        quiet = quiet_row.get("train_wall_s")
        step = step_time(quiet or 0.0, quiet_row.get("commits") or 0)
        every = result["setup"].get("fail_every") or 0.0
        nominal = "-"
        if step and every:
            nominal = f"{100 * nominal_fraction(step, every):.1f}% ({step:.2f})"
        wall_frac = time_fraction(quiet, r.get("train_wall_s"))
        tokens = r.get("tokens_committed")
        work = "-"
        if tokens is not None and quiet_row.get("tokens"):
            work = f"{100 * tokens / quiet_row['tokens']:.1f}%"
        lines.append(
            f"| {r['system']} | {r.get('kills', '-')} | {counts} | "
            f"{_cell(None if frac is None else 100 * frac, '{:.1f}%')} | "
            f"{_cell(None if theory is None else 100 * theory, '{:.1f}%')} | {nominal} | "
            f"{' | '.join(cells)} | {_cell(r.get('final_eval_loss'), '{:.4f}')} | "
            f"{_cell(r.get('train_wall_s'))} | {_cell(quiet)} | "
            f"{_cell(None if wall_frac is None else 100 * wall_frac, '{:.1f}%')} | {work} | "
            f"{broke or '-'} |"
        )
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (every flag, its default and its choices)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--no-faults", action="store_true", help="skip the kill/join runs")
    ap.add_argument("--no-main", action="store_true", help="only the kill/join runs")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=300, help="inner steps per peer (the budget)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--sync-every", type=int, default=20, help="H")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--overlap", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--target-batch", type=int, default=0, help="hivemind: 0 = peers x batch x H")
    ap.add_argument("--matchmaking-time", type=float, default=2.0, help="hivemind")
    ap.add_argument("--targets", default="3.0,2.8,2.6", help="eval losses to time")
    ap.add_argument("--victim", type=int, default=3)
    ap.add_argument("--kill-at", type=float, default=10.0)
    ap.add_argument("--join-at", type=float, default=20.0)
    ap.add_argument("--step-delay", type=float, default=0.1, help="fault runs: s between steps")
    ap.add_argument(
        "--fault-steps", default="150,500", help="isthmus's fault runs: steps of DDP, of the others"
    )
    ap.add_argument(
        "--fault-limit", type=float, default=150.0, help="torchft/hivemind fault runs: at most"
    )
    ap.add_argument("--model", default="tiny", choices=PRESETS, help="GPT preset")
    ap.add_argument("--network", default=None, help="a scenario file whose [network] to use")
    ap.add_argument(
        "--goodput", type=float, default=0.0, help="a goodput run: a kill every S seconds"
    )
    ap.add_argument("--restart-after", type=float, default=5.0, help="goodput: s to the restart")
    ap.add_argument("--fail-until", type=float, default=120.0, help="goodput: no kill after")
    ap.add_argument("--fail-seed", type=int, default=0, help="goodput: the schedule's seed")
    ap.add_argument("--fail-poisson", action="store_true", help="goodput: exponential gaps")
    ap.add_argument(
        "--run-timeout", type=float, default=900.0, help="s; a run still going then is stopped"
    )
    ap.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        help="s, every system's bound on one collective (hivemind: its averaging timeout); a "
        "full-model fp32 sync on a thin link needs more than the default",
    )
    ap.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    ap.add_argument("--out", default="runs/bench-peers")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="print the table of earlier --json files (their rows together, in order)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.report:
        parts = [json.loads(Path(f).read_text()) for f in a.report]
        merged = {**parts[0], "main": [], "faults": [], "goodput": []}
        if a.targets != ap.get_default("targets"):  # the table's targets, given again
            merged["setup"] = {
                **merged["setup"],
                "targets": [float(x) for x in a.targets.split(",")],
            }
        for part in parts:
            for key in ("main", "faults", "goodput"):
                merged[key] += part.get(key, [])
        print(table(merged))
        print(goodput_table(merged))
        return 0
    if os.geteuid() != 0:
        print("benchmarks/peers.py needs root: it builds network namespaces", file=sys.stderr)
        return 2
    systems = [s for s in a.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if any(not s.startswith("isthmus") for s in systems) and not Path(a.peers_python).exists():
        print(f"{a.peers_python} is missing: run `make bench-peers-env` first", file=sys.stderr)
        return 2
    setup = peers_lab.Setup(
        peers=a.peers,
        rate=a.rate,
        rtt_ms=a.rtt_ms,
        steps=a.steps,
        eval_every=a.eval_every,
        sync_every=a.sync_every,
        fragments=a.fragments,
        overlap=a.overlap,
        alpha=a.alpha,
        target_batch=a.target_batch,
        matchmaking_time=a.matchmaking_time,
        victim=a.victim,
        kill_at=a.kill_at,
        join_at=a.join_at,
        step_delay=a.step_delay,
        fault_steps=tuple(int(x) for x in a.fault_steps.split(",")),  # type: ignore[arg-type]
        fault_limit=a.fault_limit,
        targets=[float(x) for x in a.targets.split(",") if x],
        model=a.model,
        run_timeout=a.run_timeout,
        collective_timeout=a.collective_timeout,
        fail_every=a.goodput,
        restart_after=a.restart_after,
        fail_until=a.fail_until,
        fail_seed=a.fail_seed,
        fail_poisson=a.fail_poisson,
        network=peers_lab.network_section(Path(a.network).read_text()) if a.network else "",
    )
    # SIGTERM unwinds like Ctrl-C (the lab's network is torn down first by its own handler,
    # which then calls this one), so that the hosts files and workers are cleaned up too
    signal.signal(signal.SIGTERM, _interrupt)
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join(sys.argv),
        "versions": versions(a.peers_python),
        "setup": setup.as_dict(),
        "main": [],
        "faults": [],
        "goodput": [],
        "failures": [dataclasses.asdict(f) for f in setup.failures()],
        "out": str(out),
    }
    print(f"results in {out}; load average {peers_lab.load()}", flush=True)

    def save() -> None:
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))
        (out / "result.json").write_text(json.dumps(result, indent=1))

    kinds = ["main"] if not a.no_main else []
    kinds += [] if a.no_faults else ["faults"]
    kinds += ["goodput"] if a.goodput else []
    for kind in kinds:
        for name in systems:
            row = peers_lab.run_system(
                name,
                setup,
                out,
                fault=kind == "faults",
                python=a.peers_python,
                goodput=kind == "goodput",
            )
            result[kind].append(row)
            brief = {k: v for k, v in row.items() if k != "curve"}
            print(json.dumps(brief), flush=True)
            save()
    print()
    print(table(result))
    print(goodput_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
