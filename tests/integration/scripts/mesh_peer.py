"""A peer of the mesh test (tests/integration/test_mesh.py), started inside its lab namespace.

It joins the run with ``SessionConfig(mesh=True)``, prints one line ``MESH {json}`` (its overlay
address, interface, public key and WireGuard port), then runs ``--rounds`` rounds that gather a
tensor whose bytes repeat ``--pattern`` (hex) from every peer, prints ``DONE``, and then records
every UDP datagram that reaches its overlay address on port 7777 in ``--out`` (one line each)
until the file ``--stop`` exists."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch

import isthmus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--hostname", required=True)
    ap.add_argument("--pattern", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--relay", action="store_true", help="offer to relay between NATed peers")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop", required=True)
    args = ap.parse_args()
    cfg = isthmus.SessionConfig(
        coordinator=args.coordinator,
        token=args.token,
        name=args.name,
        hostname=args.hostname,
        mesh=True,
        mesh_relay=args.relay,
        collective_timeout=30.0,
        round_timeout=120.0,
    )
    session = isthmus.Session(cfg)
    mesh = session.mesh
    assert mesh is not None and mesh.iface is not None
    info = {
        "address": mesh.address,
        "ifname": mesh.iface.name,
        "key": mesh.public_key,
        "port": mesh.iface.listen_port(),
        "nat": mesh.nat,
        "gloo": session.config.hostname,
    }
    print("MESH " + json.dumps(info), flush=True)
    raw = bytes.fromhex(args.pattern) * (64 * 1024 // len(bytes.fromhex(args.pattern)))
    canary = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    for _ in range(args.rounds):
        out = session.run_round(lambda rnd: rnd.group.all_gather_flat(canary))
        assert bytes(out[: len(raw)].numpy().tobytes()) == raw
    print("DONE", flush=True)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((mesh.address, 7777))
        s.settimeout(0.2)
        deadline = time.monotonic() + 180
        while not Path(args.stop).exists() and time.monotonic() < deadline:
            try:
                data, _ = s.recvfrom(2048)
            except TimeoutError:
                continue
            with open(args.out, "a") as f:
                f.write(data.decode(errors="replace") + "\n")
    session.close(leave=False)


if __name__ == "__main__":
    main()
    os._exit(0)  # nothing parked in Gloo may hold the exit (docs/PROTOCOL.md)
