"""One member of the cut-link test of :class:`~isthmus.comm.group.Group`
(tests/integration/test_tcpstats.py), started inside a network namespace: ``RANK HOST0 MYIP MB``.
It connects a 2-member group the way a session does (:func:`~isthmus.comm.connect.connect_gloo`
records and labels the connections; rank 0 hosts the store at HOST0), with ``stall_s`` 3 and
``late_s`` 300, and waits on one all-reduce of MB megabytes. It prints ``MOVING True`` once
the all-reduce has run for a second (``False`` if :meth:`Group.moving` does not see it move),
then ``DONE`` or ``FAILED {"error": ..., "unreached": [...]}`` when the wait ends."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from isthmus.comm.connect import connect_gloo
from isthmus.comm.group import CollectiveError, Group
from isthmus.comm.wires import Wires

STORE_PORT = 29532


def main() -> None:
    rank, host0, myip, mb = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore(host0, STORE_PORT, 2, rank == 0, timeout=td)
    wires = Wires(f"rank {rank}")
    pg = connect_gloo(store, rank, 2, timeout_s=60.0, wires=wires, hostname=myip)
    group = Group(pg, rank, 2, timeout_s=60.0, wires=wires, stall_s=3.0, late_s=300.0)
    print("LABELS " + json.dumps(sorted(wires.snapshot().values())), flush=True)
    h = group.all_reduce(torch.ones(mb * 262144), async_op=True)
    # what this member's heartbeat would say of its transfer by then (Group.moving)
    threading.Timer(1.0, lambda: print(f"MOVING {group.moving()}", flush=True)).start()
    try:
        h.wait()
        print("DONE", flush=True)
    except CollectiveError as e:
        out = {"error": str(e)[:300], "unreached": list(e.unreached)}
        print("FAILED " + json.dumps(out), flush=True)
    time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    main()
