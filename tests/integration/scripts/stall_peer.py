"""One end of the stalled-transfer test (tests/integration/test_tcpstats.py), started inside a
network namespace. ``recv HOST PORT``: accept one connection and read it until killed.
``send HOST PORT``: connect, send without end on a thread, and watch the connection's kernel
counters (:mod:`isthmus.comm.tcpstats`) with :class:`~isthmus.comm.progress.ProgressWatch`;
print ``MOVING`` once a megabyte is acknowledged, then one line ``VERDICT {json}`` when the
watch calls the transfer stuck (or after ``--give-up`` seconds)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time

from isthmus.comm.progress import ProgressConfig, ProgressWatch
from isthmus.comm.tcpstats import conn_sample, read_inodes


def _send_forever(s: socket.socket) -> None:
    block = b"x" * (1 << 16)
    try:
        while True:
            s.sendall(block)
    except OSError:
        return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["send", "recv"])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--stall", type=float, default=2.0)
    ap.add_argument("--give-up", type=float, default=60.0)
    args = ap.parse_args()
    if args.mode == "recv":
        srv = socket.create_server((args.host, args.port))
        print("LISTENING", flush=True)
        conn, _ = srv.accept()
        while conn.recv(1 << 16):
            pass
        return
    s = socket.create_connection((args.host, args.port), timeout=10)
    s.settimeout(None)
    inode = os.fstat(s.fileno()).st_ino
    remote = f"{args.host}:{args.port}"
    threading.Thread(target=_send_forever, args=(s,), daemon=True).start()
    t0 = time.monotonic()
    watch = ProgressWatch(ProgressConfig(stall_s=args.stall, late_s=args.stall * 3), started=t0)
    moving = False
    while time.monotonic() - t0 < args.give_up:
        now = time.monotonic()
        infos = read_inodes({inode})
        watch.sample(now, [conn_sample(inode, remote, i) for i in infos.values()])
        if not moving and infos and infos[inode].bytes_acked > 1 << 20:
            moving = True
            print("MOVING", flush=True)
        v = watch.verdict()
        if moving and v.stuck:
            break
        time.sleep(0.1)
    v = watch.verdict()
    out = {"state": v.state.value, "stuck": v.stuck, "remote": v.remote, "why": v.why}
    print("VERDICT " + json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
