"""``isthmus lab run|soak|report|compare|sim|cleanup`` and ``isthmus bench allreduce|link``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from isthmus.cli.common import print_summary, strategy_names
from isthmus.run.flags import add_config_flags

__all__ = ["add_parsers"]

SCENARIO_KEYS = (
    "peers",
    "model",
    "seed",
    "strategy",
    "option",
    "kill",
    "join",
    "fault",
    "byzantine",
)
"""Settings a scenario file makes; the command line does not override them."""


def _cmd_lab_run(args: argparse.Namespace) -> int:
    from isthmus.lab.jobspec import script_spec
    from isthmus.lab.netns import LabError
    from isthmus.lab.scenario import load_scenario
    from isthmus.run.flags import overrides_from
    from isthmus.run.lab_run import LabOptions, run_lab

    extra = list(getattr(args, "script_args", None) or [])
    if extra and args.script is None:
        print(
            "isthmus lab run: arguments after -- are the script's: give --script FILE "
            "(the scenario's [job] has its own args)",
            file=sys.stderr,
        )
        return 2
    try:
        scenario = load_scenario(args.scenario)
        job = script_spec(args.script, extra, key="--script") if args.script else None
        opts = LabOptions(network=args.network, prefix=args.prefix, tee=not args.quiet)
        summary = run_lab(scenario, opts, overrides=overrides_from(args), script=job)
    except (ValueError, FileExistsError, OSError, LabError) as e:
        print(f"isthmus lab run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "isthmus lab run: interrupted; peers stopped and the network removed", file=sys.stderr
        )
        return 130
    script = summary.program != "isthmus.run.job"
    print_summary(
        summary,
        title=f"isthmus lab run: {Path(summary.program).name}" if script else "isthmus demo",
    )
    assert summary.lab is not None
    net, bc = summary.lab.network, summary.lab.bytes_check
    print(f"network: {net['mode']}" + (f" ({net['reason']})" if net["reason"] else ""))
    if bc.get("rel_diff_data_plane") is not None:
        print(
            f"bytes on the wire vs isthmus accounting: {100 * bc['rel_diff_total']:+.1f}% in "
            f"total, {100 * bc['rel_diff_data_plane']:+.1f}% for the data-plane payload"
        )
    ev = summary.lab.eval
    if ev.get("target_loss") is not None:
        hit = ev.get("time_to_target_s")
        print(
            f"eval loss {ev['target_loss']}: "
            + (f"reached after {hit} s (step {ev['step_at_target']})" if hit else "not reached")
        )
    print(f"report: {Path(summary.run_dir) / 'report.html'}")
    if script:
        _print_failures(summary)
    return 0 if summary.ok else 1


def _print_failures(summary: Any) -> None:
    """Each peer process of a script that failed by itself (not killed by the scenario's churn),
    with the end of its output, as ``isthmus run`` prints them."""
    from isthmus.run.record import LATE_JOINER_EXIT, RunDir

    assert summary.lab is not None
    killed = {c["name"] for c in summary.lab.churn_applied if c["action"] == "kill"}
    run_dir = RunDir(summary.run_dir)
    for name, rc in summary.exit_codes.items():
        if rc in (0, None, LATE_JOINER_EXIT) or name in killed:
            continue
        print(
            f"{name} exited with {rc}; the end of its output ({run_dir.log(name)}):",
            file=sys.stderr,
        )
        for line in run_dir.tail(name).splitlines():
            print(f"  | {line}", file=sys.stderr)


def _cmd_lab_soak(args: argparse.Namespace) -> int:
    from isthmus.lab.netns import LabError
    from isthmus.lab.scenario import load_scenario
    from isthmus.run.flags import overrides_from
    from isthmus.run.lab_run import LabOptions
    from isthmus.run.soak import SoakOptions, run_soak

    try:
        scenario = load_scenario(args.scenario)
        opts = SoakOptions(
            minutes=args.minutes,
            max_stall_s=args.max_stall,
            hang_s=args.hang_s,
            sample_s=args.sample_s,
        )
        lab = LabOptions(network=args.network, prefix=args.prefix)
        rep, run_dir = run_soak(scenario, opts, lab, overrides=overrides_from(args))
    except (ValueError, FileExistsError, OSError, LabError) as e:
        print(f"isthmus lab soak: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "isthmus lab soak: interrupted; peers stopped and the network removed", file=sys.stderr
        )
        return 130
    print("PASS" if rep.ok else "FAIL: " + "; ".join(rep.reasons))
    print(
        f"rounds committed {rep.rounds_committed}, aborted {rep.rounds_aborted}, parity failures "
        f"{rep.parity_failures}, longest stall {rep.longest_stall_s} s (bound {rep.max_stall_s} s)"
    )
    print(f"report: {run_dir.path / 'soak.md'}")
    return 0 if rep.ok else 1


def _cmd_lab_compare(args: argparse.Namespace) -> int:
    from isthmus.run.report import compare_runs

    try:
        written = compare_runs(args.runs, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"isthmus lab compare: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def _cmd_lab_report(args: argparse.Namespace) -> int:
    from isthmus.run.report import plot_run

    try:
        written = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"isthmus lab report: {e}", file=sys.stderr)
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
    from isthmus.lab.rates import parse_rate

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
    from isthmus.run.measure import measure_run, validate_runs

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
            connections=args.connections,
            rtt_ms=args.rtt_ms,
            jitter_ms=args.jitter_ms,
            loss=args.loss,
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


def _cmd_bench_link(args: argparse.Namespace) -> int:
    from isthmus.lab.fidelity import LinkBenchConfig, format_link_bench, run_link_bench
    from isthmus.lab.netns import LabError

    try:
        cfg = LinkBenchConfig(
            rate_mbit=None if args.rate == "unlimited" else _rate(args.rate) / 1e6,
            rtts_ms=tuple(args.rtt_ms),
            jitter_ms=args.jitter_ms,
            loss=args.loss,
            seconds=args.seconds,
            window_kib=args.window_kib,
            congestion_control=args.congestion_control,
        )
        result = run_link_bench(cfg)
    except (argparse.ArgumentTypeError, ValueError, LabError) as e:
        print(f"isthmus bench link: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("isthmus bench: interrupted; the network removed", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=1) if args.json else format_link_bench(result))
    return 0


def _ms_list(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give round trips in ms separated by commas, e.g. 10,80,300; got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError(f"no round trip in {text!r}")
    return out


def _add_impairment_flags(a: argparse.ArgumentParser, *, rtt_list: bool) -> None:
    if rtt_list:
        a.add_argument(
            "--rtt-ms",
            type=_ms_list,
            default=[10.0, 40.0, 80.0, 150.0, 300.0],
            help="round trips to measure, comma-separated (default 10,40,80,150,300)",
        )
    else:
        a.add_argument(
            "--rtt-ms",
            type=float,
            default=0.0,
            help="round trip between two peers, ms (a user-space delay line per link; default 0)",
        )
    a.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="the round trip varies within +- this many ms (at most the round trip)",
    )
    a.add_argument(
        "--loss", type=float, default=0.0, help="share of packets lost one way, e.g. 0.001"
    )


def add_parsers(sub: Any) -> None:
    """``isthmus lab run|report|compare|sim|cleanup`` and ``isthmus bench allreduce``."""
    lab = sub.add_parser(
        "lab", help="emulated-WAN lab: run scenarios, compare runs, simulate scale"
    )
    lsub = lab.add_subparsers(dest="lab_command", required=True)

    r = lsub.add_parser("run", help="run one scenario file (see scenarios/ and docs/LAB.md)")
    r.add_argument("scenario", help="scenario TOML file")
    r.add_argument(
        "--script",
        default=None,
        metavar="FILE",
        help="run your own peer script (one that uses isthmus.SessionConfig.from_env(), as for "
        "`isthmus run`) instead of the built-in job; its arguments follow `--` "
        "(e.g. --script train.py -- --steps 50). Overrides the scenario's [job]",
    )
    r.add_argument(
        "--quiet",
        action="store_true",
        help="with a script: keep what its peers print in the run directory only (by default "
        "each line also appears here, prefixed with its peer, as for `isthmus run`)",
    )
    r.add_argument(
        "--network",
        default="auto",
        choices=["auto", "netns", "loopback"],
        help="auto: namespaces and tc if possible, else loopback without shaping (default); "
        "netns: fail without them; loopback: never build namespaces",
    )
    r.add_argument("--prefix", default="isth", help="namespace name prefix (default isth)")
    # what the scenario says (peers, model, strategy, churn, attacks) comes from the file
    add_config_flags(r, exclude=SCENARIO_KEYS)
    r.set_defaults(func=_cmd_lab_run, script_args=[])

    k = lsub.add_parser(
        "soak", help="run a scenario for a fixed time; fail on a stall, a parity failure or a hang"
    )
    k.add_argument("scenario", help="scenario TOML file (see scenarios/soak_*.toml)")
    k.add_argument("--minutes", type=float, required=True, help="how long to run it")
    k.add_argument(
        "--max-stall", type=float, required=True, help="longest allowed time between commits, s"
    )
    k.add_argument(
        "--hang-s",
        type=float,
        default=None,
        help="a running peer without a step for this long is hung (default max(60, 10 x stall))",
    )
    k.add_argument("--sample-s", type=float, default=2.0, help="how often peers are sampled, s")
    k.add_argument("--network", default="auto", choices=["auto", "netns", "loopback"])
    k.add_argument("--prefix", default="isth", help="namespace name prefix (default isth)")
    add_config_flags(k, exclude=(*SCENARIO_KEYS, "timeout"))  # --minutes is the timeout
    k.set_defaults(func=_cmd_lab_soak)

    rp = lsub.add_parser(
        "report",
        help="write a run directory's plots, report.md and a self-contained report.html",
    )
    rp.add_argument("run_dir", help="a run directory (demo, lab run or isthmus run)")
    rp.set_defaults(func=_cmd_lab_report)

    c = lsub.add_parser(
        "compare", help="overlay several runs (loss vs step, time, bytes) in compare.md/.html"
    )
    c.add_argument("runs", nargs="+", help="run directories")
    c.add_argument(
        "--out", default="runs/compare", help="where to write the plots, compare.md and .html"
    )
    c.set_defaults(func=_cmd_lab_compare)

    s = lsub.add_parser(
        "sim", help="predict wall-clock and utilization at 8-10,000 peers, or --validate runs"
    )
    s.add_argument(
        "--strategy", default="diloco", help="the strategy to model: " + ", ".join(strategy_names())
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
        "--connections",
        type=int,
        default=1,
        metavar="K",
        help="TCP connections per peer pair that isthmus stripes each collective over (default 1; "
        "raw Gloo always has one)",
    )
    a.add_argument(
        "--congestion-control",
        default=None,
        metavar="NAME",
        help="TCP congestion control in the namespaces (e.g. reno, bbr; default: the host's)",
    )
    _add_impairment_flags(a, rtt_list=False)
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.set_defaults(func=_cmd_bench_allreduce)

    lk = bsub.add_parser(
        "link",
        help="fidelity of the emulated latency: ping, a windowed and a bulk TCP transfer per "
        "round trip, against what the settings predict",
    )
    lk.add_argument("--rate", default="100mbit", help="link rate (e.g. 1gbit) or unlimited")
    _add_impairment_flags(lk, rtt_list=True)
    lk.add_argument("--seconds", type=float, default=6.0, help="length of each transfer")
    lk.add_argument("--window-kib", type=int, default=256, help="the windowed transfer's window")
    lk.add_argument(
        "--congestion-control",
        default=None,
        metavar="NAME",
        help="TCP congestion control in the namespaces (e.g. reno, bbr; default: the host's)",
    )
    lk.add_argument("--json", action="store_true", help="print the result as JSON")
    lk.set_defaults(func=_cmd_bench_link)
