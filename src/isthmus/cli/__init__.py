"""The ``isthmus`` command line, one module per group of subcommands.

* :mod:`.runs`: ``coordinator``, ``demo`` and ``run``;
* :mod:`.lab`: ``lab run|soak|report|compare|sim|cleanup`` and ``bench allreduce|link``;
* :mod:`.checkpoint_data`: ``checkpoint inspect|export`` and ``data prepare``;
* :mod:`.security`: ``token new|revoke`` and the coordinator's TLS and rendezvous flags;
* :mod:`.common`: what they share (reading the token, printing a run's summary).

Run settings' flags are generated from :class:`isthmus.run.config.RunConfig`
(:mod:`isthmus.run.flags`), not written here. cli is the top of the layers: it may import every
package, and no other package imports it (docs/ARCHITECTURE.md, "Layers"; tools/structure.py
checks it).
"""

from __future__ import annotations

import argparse
import logging
import sys

from isthmus.cli import checkpoint_data, lab, runs, security

__all__ = ["build_parser", "forget_handled_interrupt", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="isthmus",
        description="Train one PyTorch model across machines that fail, come and go, and talk over thin links.",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    runs.add_parsers(sub)
    lab.add_parsers(sub)
    checkpoint_data.add_parsers(sub)
    security.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    head = argv[:cut]
    if "lab" in head and head[head.index("lab") + 1 : head.index("lab") + 2] == ["run"]:
        # `isthmus lab run S --script F -- ARGS`: argparse cannot split at `--` after a
        # positional, so the script's arguments are cut off before parsing
        args = build_parser().parse_args(head)
        args.script_args = argv[cut + 1 :]
    else:
        args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        code = int(args.func(args))
    except KeyboardInterrupt:
        # the commands tear down what they started (peers, namespaces) before this arrives
        print(f"isthmus {args.command}: interrupted", file=sys.stderr)
        code = 130
    except OSError as e:
        # a port in use, a run directory we may not write, a missing file: say which, no trace
        print(f"isthmus {args.command}: {e}", file=sys.stderr)
        code = 2
    forget_handled_interrupt()
    return code


def forget_handled_interrupt() -> None:
    """Let a Ctrl-C that was handled end the process with its exit code, not by SIGINT.

    CPython (3.11, 3.12) marks the interpreter as interrupted when a ``KeyboardInterrupt`` passes
    out of code compiled from a string (``exec``/``eval``: a dataclass or namedtuple defined by a
    module imported lazily, mid-run), even when a caller catches it; the process then kills itself
    with SIGINT at exit and its status is -2 instead of the 130 we return. Running a string resets
    that mark, and nothing is unhandled once ``main`` returns.
    """
    exec("pass")  # a constant string: its only effect is the reset


if __name__ == "__main__":
    sys.exit(main())
