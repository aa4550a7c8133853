"""A peer of the two-region probe test (tests/integration/test_probe_runs.py), started by the
launcher inside its namespace: it names itself by its slot from ``--names`` (so that name order
can interleave the regions), probes its links (``ISTHMUS_PROBE_LINKS``, read by
``SessionConfig.from_env``) and runs ``--rounds`` rounds of a tiny all-reduce (then more, until the ring is reordered), pausing
between them so that its heartbeats carry the probe to the coordinator before the next round
forms. It
prints what it measured as one line ``PROBED {json}``."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import isthmus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", required=True, help="a name per slot, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--max-rounds",
        type=int,
        default=40,
        help="after --rounds, go on until the coordinator reorders the ring (a new epoch: every "
        "member sees it in the same round, so all stop together), at most this many rounds",
    )
    args = ap.parse_args()
    name = args.names.split(",")[int(os.environ["ISTHMUS_PEER"])]
    cfg = isthmus.SessionConfig.from_env(name=name, collective_timeout=30.0, round_timeout=120.0)
    assert cfg.probe_links, "isthmus run's probe setting did not reach the script"
    epochs: list[int] = []

    def reduce(rnd: isthmus.Round) -> None:
        epochs.append(rnd.epoch)
        rnd.group.all_reduce(torch.ones(256))

    with isthmus.Session(cfg) as session:
        for i in range(args.max_rounds):
            session.run_round(reduce)
            if i + 1 >= args.rounds and epochs[-1] != epochs[0]:
                break
            time.sleep(0.6)
        print("PROBED " + json.dumps(session.prober.table.report()), flush=True)
        sent = session.stats.by_op.get("probe", 0)
        print(f"PROBE_SECONDS {session.prober.seconds:.3f} BYTES {sent}", flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # nothing parked in Gloo may hold the exit (docs/PROTOCOL.md)
