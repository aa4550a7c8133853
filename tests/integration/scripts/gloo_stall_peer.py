"""One rank of the stalled-collective test (tests/integration/test_tcpstats.py), started inside a
network namespace: ``RANK HOST0 MYIP MB``. It builds a 2-rank Gloo group (rank 0 hosts the
store at HOST0), watches the group's connections with :class:`~isthmus.comm.tcpstats.TcpWatch`
and runs one all-reduce of MB megabytes. It prints ``MOVING`` once bytes move, every change of
the watch's verdict as ``VERDICT {json}``, and ``DONE`` or ``FAILED`` when Gloo ends the
collective (its own timeout is 120 s, so a stall is the watch's to see first)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from isthmus.comm.group import build_process_group
from isthmus.comm.progress import ProgressConfig
from isthmus.comm.tcpstats import TcpWatch
from isthmus.comm.wires import inet_sockets

STORE_PORT = 29531


def main() -> None:
    rank, host0, myip, mb = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore(host0, STORE_PORT, 2, rank == 0, timeout=td)
    pg = build_process_group(store, rank, 2, timeout_s=120.0, hostname=myip)
    # the group's connections: every connected socket that is not the store's
    conns = {
        s.inode: f"{s.remote[0]}:{s.remote[1]}"
        for s in inet_sockets()
        if s.remote is not None and STORE_PORT not in (s.local[1], s.remote[1])
    }
    x = torch.ones(mb * 262144)
    with TcpWatch(lambda: conns, ProgressConfig(stall_s=3.0, late_s=60.0), period_s=0.2) as w:
        issued = time.monotonic()
        work = pg.allreduce([x])
        last = None
        moving = False
        while not work.is_completed():
            v = w.verdict(since=issued)
            if not moving and v.state.value == "progressing" and time.monotonic() - issued > 1:
                moving = True
                print("MOVING", flush=True)
            if (v.state, v.stuck) != last:
                last = (v.state, v.stuck)
                out = {"state": v.state.value, "stuck": v.stuck, "remote": v.remote}
                print("VERDICT " + json.dumps(out), flush=True)
            time.sleep(0.1)
        try:
            work.wait()
            print("DONE", flush=True)
        except RuntimeError as e:
            print(f"FAILED {str(e)[:200]}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
