"""The ``isthmus`` command line: coordinator, demo, lab (run, compare, sim, cleanup) and bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _kill_spec(text: str) -> tuple[int, int]:
    peer, sep, step = text.partition("@")
    if not sep or not peer.isdigit() or not step.isdigit():
        raise argparse.ArgumentTypeError(f"--kill takes PEER@STEP (e.g. 1@20), got {text!r}")
    return int(peer), int(step)


def _byzantine_spec(text: str) -> tuple[int, str]:
    peer, sep, attack = text.partition(":")
    if not sep or not peer.isdigit() or not attack:
        raise argparse.ArgumentTypeError(
            f"--byzantine takes PEER:ATTACK (e.g. 2:sign_flip or 1:ipm:tau=2), got {text!r}"
        )
    return int(peer), attack


def _fault_spec(text: str) -> tuple[int, str]:
    from isthmus.comm.faults import Fault

    peer, sep, spec = text.partition(":")
    if not sep or not peer.isdigit():
        raise argparse.ArgumentTypeError(
            f"--fault takes PEER:SPEC (e.g. 1:kill@collective:step=20), got {text!r}"
        )
    try:
        Fault.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return int(peer), spec


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option takes KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.replace("-", "_"), parsed


def _token(args: argparse.Namespace) -> str:
    if args.token and args.token_file:
        raise SystemExit("give --token or --token-file, not both")
    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else args.token or ""
    except OSError as e:
        raise SystemExit(f"cannot read --token-file: {e}") from None
    if not token:
        raise SystemExit("a token is required: --token SECRET or --token-file PATH")
    return token


def _group_faults(pairs: list[tuple[int, str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for peer, spec in pairs:
        out.setdefault(peer, []).append(spec)
    return out


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    cfg = CoordinatorConfig(
        token=_token(args),
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        heartbeat_interval=args.heartbeat_interval,
        membership=MembershipConfig(
            min_peers=args.min_peers,
            start_peers=args.start_peers,
            heartbeat_timeout=args.heartbeat_timeout,
            parity_every=args.parity_every,
            begin_timeout=args.begin_timeout,
            commit_timeout=args.commit_timeout,
        ),
    )
    coord = Coordinator(cfg)
    print(
        f"isthmus coordinator on {args.host}:{args.port} (Ctrl-C to stop); "
        f"status: curl -H 'Authorization: Bearer <token>' http://{coord.address}/v1/status",
        file=sys.stderr,
    )
    with contextlib.suppress(KeyboardInterrupt):
        coord.serve_forever()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from isthmus.demo.runner import DemoConfig, run_demo

    options = dict(args.option)
    for key in ("sync_every", "topology", "schedule"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    everyone = args.peers + len(args.join)
    for flag, peer in [("--byzantine", p) for p, _ in args.byzantine] + [
        ("--fault", p) for p, _ in args.fault
    ]:
        if not 0 <= peer < everyone:
            print(
                f"isthmus demo: {flag} names peer {peer}, but there are peers 0..{everyone - 1} "
                f"({args.peers} start and {len(args.join)} join)",
                file=sys.stderr,
            )
            return 2
    try:
        cfg = DemoConfig(
            peers=args.peers,
            strategy=args.strategy,
            steps=args.steps,
            kills=args.kill,
            joins=args.join,
            strategy_options=options,
            compression=args.compression,
            aggregator=args.aggregator,
            byzantine_f=args.byzantine_f,
            byzantine=dict(args.byzantine),
            extra_faults=_group_faults(args.fault),
            model=args.model,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            shard=args.shard,
            run_dir=args.run_dir,
            summary_json=args.summary_json,
            heartbeat_timeout=args.heartbeat_timeout,
            collective_timeout=args.collective_timeout,
            progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"isthmus demo: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_demo(cfg)
    except FileExistsError as e:
        print(f"isthmus demo: {e}", file=sys.stderr)
        return 2
    _print_summary(summary)
    ok = summary["peers_final"] > 0 and summary["parity_failures"] == 0
    return 0 if ok else 1


def _print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"isthmus demo: {s['strategy']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("reduction", f"compression {s['compression']}, aggregator {s['aggregator']}"),
        ("eval loss", f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']}"),
        ("rounds committed / aborted", f"{s['rounds_committed']} / {s['rounds_aborted']}"),
        ("parity checks / failures", f"{s['parity_checks']} / {s['parity_failures']}"),
        ("resyncs", str(s["resyncs"])),
        ("peers at the end (bit-identical)", f"{s['peers_final']} of {s['peers_started']} started"),
        ("kills / joins", f"{s['kills']} / {s['joins']}"),
        ("bytes sent (all peers)", f"{s['bytes_sent_total']:,}"),
        ("bytes DDP would have sent", f"{s['bytes_sent_ddp_equivalent']:,}"),
        ("recovery after kill (s)", ", ".join(str(x) for x in s["recovery_s"]) or "-"),
        ("wall time (s)", str(s["wall_s"])),
        ("run directory", s["run_dir"]),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


def _cmd_lab_run(args: argparse.Namespace) -> int:
    from isthmus.lab.netns import LabError
    from isthmus.lab.run import LabOptions, run_lab
    from isthmus.lab.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
        opts = LabOptions(
            run_dir=args.run_dir,
            network=args.network,
            prefix=args.prefix,
            steps=args.steps,
            eval_every=args.eval_every,
            target_loss=args.target_loss,
            batch_size=args.batch_size,
            lr=args.lr,
            corpus_bytes=args.corpus_bytes,
            collective_timeout=args.collective_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            timeout_s=args.timeout,
            progress=not args.no_progress,
            summary_json=args.summary_json,
        )
        summary = run_lab(scenario, opts)
    except (ScenarioError, ValueError, FileExistsError, OSError, LabError) as e:
        print(f"isthmus lab run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "isthmus lab run: interrupted; peers stopped and the network removed", file=sys.stderr
        )
        return 130
    _print_summary(summary)
    net, bc = summary["network"], summary["bytes_check"]
    print(f"network: {net['mode']}" + (f" ({net['reason']})" if net["reason"] else ""))
    if bc.get("rel_diff_data_plane") is not None:
        print(
            f"bytes on the wire vs isthmus accounting: {100 * bc['rel_diff_total']:+.1f}% in "
            f"total, {100 * bc['rel_diff_data_plane']:+.1f}% for the data-plane payload"
        )
    ev = summary["eval"]
    if ev.get("target_loss") is not None:
        hit = ev.get("time_to_target_s")
        print(
            f"eval loss {ev['target_loss']}: "
            + (f"reached after {hit} s (step {ev['step_at_target']})" if hit else "not reached")
        )
    print(f"report: {Path(summary['run_dir']) / 'report.md'}")
    ok = summary["peers_final"] > 0 and summary["parity_failures"] == 0
    return 0 if ok else 1


def _cmd_lab_compare(args: argparse.Namespace) -> int:
    from isthmus.lab.report import compare_runs

    try:
        written = compare_runs(args.runs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"isthmus lab compare: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def _cmd_lab_cleanup(args: argparse.Namespace) -> int:
    from isthmus.lab.netns import LabError, cleanup_stale

    try:
        removed = cleanup_stale(args.prefix, include_live=args.all)
    except (LabError, ValueError) as e:
        print(f"isthmus lab cleanup: {e}", file=sys.stderr)
        return 2
    print(f"removed {len(removed)} namespace(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def _peer_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--peers takes numbers separated by commas, got {text!r}"
        ) from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"--peers needs positive counts, got {text!r}")
    return out


def _rate(text: str) -> float:
    from isthmus.lab.scenario import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_lab_sim(args: argparse.Namespace) -> int:
    from isthmus.lab import sim

    if args.validate:
        return _lab_sim_validate(args)
    missing = [
        flag
        for flag, value in (
            ("--compute-s", args.compute_s),
            ("--bandwidth", args.bandwidth),
            (
                "--model-bytes or --params",
                args.model_bytes if args.model_bytes is not None else args.params,
            ),
        )
        if value is None
    ]
    if missing:
        print(f"isthmus lab sim: give {', '.join(missing)} (or --validate RUN...)", file=sys.stderr)
        return 2
    try:
        model_bytes = args.model_bytes if args.model_bytes is not None else 4.0 * args.params
        simulator = sim.Simulator(
            compute_s_per_step=args.compute_s,
            strategy=sim.strategy_profile(
                args.strategy,
                model_bytes=model_bytes,
                sync_every=args.sync_every,
                fragments=args.fragments,
                overlap_steps=args.overlap_steps,
                compression_ratio=args.compression_ratio,
                ddp_overlap=args.ddp_overlap,
            ),
            network=sim.NetworkModel(
                bandwidth_bps=args.bandwidth,
                latency_s=args.latency_ms / 1000.0,
                algorithm=args.algorithm,
                efficiency=args.efficiency,
                group_size=args.group_size,
                gossip_degree=args.gossip_degree,
            ),
            failures=sim.FailureModel(
                failures_per_peer_per_hour=args.failures_per_hour, recovery_s=args.recovery_s
            ),
        )
        results = simulator.sweep(args.peers, steps=args.steps)
    except ValueError as e:
        print(f"isthmus lab sim: {e}", file=sys.stderr)
        return 2
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        print(sim.format_table(sim.rows(results)))
    return 0


def _lab_sim_validate(args: argparse.Namespace) -> int:
    from isthmus.lab.measure import measure_run, validate_runs

    try:
        measured = [measure_run(r) for r in args.validate]
        compute = (
            {m.peers: args.compute_s for m in measured} if args.compute_s is not None else None
        )
        checked = validate_runs(
            measured,
            compute_by_peers=compute,
            efficiency=args.efficiency,
            latency_s=args.latency_ms / 1000.0,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"isthmus lab sim: {e}", file=sys.stderr)
        return 2
    rows = [
        {
            "run": Path(m.run_dir).name,
            "strategy": m.strategy,
            "peers": m.peers,
            "metric": v.metric,
            "predicted": round(v.predicted, 6),
            "measured": round(v.measured, 6),
            "rel_error": round(v.rel_error, 4),
        }
        for m, vs in checked
        for v in vs
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from isthmus.lab.sim import format_table

    print(
        format_table(
            [
                {
                    **r,
                    "predicted": f"{r['predicted']:.4g}",
                    "measured": f"{r['measured']:.4g}",
                    "rel_error": f"{100 * r['rel_error']:+.1f}%",
                }
                for r in rows
            ]
        )
    )
    return 0


def _cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from isthmus.lab.bench import BenchConfig, BenchError, format_bench, run_bench
    from isthmus.lab.netns import LabError

    try:
        cfg = BenchConfig(
            peers=args.peers,
            rate_mbit=None if args.rate == "unlimited" else _rate(args.rate) / 1e6,
            sizes_mb=tuple(args.size_mb or [32.0]),
            reps=args.reps,
            warmup=args.warmup,
            compression=args.compression,
            network=args.network,
            collectives=args.collectives,
            congestion_control=args.congestion_control,
        )
        result = run_bench(cfg)
    except (argparse.ArgumentTypeError, ValueError, BenchError, LabError) as e:
        print(f"isthmus bench allreduce: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "isthmus bench: interrupted; workers stopped and the network removed", file=sys.stderr
        )
        return 130
    print(json.dumps(result, indent=1) if args.json else format_bench(result))
    return 0


def _add_lab_parsers(sub: Any) -> None:
    """``isthmus lab run|compare|sim|cleanup`` and ``isthmus bench allreduce``."""
    lab = sub.add_parser(
        "lab", help="emulated-WAN lab: run scenarios, compare runs, simulate scale"
    )
    lsub = lab.add_subparsers(dest="lab_command", required=True)

    r = lsub.add_parser("run", help="run one scenario file (see scenarios/ and docs/LAB.md)")
    r.add_argument("scenario", help="scenario TOML file")
    r.add_argument("--run-dir", default=None, help="results directory (default runs/<time>-<name>)")
    r.add_argument(
        "--network",
        default="auto",
        choices=["auto", "netns", "loopback"],
        help="auto: namespaces and tc if possible, else loopback without shaping (default); "
        "netns: fail without them; loopback: never build namespaces",
    )
    r.add_argument("--steps", type=int, default=None, help="override the scenario's run.steps")
    r.add_argument(
        "--eval-every", type=int, default=0, help="eval loss every N steps (0: at the end)"
    )
    r.add_argument(
        "--target-loss", type=float, default=None, help="report the time to this eval loss"
    )
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--corpus-bytes", type=int, default=2_000_000)
    r.add_argument("--collective-timeout", type=float, default=30.0)
    r.add_argument("--heartbeat-timeout", type=float, default=3.0)
    r.add_argument("--timeout", type=float, default=1800.0, help="bound on the whole run, seconds")
    r.add_argument("--prefix", default="isth", help="namespace name prefix (default isth)")
    r.add_argument("--summary-json", default=None, help="also write the summary JSON here")
    r.add_argument("--no-progress", action="store_true", help="no live progress bar")
    r.set_defaults(func=_cmd_lab_run)

    c = lsub.add_parser("compare", help="overlay several runs (loss vs step, time, bytes)")
    c.add_argument("runs", nargs="+", help="run directories")
    c.add_argument("--out", default="runs/compare", help="where to write the plots and compare.md")
    c.set_defaults(func=_cmd_lab_compare)

    s = lsub.add_parser(
        "sim", help="predict wall-clock and utilization at 8-10,000 peers, or --validate runs"
    )
    s.add_argument(
        "--strategy", default="diloco", help="ddp, diloco, localsgd, streaming, eager, co2, gossip"
    )
    s.add_argument(
        "--peers", type=_peer_list, default=[8, 16, 32, 64, 128, 256, 512, 1024, 4096, 10_000]
    )
    s.add_argument(
        "--compute-s", type=float, default=None, help="measured compute per inner step, s"
    )
    s.add_argument(
        "--model-bytes", type=float, default=None, help="bytes synchronized per round (fp32)"
    )
    s.add_argument("--params", type=float, default=None, help="or: parameters (4 bytes each)")
    s.add_argument("--bandwidth", type=_rate, default=None, help="link rate, e.g. 100mbit")
    s.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per message")
    s.add_argument("--sync-every", type=int, default=1, help="H (inner steps per round)")
    s.add_argument("--fragments", type=int, default=1, help="P (streaming)")
    s.add_argument("--overlap-steps", type=float, default=0.0, help="tau (streaming)")
    s.add_argument("--compression-ratio", type=float, default=1.0, help="compressed/original bytes")
    s.add_argument(
        "--ddp-overlap",
        type=float,
        default=0.0,
        help="share of DDP compute overlapping its all-reduce",
    )
    s.add_argument(
        "--algorithm", default="ring", choices=["ring", "tree", "hierarchical", "gossip"]
    )
    s.add_argument("--efficiency", type=float, default=0.95, help="payload share of the link rate")
    s.add_argument("--group-size", type=int, default=None, help="hierarchical: peers per group")
    s.add_argument("--gossip-degree", type=int, default=2)
    s.add_argument("--failures-per-hour", type=float, default=0.0, help="per peer")
    s.add_argument("--recovery-s", type=float, default=30.0)
    s.add_argument("--steps", type=int, default=1000)
    s.add_argument(
        "--validate",
        nargs="+",
        metavar="RUN",
        default=None,
        help="compare predictions with these lab run directories instead (their own inputs)",
    )
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_cmd_lab_sim)

    k = lsub.add_parser("cleanup", help="remove namespaces left by crashed lab runs")
    k.add_argument("--prefix", default="isth")
    k.add_argument("--all", action="store_true", help="also those of runs still alive")
    k.set_defaults(func=_cmd_lab_cleanup)

    bench = sub.add_parser("bench", help="benchmarks on the emulated network")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    a = bsub.add_parser(
        "allreduce", help="isthmus all-reduce vs raw Gloo on the same shaped links, same run"
    )
    a.add_argument("--peers", type=int, default=4)
    a.add_argument("--rate", default="100mbit", help="link rate (e.g. 100mbit) or unlimited")
    a.add_argument(
        "--size-mb",
        type=float,
        action="append",
        default=None,
        help="MB of fp32 (repeatable; default 32)",
    )
    a.add_argument("--reps", type=int, default=3)
    a.add_argument("--warmup", type=int, default=1)
    a.add_argument(
        "--compression", default=None, help="also time this compressor (int8, int4, ...)"
    )
    a.add_argument("--network", default="auto", choices=["auto", "netns", "loopback"])
    a.add_argument(
        "--collectives",
        action="store_true",
        help="also time raw Gloo all_to_all and all_gather, and isthmus's exchange, each moving "
        "one int8 stage's bytes",
    )
    a.add_argument(
        "--congestion-control",
        default=None,
        metavar="NAME",
        help="TCP congestion control in the namespaces (e.g. reno, bbr; default: the host's)",
    )
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.set_defaults(func=_cmd_bench_allreduce)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="isthmus",
        description="Train one PyTorch model across machines that fail, come and go, and talk over thin links.",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run the membership server for a run")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    c.add_argument("--port", type=int, default=29400, help="HTTP port (default 29400)")
    c.add_argument(
        "--store-port", type=int, default=29401, help="rendezvous store port (default 29401)"
    )
    c.add_argument("--token", help="shared secret every peer must present")
    c.add_argument("--token-file", help="read the token from this file instead")
    c.add_argument(
        "--min-peers", type=int, default=1, help="rounds wait for at least this many peers"
    )
    c.add_argument(
        "--start-peers", type=int, default=None, help="the first round waits for this many"
    )
    c.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, help="evict a silent peer after this"
    )
    c.add_argument("--heartbeat-interval", type=float, default=1.0, help="peers' heartbeat period")
    c.add_argument(
        "--parity-every", type=int, default=1, help="compare state hashes every N rounds"
    )
    c.add_argument(
        "--begin-timeout",
        type=float,
        default=600.0,
        help="evict a live member that has not begun the next round this long after the first did "
        "(raise it when peers compute for long between rounds)",
    )
    c.add_argument(
        "--commit-timeout",
        type=float,
        default=600.0,
        help="evict a live member that has not reported a round this long after it formed",
    )
    c.set_defaults(func=_cmd_coordinator)

    d = sub.add_parser(
        "demo", help="train the tiny GPT on local peers with an embedded coordinator"
    )
    d.add_argument("--peers", type=int, default=3, help="peer processes at the start (default 3)")
    d.add_argument(
        "--strategy",
        default="diloco",
        help="ddp, diloco, localsgd, streaming, eager, co2, gossip (default diloco)",
    )
    d.add_argument(
        "--steps", type=int, default=None, help="training steps (default 150 ddp, 200 diloco)"
    )
    d.add_argument(
        "--kill",
        type=_kill_spec,
        action="append",
        default=[],
        metavar="PEER@STEP",
        help="SIGKILL that peer when it reaches STEP (repeatable)",
    )
    d.add_argument(
        "--join",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="launch a new peer when the run reaches STEP (repeatable)",
    )
    d.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="H of diloco, localsgd, streaming, eager; tau of co2 (default 20)",
    )
    d.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra strategy option (repeatable), e.g. --option outer_lr=0.5",
    )
    d.add_argument(
        "--compression",
        default=None,
        metavar="SPEC",
        help="compress reductions: int8, uint8, fp8_e4m3, fp8_e5m2, int4, e3m0, "
        "topk:0.01+ef21, randk:0.01, powersgd:rank=2, sign, sketch:0.01, ...",
    )
    d.add_argument(
        "--aggregator",
        default=None,
        metavar="SPEC",
        help="robust aggregation: median, trimmed_mean, krum, multi_krum, cc, gm, flag, nnm+krum, ...",
    )
    d.add_argument(
        "--byzantine-f", type=int, default=0, help="faulty peers the aggregator tolerates"
    )
    d.add_argument(
        "--fault",
        type=_fault_spec,
        action="append",
        default=[],
        metavar="PEER:SPEC",
        help="any fault for that peer (repeatable): kill|stop|fail|corrupt @ step|collective|commit "
        ":step=N or :round=N, e.g. 1:kill@collective:step=20",
    )
    d.add_argument(
        "--byzantine",
        type=_byzantine_spec,
        action="append",
        default=[],
        metavar="PEER:ATTACK",
        help="make that peer byzantine: sign_flip, ipm, alie, gaussian, nan, inf, label_flip (repeatable)",
    )
    d.add_argument(
        "--topology", default=None, help="gossip topology: ring, torus, exponential, ..."
    )
    d.add_argument(
        "--schedule", default=None, help="gossip schedule: constant, late-heavy, single-merge"
    )
    d.add_argument("--model", default="default", choices=["default", "tiny"])
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--lr", type=float, default=1e-3, help="(inner) learning rate of AdamW")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--shard",
        default="interleaved",
        choices=["interleaved", "contiguous"],
        help="data split across peers: interleaved (IID) or contiguous (non-IID)",
    )
    d.add_argument(
        "--run-dir", default=None, help="where to write results (default runs/<time>-<strategy>)"
    )
    d.add_argument("--summary-json", default=None, help="also write the summary JSON here")
    d.add_argument("--heartbeat-timeout", type=float, default=3.0)
    d.add_argument("--collective-timeout", type=float, default=30.0)
    d.add_argument("--no-progress", action="store_true", help="no live progress bar")
    d.set_defaults(func=_cmd_demo)
    _add_lab_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        # the commands tear down what they started (peers, namespaces) before this arrives
        print(f"isthmus {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        # a port in use, a run directory we may not write, a missing file: say which, no trace
        print(f"isthmus {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
