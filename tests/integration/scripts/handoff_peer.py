"""One member of the handed-over-data test (tests/integration/test_tcpstats.py), started inside a
network namespace: ``RANK HOST0 MYIP EPOCH``. It connects a 2-member group the way a session
does (:func:`~isthmus.comm.connect.connect_gloo`; rank 0 hosts the store at HOST0), with
``stall_s`` 2 and ``late_s`` 300, as epoch EPOCH.

Rank 0 receives: it posts a receive of 8 KiB from rank 1 (Gloo tells rank 1 it is ready),
prints ``POSTED``, and then, every 0.25 s, ``INFO {...}``: what its heartbeat would say inside
round 0 (:func:`~isthmus.comm.unacked.transfer_info`), until the receive ends (``DONE``, or
``FAILED`` with the error). Rank 1 sends: on a line ``SEND`` on its standard input it sends
the 8 KiB, prints ``SENT`` once the send completed (the data is in its kernel), and then, every
0.25 s, ``INFO {...}``: what its heartbeat would say once it reported the round (``null``: no
silent connection)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from isthmus.comm.connect import connect_gloo
from isthmus.comm.group import CollectiveError, Group, transfer_info
from isthmus.comm.wires import Wires

STORE_PORT = 29533


def main() -> None:
    rank, host0, myip, epoch = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore(host0, STORE_PORT, 2, rank == 0, timeout=td)
    wires = Wires(f"rank {rank}")
    pg = connect_gloo(store, rank, 2, timeout_s=60.0, wires=wires, hostname=myip)
    group = Group(pg, rank, 2, timeout_s=60.0, wires=wires, stall_s=2.0, late_s=300.0, epoch=epoch)
    print("LABELS " + json.dumps(sorted(wires.snapshot().values())), flush=True)
    t = torch.zeros(2048)
    if rank == 0:
        h = group.recv(t, 1, async_op=True)
        print("POSTED", flush=True)
        plan = SimpleNamespace(epoch=epoch, round=0)
        while not h.done():
            print("INFO " + json.dumps(transfer_info(plan, group)), flush=True)
            time.sleep(0.25)
        try:
            h.wait()
            print("DONE", flush=True)
        except CollectiveError as e:
            print("FAILED " + json.dumps(str(e)[:300]), flush=True)
    else:
        if sys.stdin.readline().strip() != "SEND":
            os._exit(1)
        group.send(torch.ones(2048), 0)
        print("SENT", flush=True)
        for _ in range(240):
            print("INFO " + json.dumps(transfer_info(None, group)), flush=True)
            time.sleep(0.25)
    time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    main()
