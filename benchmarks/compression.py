"""Compression benchmarks; the figures in docs/BENCHMARKS.md.

Two experiments:

``allreduce``
    One tensor summed by ``--peers`` separate processes, fp32 (Gloo's ring all-reduce, what the
    strategies send uncompressed) against each compressor (the path the strategies use:
    ``Compressor.reduce_sum`` then ``commit``). Specs alternate within every repetition so they
    see the same conditions; a Gloo barrier precedes each timed reduction, the slowest peer
    counts, the first repetition is a warm-up, and the median of the rest is reported, with the
    largest CPU time any peer's process spent on it (Gloo's threads included).
    Without ``--rate`` the peers talk over loopback (CPU-bound: the encode/decode cost dominates,
    so speedups there say little about slow links). With ``--rate MBIT`` (root, iproute2) every
    peer sits in its own network namespace behind a tbf-shaped link of that rate in each
    direction (:class:`isthmus.lab.netns.WanNetwork`).

``train``
    The tiny GPT trained by ``--peers`` peer processes (``isthmus demo`` without faults), once per
    compressor and strategy; reports the final eval loss against the bytes all peers sent.

Examples::

    python benchmarks/compression.py allreduce --peers 4 --size-mb 32 --specs none,int8,int4
    python benchmarks/compression.py allreduce --peers 4 --size-mb 32 --rate 100 --json
    python benchmarks/compression.py train --peers 3 --out runs/bench-compression
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_ALLREDUCE_SPECS = "none,int8,int4"
TRAIN_SPECS = [
    "none",
    "int8",
    "uint8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int4",
    "e3m0",
    "topk:0.1",
    "topk:0.1+ef",
    "topk:0.1+ef21",
    "topk:0.1+econtrol",
    "randk:0.1+ef",
    "powersgd:rank=2",
    "sign",
    "sketch:0.05,rows=3,width=0.1",
]


# -- all-reduce timing ------------------------------------------------------------------------------
def _shape(size_mb: float) -> tuple[int, int]:
    """A matrix of about ``size_mb`` MB of fp32 (PowerSGD needs two dimensions; the others
    flatten it). 32 MB is 4096 x 2048."""
    numel = int(size_mb * 2**20 / 4)
    cols = 2048 if numel >= 2048 * 16 else max(1, numel // 16)
    return max(1, numel // cols), cols


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from isthmus.comm.group import Group, build_process_group
    from isthmus.reduce.compress import make_compressor

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    store = dist.TCPStore(
        args.host, args.port, world, rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    pg = build_process_group(
        store,
        rank,
        world,
        timeout_s=600,
        interface=args.iface or None,
        hostname=None if args.iface else args.host,
    )
    group = Group(pg, rank, world, timeout_s=600)
    shape = _shape(args.size_mb)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
    specs = args.specs.split(",")
    comps = {s: make_compressor(s) for s in specs if s != "none"}
    times: dict[str, list[float]] = {s: [] for s in specs}
    cpu: dict[str, list[float]] = {s: [] for s in specs}
    sent: dict[str, int] = {}
    for rep in range(args.reps + 1):
        for spec in specs:
            group.barrier()
            before = group.stats.bytes_sent
            c0 = time.process_time()  # this process, Gloo's threads included
            t0 = time.perf_counter()
            if spec == "none":
                buf = x.clone()  # the plain reducer copies into a fresh buffer too
                group.all_reduce(buf)
            else:
                comps[spec].reduce_sum(group, "x", x)
                comps[spec].commit()
            dt = torch.tensor(
                [time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64
            )
            sent[spec] = group.stats.bytes_sent - before
            group.all_reduce(dt, "max")  # the slowest peer decides
            if rep > 0:
                times[spec].append(float(dt[0]))
                cpu[spec].append(float(dt[1]))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "cpu": cpu, "bytes_per_peer": sent}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_allreduce(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="isthmus-bench-")) / "result.json"
    base = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_worker",
        "--world",
        str(args.peers),
        "--size-mb",
        str(args.size_mb),
        "--specs",
        args.specs,
        "--reps",
        str(args.reps),
        "--out",
        str(out),
    ]
    network = "loopback"
    if args.rate:
        from isthmus.lab.wan import WanNetwork

        network = f"netns, tbf {args.rate:g} Mbit/s per link and direction"
        with WanNetwork(args.peers, rates_mbit=args.rate, prefix="isthcb") as net:
            argv = [*base, "--host", net.peers[0].ip, "--port", "29533", "--iface", "wan0"]
            procs = [net.popen(r, [*argv, "--rank", str(r)]) for r in range(args.peers)]
            codes = [p.wait(timeout=args.timeout) for p in procs]
    else:
        argv = [*base, "--host", "127.0.0.1", "--port", str(_free_port())]
        procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(args.peers)]
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    raw = json.loads(out.read_text())
    med = {s: statistics.median(v) for s, v in raw["times"].items()}
    fp32 = med.get("none")
    rows = []
    for spec, t in med.items():
        row: dict[str, Any] = {
            "compression": spec,
            "time_s": round(t, 4),
            "min_time_s": round(min(raw["times"][spec]), 4),
            "cpu_s": round(statistics.median(raw["cpu"][spec]), 4),
            "bytes_per_peer": raw["bytes_per_peer"][spec],
        }
        if fp32 is not None:
            row["fp32_time_s"] = round(fp32, 4)
            row["speedup_vs_fp32"] = round(fp32 / t, 3)
            row["bytes_ratio_vs_fp32"] = round(
                raw["bytes_per_peer"]["none"] / raw["bytes_per_peer"][spec], 3
            )
        rows.append(row)
    return {
        "peers": args.peers,
        "size_mb": args.size_mb,
        "shape": list(_shape(args.size_mb)),
        "network": network,
        "reps": args.reps,
        "results": rows,
    }


# -- training sweep -----------------------------------------------------------------------------------
def run_train(args: argparse.Namespace) -> list[dict[str, Any]]:
    from isthmus.run.builtin_run import run_demo

    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    res_path = root / "results.json"
    if res_path.exists():  # resume an interrupted sweep
        results = json.loads(res_path.read_text())
    done = {(r["strategy"], r["compression"]) for r in results}
    specs = args.specs.split(",") if args.specs else TRAIN_SPECS
    for strategy in args.strategies.split(","):
        for spec in specs:
            if (strategy, spec) in done:
                continue
            run_dir = root / f"{strategy}-{spec.replace(':', '_').replace(',', '_')}"
            s = run_demo(
                {
                    "peers": args.peers,
                    "strategy": strategy,
                    "steps": args.ddp_steps if strategy == "ddp" else args.diloco_steps,
                    "compression": None if spec == "none" else spec,
                    "model": "tiny",
                    "seed": args.seed,
                    "corpus_bytes": args.corpus_bytes,
                    "run_dir": str(run_dir),
                    "progress": False,
                }
            )
            row = {
                "strategy": strategy,
                "compression": spec,
                "steps": s.steps,
                "final_eval_loss": s.final_eval_loss,
                "initial_eval_loss": s.initial_eval_loss,
                "bytes_sent_total": s.bytes_sent_total,
                "peak_bytes_per_round": s.peak_bytes_per_round,
                "bytes_by_op": s.bytes_by_op,
                "rounds_committed": s.rounds_committed,
                "rounds_aborted": s.rounds_aborted,
                "resyncs": s.resyncs,
                "parity_failures": s.parity_failures,
                "peers_final": s.peers_final,
                "wall_s": s.wall_s,
            }
            print(json.dumps(row), flush=True)
            results.append(row)
            res_path.write_text(json.dumps(results, indent=1))
    return results


def train_table(results: list[dict[str, Any]]) -> str:
    """Markdown table: eval loss and bytes per strategy and compressor."""
    lines = []
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        rows = [r for r in results if r["strategy"] == strategy]
        base = next((r for r in rows if r["compression"] == "none"), None)
        lines.append(f"\n{strategy} ({rows[0]['steps']} steps)\n")
        lines.append(
            "| compression | eval loss | bytes sent (all peers) | fewer bytes than none | "
            "peak round bytes (one peer) | parity failures |"
        )
        lines.append("|---|---|---|---|---|---|")
        for r in rows:
            ratio = (
                f"{base['bytes_sent_total'] / r['bytes_sent_total']:.1f}x"
                if base and r["bytes_sent_total"]
                else "-"
            )
            lines.append(
                f"| `{r['compression']}` | {r['final_eval_loss']:.4f} | "
                f"{r['bytes_sent_total']:,} | {ratio} | {r['peak_bytes_per_round']:,} | "
                f"{r['parity_failures']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce", help="time one all-reduce: fp32 against compressors")
    a.add_argument("--peers", type=int, default=4)
    a.add_argument("--size-mb", type=float, default=32.0)
    a.add_argument("--specs", default=DEFAULT_ALLREDUCE_SPECS, help="'none' is fp32")
    a.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    a.add_argument("--rate", type=float, default=0.0, help="Mbit/s per link (netns, root)")
    a.add_argument("--timeout", type=float, default=1800.0)
    a.add_argument("--json", action="store_true")
    w = sub.add_parser("_worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--host", required=True)
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--iface", default="")
    w.add_argument("--size-mb", type=float, required=True)
    w.add_argument("--specs", required=True)
    w.add_argument("--reps", type=int, required=True)
    w.add_argument("--out", required=True)
    t = sub.add_parser("train", help="eval loss against bytes on the tiny GPT")
    t.add_argument("--peers", type=int, default=3)
    t.add_argument("--strategies", default="ddp,diloco")
    t.add_argument("--specs", default="", help="comma-separated (default: the table's list)")
    t.add_argument("--ddp-steps", type=int, default=150)
    t.add_argument("--diloco-steps", type=int, default=200)
    t.add_argument("--corpus-bytes", type=int, default=2_000_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="runs/bench-compression")
    args = p.parse_args(argv)
    if args.cmd == "_worker":
        _worker(args)
    elif args.cmd == "allreduce":
        res = run_allreduce(args)
        if args.json:
            print(json.dumps(res, indent=1))
        else:
            print(f"{res['peers']} peers, {res['size_mb']} MB, {res['network']}")
            for r in res["results"]:
                print(
                    f"  {r['compression']:>16}  {r['time_s']:8.3f} s  "
                    f"x{r.get('speedup_vs_fp32', 0):6.2f}  {r['bytes_per_peer']:>12,} B/peer  "
                    f"cpu {r['cpu_s']:.3f} s"
                )
    else:
        os.environ.setdefault("ISTHMUS_LOG", "WARNING")
        print(train_table(run_train(args)))


if __name__ == "__main__":
    main()
