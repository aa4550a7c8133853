"""``isthmus coordinator``, ``isthmus demo`` and ``isthmus run``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from isthmus.cli import security
from isthmus.cli.common import print_summary, read_token, strategy_names
from isthmus.run.flags import add_config_flags

__all__ = ["add_parsers", "membership_config"]

RUN_FLAGS = (
    "heartbeat_timeout",
    "connect_timeout",
    "start_timeout",
    "timeout",
    "run_dir",
    "summary_json",
    "progress",
    "connections",
    "probe_links",
    "mesh",
    "stall_s",
    "late_s",
    "pipeline_commit",
)
"""The run settings `isthmus run` takes (the script brings its own model, data and strategy;
`connections`, `probe_links`, `stall_s`, `late_s` and `pipeline_commit` reach it through
SessionConfig.from_env, so that every peer has the same)."""


def membership_config(args: argparse.Namespace) -> Any:
    """The :class:`~isthmus.coordinator.peers.MembershipConfig` of ``isthmus coordinator``'s
    flags. ``--transfer-heartbeat-timeout`` left out is 10 s, or ``--heartbeat-timeout`` where
    that is longer; given, it must not be shorter than ``--heartbeat-timeout`` (ValueError
    naming both: a member inside a transfer never gets less than a member outside one)."""
    from isthmus.coordinator.membership import MembershipConfig

    transfer = args.transfer_heartbeat_timeout
    if transfer is None:
        transfer = max(args.heartbeat_timeout, MembershipConfig.transfer_heartbeat_timeout)
    elif transfer < args.heartbeat_timeout:
        raise ValueError(
            f"--transfer-heartbeat-timeout ({transfer:g}s) must be at least "
            f"--heartbeat-timeout ({args.heartbeat_timeout:g}s)"
        )
    return MembershipConfig(
        min_peers=args.min_peers,
        start_peers=args.start_peers,
        heartbeat_timeout=args.heartbeat_timeout,
        transfer_heartbeat_timeout=transfer,
        parity_every=args.parity_every,
        begin_timeout=args.begin_timeout,
        commit_timeout=args.commit_timeout,
    )


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    try:
        membership = membership_config(args)
    except ValueError as e:
        print(f"isthmus coordinator: {e}", file=sys.stderr)
        return 2
    restore = None
    if args.resume:
        from isthmus.checkpoint.store import CheckpointStore, StorageError
        from isthmus.coordinator.protocol import RestorePoint

        url = args.resume if "://" in args.resume else os.path.abspath(args.resume)
        try:
            revisions = CheckpointStore(url).revisions()
        except StorageError as e:
            print(f"isthmus coordinator: --resume: {e}", file=sys.stderr)
            return 2
        if not revisions:
            print(
                f"isthmus coordinator: --resume: no complete checkpoint at {url!r}", file=sys.stderr
            )
            return 2
        restore = RestorePoint(url, revisions[-1])
        print(f"the run continues from checkpoint {restore.revision} at {url}", file=sys.stderr)
    cfg = CoordinatorConfig(
        token=read_token(args) or "",
        restore_from=restore,
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        heartbeat_interval=args.heartbeat_interval,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        membership=membership,
        **security.coordinator_options(args),
    )
    coord = Coordinator(cfg)
    scheme = "https" if cfg.tls else "http"
    print(
        f"isthmus coordinator on {args.host}:{args.port} (Ctrl-C to stop); status: curl "
        f"{'-k ' if cfg.tls else ''}-H 'Authorization: Bearer <token>' "
        f"{scheme}://{coord.address}/v1/status",
        file=sys.stderr,
    )
    if cfg.tls is not None:
        print(f"TLS certificate {cfg.tls.cert}, SHA-256 fingerprint:", file=sys.stderr)
        print(cfg.tls.fingerprint, flush=True)  # on stdout alone: scripts read it from there
    print(f"dashboard: {scheme}://{coord.address}/ (log in with a token)", file=sys.stderr)
    if args.metrics_port is not None:
        where = f"{args.metrics_host or args.host}:{args.metrics_port}"
        print(f"metrics: http://{where}/metrics (no token)", file=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):
        coord.serve_forever()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from isthmus.run.builtin_run import DashboardLink, demo_config, publish, run_builtin
    from isthmus.run.flags import overrides_from

    try:
        cfg = demo_config(overrides_from(args))
        summary, _, run_dir = run_builtin(
            cfg, max_restarts=args.max_restarts, hooks=[DashboardLink()]
        )
    except (ValueError, FileExistsError) as e:
        print(f"isthmus demo: {e}", file=sys.stderr)
        return 2
    publish(summary, run_dir, also=cfg.output.summary_json)
    print_summary(summary)
    return 0 if summary.ok else 1


def _counts(text: str) -> list[int]:
    """``--nproc-per-peer``: one count or a comma-separated list of counts >= 1."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 2 or 2,1, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return counts


def _cmd_run(args: argparse.Namespace) -> int:
    from isthmus.run.flags import overrides_from
    from isthmus.run.record import LATE_JOINER_EXIT
    from isthmus.run.script_run import run_script, script_config

    token = read_token(args, required=args.coordinator is not None)
    try:
        cfg = script_config(overrides_from(args))  # no wall-clock bound unless --timeout
        summary, run_dir = run_script(
            args.script,
            args.args,
            peers=args.peers,
            max_restarts=args.max_restarts,
            coordinator=args.coordinator,
            token=token,
            coordinator_fingerprint=args.coordinator_fingerprint,
            timeouts=cfg.timeouts,
            run_dir=cfg.output.run_dir,
            steps=args.steps,
            progress=cfg.output.progress,
            tee=not args.quiet,
            summary_json=cfg.output.summary_json,
            connections=cfg.strategy.connections,
            probe_links=cfg.strategy.probe_links,
            pipeline_commit=cfg.strategy.pipeline_commit,
            nproc_per_peer=args.nproc_per_peer,
            mesh=cfg.strategy.mesh,
            name_prefix=args.name_prefix,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"isthmus run: {e}", file=sys.stderr)
        return 2
    print_summary(summary, title=f"isthmus run: {args.script}")
    # a process that came after the run's last round (a restart near the end) did no harm
    fine = (0, LATE_JOINER_EXIT)
    failed = {n: rc for n, rc in summary.exit_codes.items() if rc not in fine}
    final = _final_codes(summary)
    for name in summary.late_joiners:
        print(f"{name} came after the run had ended; it had nothing to do", file=sys.stderr)
    for name, rc in failed.items():
        print(
            f"{name} exited with {rc}; the end of its output ({run_dir.log(name)}):",
            file=sys.stderr,
        )
        for line in run_dir.tail(name).splitlines():
            print(f"  | {line}", file=sys.stderr)
    ran = [rc for rc in final.values() if rc != LATE_JOINER_EXIT]
    return 0 if ran and all(rc in fine for rc in final.values()) else 1


def _final_codes(summary: Any) -> dict[str, int | None]:
    """Each slot's last process's exit code (earlier ones were restarted)."""
    last: dict[str, tuple[str, int | None]] = {}
    for name, rc in summary.exit_codes.items():
        last[name.split(".")[0]] = (name, rc)
    return {n: rc for n, rc in last.values()}


def _restarts_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start a crashed peer again (as a joiner) up to this many times per peer",
    )


def add_parsers(sub: Any) -> None:
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
    c.add_argument(
        "--transfer-heartbeat-timeout",
        type=float,
        default=None,
        metavar="S",
        help="the heartbeat bound of a member inside a round's transfer, whose heartbeats may "
        "queue behind the round's data on a thin link (default 10, or --heartbeat-timeout if "
        "longer; never shorter than it). It applies unless a partner in the same round reports "
        "that nothing moves on its connections; raise it where a link's queue delays "
        "heartbeats by more than 10 s",
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
        default=86400.0,
        help="evict a live member that has not reported a round this long after it formed "
        "(default a day: a sync runs as long as its bytes move, and each member gives up a "
        "stuck transfer itself)",
    )
    c.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics (Prometheus) on this port without the token; by default it is "
        "served only on --port, behind the token",
    )
    c.add_argument(
        "--metrics-host",
        default=None,
        help="address of --metrics-port (default: --host); bind it where only your monitoring "
        "reaches it",
    )
    c.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run from the latest complete checkpoint in DIR (a path or fsspec URL "
        "every peer can read): peers that start without one of their own load it",
    )
    security.add_coordinator_flags(c)
    c.set_defaults(func=_cmd_coordinator)

    d = sub.add_parser(
        "demo",
        help="train the tiny GPT on local peers with an embedded coordinator",
        description="Train the built-in GPT on local peers. Strategies: "
        + ", ".join(strategy_names())
        + ". Defaults: 3 peers, diloco, 150 steps for ddp and 200 for the others, H=20.",
    )
    add_config_flags(d, shortcuts=True)
    _restarts_flag(d)
    d.set_defaults(func=_cmd_demo)

    r = sub.add_parser(
        "run",
        help="run your own training script on N local peers (like torchrun)",
        description="Start N processes of `python SCRIPT ARGS...`, each told the run through "
        "ISTHMUS_COORDINATOR, ISTHMUS_TOKEN and ISTHMUS_NAME (isthmus.SessionConfig.from_env()). "
        "Without --coordinator an embedded coordinator is started on this machine.",
    )
    r.add_argument(
        "--peers", type=int, default=1, help="peer processes on this machine (default 1)"
    )
    r.add_argument(
        "--nproc-per-peer",
        type=_counts,
        default=[1],
        metavar="N[,N...]",
        help="processes per peer (default 1): above 1 each peer is an island of that many ranks "
        "with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT...); a list "
        "gives peer i the i-th count (2,1: islands of 2 and 1 ranks)",
    )
    _restarts_flag(r)
    r.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="join this coordinator (isthmus coordinator) instead of starting one here",
    )
    r.add_argument("--token", help="the run's token (with --coordinator)")
    r.add_argument(
        "--coordinator-fingerprint",
        help="pin the remote coordinator's TLS certificate (the fingerprint it printed)",
    )
    r.add_argument("--token-file", help="read the token from this file")
    r.add_argument(
        "--name-prefix",
        default=None,
        metavar="NAME",
        help="name this machine's peers NAME-peer0, NAME-peer1... (letters, digits, _ and -). "
        "Default: peer0... with an embedded coordinator; with --coordinator, this machine's "
        "host name and a short id (the same at every launch, so a resumed peer finds its own "
        "local state; -2, -3 after it for more launchers on one machine)",
    )
    r.add_argument("--steps", type=int, default=None, help="the run's length, for the progress bar")
    r.add_argument(
        "--quiet",
        action="store_true",
        help="keep the peers' output in the run directory only (by default each line is also "
        "shown here, prefixed with its peer, as torchrun's --tee does)",
    )
    add_config_flags(r, include=RUN_FLAGS)
    # the shared help shows the built-in job's default; a script's run has no limit by default
    for action in r._actions:
        if "--timeout" in action.option_strings:
            action.help = (
                "Bound on the whole run in seconds; peers still running after it are stopped "
                "(default: none, the run lasts as long as its peers)."
            )
    r.add_argument("script", help="the training script")
    r.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    r.set_defaults(func=_cmd_run)
