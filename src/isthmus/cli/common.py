"""What the command's subcommands share: reading the token, printing a run's summary."""

from __future__ import annotations

import argparse
from pathlib import Path

from isthmus.run.record import Summary

__all__ = ["print_summary", "read_token", "strategy_names"]


def strategy_names() -> list[str]:
    from isthmus.strategies import STRATEGIES

    return STRATEGIES.names()


def read_token(args: argparse.Namespace, *, required: bool = True) -> str | None:
    """The token from ``--token`` or ``--token-file``; SystemExit with the reason otherwise."""
    if args.token and args.token_file:
        raise SystemExit("give --token or --token-file, not both")
    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else args.token or ""
    except OSError as e:
        raise SystemExit(f"cannot read --token-file: {e}") from None
    if not token and required:
        raise SystemExit("a token is required: --token SECRET or --token-file PATH")
    return token or None


def print_summary(s: Summary, title: str = "isthmus demo") -> None:
    """The summary as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{title}: {s.strategy}" if s.strategy else title, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = []
    if s.strategy:
        rows += [
            ("reduction", f"compression {s.compression}, aggregator {s.aggregator}"),
            ("eval loss", f"{s.initial_eval_loss:.4f} -> {s.final_eval_loss}"),
        ]
    rows += [
        ("rounds committed / aborted", f"{s.rounds_committed} / {s.rounds_aborted}"),
        ("parity checks / failures", f"{s.parity_checks} / {s.parity_failures}"),
        ("resyncs", str(s.resyncs)),
        ("isolations", str(s.isolations)),
        ("peers at the end (bit-identical)", f"{s.peers_final} of {s.peers_started} started"),
        ("kills / joins / restarts", f"{s.kills} / {s.joins} / {s.restarts}"),
        ("stragglers flagged / link anomalies", f"{s.stragglers} / {s.link_anomalies}"),
    ]
    if s.strategy:
        rows += [
            ("bytes sent (all peers)", f"{s.bytes_sent_total:,}"),
            ("bytes DDP would have sent", f"{s.bytes_sent_ddp_equivalent:,}"),
            ("bytes per step per peer (median)", f"{s.bytes_per_step_per_peer:,}"),
            ("recovery after kill (s)", ", ".join(str(x) for x in s.recovery_s) or "-"),
        ]
    rows += [("wall time (s)", str(s.wall_s)), ("run directory", s.run_dir)]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
