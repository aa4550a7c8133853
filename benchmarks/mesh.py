"""What the WireGuard mesh costs: bus bandwidth of an all-reduce with and without it (and
through the relay), and wireguard-go's CPU per Gbit/s, in lab namespaces (root).

    python benchmarks/mesh.py [--peers 4] [--rates 100,1000] [--size-mb 16] [--reps 5]
                              [--stream-s 6] [--out DIR]

For each rate, three networks in turn, each a fresh lab network of ``--peers`` peers on links
shaped to that rate and a coordinator in its namespace: ``plain`` (Gloo on the lab addresses),
``mesh`` (``SessionConfig(mesh=True)``: Gloo on the overlay, inside WireGuard) and ``relay``
(the mesh with the last two peers behind NAT routers, so the ring's hop between them goes
through peer 0, the relay). Every peer times ``Group.all_reduce`` of ``--size-mb`` of fp32
inside a round, after a small all-reduce that lines the peers up; per repetition the slowest
peer counts, and the median over ``--reps`` is reported as bus bandwidth,
2(n-1)/n x 8 x bytes / time. Then ``stream``: two unshaped peers in the mesh, one TCP stream from
one to the other's overlay address for ``--stream-s`` seconds; the throughput and the CPU time
both wireguard-go processes used (``/proc/<pid>/stat``), as cores per Gbit/s.

Prints a markdown table and writes ``results.json``.
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

ADMIN = "mesh-bench-admin-token"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(args: argparse.Namespace) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(args.stream_s + 90, exit=True)  # a hang says where

    import isthmus

    cfg = isthmus.SessionConfig(
        coordinator=args.coordinator,
        token=ADMIN,
        name=f"peer{args.index}",
        hostname=args.hostname,
        mesh=args.mesh,
        mesh_relay=args.mesh and args.index == 0,
        collective_timeout=120.0,
        round_timeout=300.0,
    )
    session = isthmus.Session(cfg)
    wg_pid = None
    if session.mesh is not None and session.mesh.iface is not None:
        proc = session.mesh.iface.process
        wg_pid = proc.pid if proc is not None else None
    out: dict[str, Any] = {"index": args.index, "wg_pid": wg_pid}
    if args.stream_s > 0:
        assert session.mesh is not None
        session.run_round(lambda rnd: rnd.group.all_reduce(torch.ones(4)))  # both are up
        out.update(_stream(session, args))
    else:
        x = torch.ones(int(args.size_mb * 2**20 / 4))
        small = torch.ones(4)
        times = []
        for _ in range(args.reps + 1):  # the first is a warm-up

            def timed(rnd: Any) -> float:
                rnd.group.all_reduce(small)
                t0 = time.perf_counter()
                rnd.group.all_reduce(x)
                return time.perf_counter() - t0

            times.append(session.run_round(timed))
        out["times"] = times[1:]
    print("RESULT " + json.dumps(out), flush=True)
    session.close()
    os._exit(0)


def _stream(session: Any, args: argparse.Namespace) -> dict[str, Any]:
    me = session.mesh
    members = sorted(m.address for m in me.members)
    other = next(a for a in members if a != me.address)
    proc = me.iface.process
    cpu0 = _cpu_s(proc.pid)
    if args.index == 1:  # receiver
        srv = socket.create_server((me.address, 5201))
        srv.settimeout(60)
        conn, _ = srv.accept()
        got, t0 = 0, time.perf_counter()
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
        dt = time.perf_counter() - t0
        conn.close()
        return {"bytes": got, "seconds": dt, "wg_cpu_s": _cpu_s(proc.pid) - cpu0}
    time.sleep(1.0)
    conn = socket.create_connection((other, 5201), timeout=120)
    buf = b"\0" * (1 << 20)
    end = time.perf_counter() + args.stream_s
    while time.perf_counter() < end:
        conn.sendall(buf)
    # what the kernel still holds must cross before this peer's WireGuard goes: wait for the
    # receiver to have read it all and closed
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    conn.close()
    return {"wg_cpu_s": _cpu_s(proc.pid) - cpu0}


def run_network(*, peers: int, rate: float | None, mode: str, size_mb: float, reps: int,
                stream_s: float, out_dir: Path) -> list[dict[str, Any]]:  # fmt: skip
    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig
    from isthmus.lab.netns import inside_namespace
    from isthmus.lab.wan import WanNetwork

    nat = [peers - 2, peers - 1] if mode == "relay" else []
    with WanNetwork(peers, rates_mbit=rate, nat=nat, prefix="imb") as net:
        with inside_namespace(net.coordinator.netns):
            coord = Coordinator(
                CoordinatorConfig(
                    token=ADMIN,
                    host=net.coordinator.ip,
                    port=0,
                    membership=MembershipConfig(start_peers=peers, start_timeout=120.0),
                )
            ).start()
        try:
            procs = []
            for i in range(peers):
                argv = [sys.executable, __file__, "--worker", "--index", str(i),
                        "--coordinator", coord.address, "--hostname", net.peers[i].ip,
                        "--size-mb", str(size_mb), "--reps", str(reps),
                        "--stream-s", str(stream_s)]  # fmt: skip
                if mode != "plain":
                    argv.append("--mesh")
                log = open(out_dir / f"{mode}-{rate}-peer{i}.log", "w")  # noqa: SIM115
                procs.append((net.popen(i, argv, stdout=log, stderr=subprocess.STDOUT), log))
            results = []
            for p, log in procs:
                p.wait(600)
                log.close()
                text = Path(log.name).read_text()
                line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    raise RuntimeError(f"{log.name} has no result:\n{text[-2000:]}")
                results.append(json.loads(line[7:]))
            return results
        finally:
            coord.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--hostname", default="")
    ap.add_argument("--mesh", action="store_true")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rates", default="100,1000", help="Mbit/s, comma-separated")
    ap.add_argument("--size-mb", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stream-s", type=float, default=6.0)
    ap.add_argument("--modes", default="plain,mesh,relay")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="mesh-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    n, rows = args.peers, []
    for rate in [float(r) for r in args.rates.split(",") if r]:
        for mode in args.modes.split(","):
            res = run_network(peers=n, rate=rate, mode=mode, size_mb=args.size_mb,
                              reps=args.reps, stream_s=0, out_dir=out_dir)  # fmt: skip
            per_rep = [max(r["times"][k] for r in res) for k in range(args.reps)]
            t = statistics.median(per_rep)
            busbw = 2 * (n - 1) / n * 8 * args.size_mb * 2**20 / t / 1e6
            rows.append({"rate_mbit": rate, "mode": mode, "time_s": round(t, 4),
                         "busbw_mbit": round(busbw, 1), "utilization": round(busbw / rate, 3)})  # fmt: skip
            print(rows[-1], flush=True)
    stream = None
    if args.stream_s > 0:
        res = run_network(peers=2, rate=None, mode="mesh", size_mb=0, reps=0,
                          stream_s=args.stream_s, out_dir=out_dir)  # fmt: skip
        recv = next(r for r in res if r["index"] == 1)
        gbit = recv["bytes"] * 8 / recv["seconds"] / 1e9
        cores = sum(r["wg_cpu_s"] for r in res) / recv["seconds"]
        stream = {"gbit_s": round(gbit, 3), "wg_cores": round(cores, 3),
                  "wg_cores_per_gbit_s": round(cores / gbit, 3)}  # fmt: skip
        print(stream, flush=True)
    result = {"date": datetime.date.today().isoformat(), "peers": n, "size_mb": args.size_mb,
              "reps": args.reps, "allreduce": rows, "stream": stream}  # fmt: skip
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    print("\n| link | plain Gloo | mesh | mesh, relayed hop |\n|---|---|---|---|")
    for rate in sorted({r["rate_mbit"] for r in rows}):
        cells = {r["mode"]: f"{r['busbw_mbit']} Mbit/s ({r['utilization']:.0%})" for r in rows
                 if r["rate_mbit"] == rate}  # fmt: skip
        print(f"| {rate:g} Mbit/s | {cells.get('plain', '-')} | {cells.get('mesh', '-')} | "
              f"{cells.get('relay', '-')} |")  # fmt: skip
    if stream:
        print(
            f"\nwireguard-go: {stream['gbit_s']} Gbit/s on one TCP stream, "
            f"{stream['wg_cores']} cores ({stream['wg_cores_per_gbit_s']} cores per Gbit/s)"
        )
    print(f"results: {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()
