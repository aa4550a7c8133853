"""A peer's memory, threads and descriptors over tens of thousands of rounds (issue 16).

One DDP peer of a small MLP with an embedded coordinator in the same process (so that both
sides' bounded histories are in the figure), as many rounds as asked, sampling the resident set,
open descriptors and threads every ``--every`` rounds after a garbage collection. What a round
leaves behind is bounded by two histories: the session's last ``ROUND_HISTORY`` round records
and the coordinator's last 10,000 events; past them the curve is flat.

    python benchmarks/peer_memory.py --rounds 30000 --every 2500
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import isthmus
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30_000)
    ap.add_argument("--every", type=int, default=2_500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    coord = Coordinator(
        CoordinatorConfig(token="t", port=0, membership=MembershipConfig(heartbeat_timeout=30.0))
    ).start()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = isthmus.Session(isthmus.SessionConfig(coordinator=coord.address, token="t"))
    strategy = isthmus.DDP(session, model, opt)
    print("round  seconds  rss_kB  fds  threads")
    t0 = time.time()
    with session:
        for i in range(args.rounds + 1):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            strategy.step()
            opt.zero_grad()
            if i % args.every == 0:
                gc.collect()
                fds = len(os.listdir("/proc/self/fd"))
                threads = len(os.listdir("/proc/self/task"))
                print(f"{i:6d} {time.time() - t0:8.1f} {rss_kb():7d} {fds:4d} {threads:8d}")
    coord.stop()


if __name__ == "__main__":
    main()
