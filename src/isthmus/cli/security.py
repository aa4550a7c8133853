"""``isthmus token new|revoke`` and the coordinator's TLS, rendezvous and revocation flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from isthmus.cli.common import read_token

__all__ = ["add_coordinator_flags", "add_parsers", "coordinator_options"]


def add_coordinator_flags(c: argparse.ArgumentParser) -> None:
    """``isthmus coordinator``'s security flags."""
    c.add_argument("--tls-cert", help="serve TLS with this certificate (PEM; with --tls-key)")
    c.add_argument("--tls-key", help="the certificate's private key (PEM)")
    c.add_argument(
        "--tls",
        choices=["self-signed"],
        help="serve TLS with a certificate made at start (kept in --tls-dir); its SHA-256 "
        "fingerprint is printed: peers pin it (--coordinator-fingerprint)",
    )
    c.add_argument(
        "--tls-dir",
        help="with --tls self-signed: reuse the certificate in this directory, or make one "
        "there (a restarted coordinator keeps its fingerprint); default: a new temporary one",
    )
    c.add_argument(
        "--rendezvous",
        choices=["coordinator", "tcpstore"],
        default="coordinator",
        help="where process groups meet: the coordinator's authenticated store (default), or "
        "torch's TCPStore on --store-port, which anyone reaching that port can read and write",
    )
    c.add_argument(
        "--revoke",
        action="append",
        default=[],
        metavar="NAME",
        help="refuse this join token's name from the start (repeat; keeps revocations across "
        "a restart)",
    )


def coordinator_options(args: argparse.Namespace) -> dict[str, Any]:
    """CoordinatorConfig keywords from the flags. SystemExit naming the flag when they clash or
    a file cannot be used."""
    from isthmus.coordinator.tls import TLSFiles, self_signed

    tls = None
    if args.tls and (args.tls_cert or args.tls_key):
        raise SystemExit("give --tls self-signed or --tls-cert/--tls-key, not both")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    try:
        if args.tls_cert:
            tls = TLSFiles.load(args.tls_cert, args.tls_key)
        elif args.tls:
            d = Path(args.tls_dir) if args.tls_dir else None
            if d is not None and (d / "coordinator.crt").is_file():
                tls = TLSFiles.load(str(d / "coordinator.crt"), str(d / "coordinator.key"))
            else:
                hosts = ["localhost", "127.0.0.1"] + ([args.host] if args.host else [])
                tls = self_signed(args.tls_dir, hosts=sorted(set(hosts) - {"0.0.0.0", "::"}))
    except ValueError as e:
        raise SystemExit(f"isthmus coordinator: {e}") from None
    return {"tls": tls, "rendezvous": args.rendezvous, "revoked": tuple(args.revoke)}


def _cmd_token_new(args: argparse.Namespace) -> int:
    from isthmus.coordinator.auth import join_token

    admin = read_token(args)
    assert admin is not None
    try:
        print(join_token(admin, args.name))
    except ValueError as e:
        print(f"isthmus token new: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    from isthmus.coordinator.client import CoordinatorClient, CoordinatorError

    admin = read_token(args)
    assert admin is not None
    try:
        client = CoordinatorClient(
            args.coordinator,
            admin,
            connect_timeout=args.connect_timeout,
            fingerprint=args.coordinator_fingerprint,
            cafile=args.coordinator_ca,
        )
    except ValueError as e:
        print(f"isthmus token revoke: {e}", file=sys.stderr)
        return 2
    try:
        reply = client.post("/v1/admin/revoke", {"name": args.name})
    except CoordinatorError as e:
        print(f"isthmus token revoke: {e}", file=sys.stderr)
        return 2
    finally:
        client.close()
    evicted = reply.get("evicted") or []
    print(f"revoked {args.name}; evicted peers: {', '.join(map(str, evicted)) or 'none'}")
    return 0


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("token", help="join tokens: make one for a peer, revoke one")
    tsub = t.add_subparsers(dest="token_command", required=True)
    n = tsub.add_parser(
        "new",
        help="print the join token of NAME, derived from the admin token (offline: the "
        "coordinator recognizes it without being told)",
    )
    n.add_argument("--name", required=True, help="the peer's identity (letters, digits, _ . -)")
    n.add_argument("--token", help="the admin token (the coordinator's --token)")
    n.add_argument("--token-file", help="read the admin token from this file instead")
    n.set_defaults(func=_cmd_token_new)
    r = tsub.add_parser(
        "revoke", help="refuse NAME's join token from now on and evict its peers (live run)"
    )
    r.add_argument("name", help="the join token's name")
    r.add_argument("--coordinator", required=True, help="the coordinator's host:port or URL")
    r.add_argument("--token", help="the admin token")
    r.add_argument("--token-file", help="read the admin token from this file instead")
    r.add_argument("--coordinator-fingerprint", help="pin the coordinator's TLS certificate")
    r.add_argument("--coordinator-ca", help="verify the coordinator's certificate with this CA")
    r.add_argument("--connect-timeout", type=float, default=10.0, help="seconds (default 10)")
    r.set_defaults(func=_cmd_token_revoke)
