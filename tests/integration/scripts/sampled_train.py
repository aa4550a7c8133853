"""A user's script reading a token file through the elastic sampler, for `isthmus run`.

Each peer logs the dataset indices every committed round used (``--used-dir``); ``--fault SPEC``
makes the first process of ``--fault-peer`` fire that fault on itself (e.g. a SIGKILL in the middle
of a collective, which aborts the round for everyone), and the launcher's ``--max-restarts``
brings a new process in as a joiner.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import isthmus
from isthmus.data import ElasticSampler, TokenDataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=12, help="global batch, all peers")
    ap.add_argument("--used-dir", required=True)
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "diloco"])
    ap.add_argument("--fault", default=None)
    ap.add_argument("--fault-peer", default="peer1")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument(
        "--short-delay",
        type=float,
        default=None,
        help="sleep this long (instead of --delay) after a step whose round had fewer members "
        "than the first: a restarted peer then joins before the end however loaded the box is",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = TokenDataset(args.data, 16, split="train")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = isthmus.SessionConfig.from_env(collective_timeout=20.0, round_timeout=120.0)
    faults = (
        [isthmus.Fault.parse(args.fault)] if args.fault and config.name == args.fault_peer else []
    )
    session = isthmus.Session(config, faults=isthmus.FaultInjector(faults))
    used = Path(args.used_dir) / f"used-{session.name}.jsonl"
    sampler = ElasticSampler(len(data), args.batch_size, seed=3, used_log=used)
    sampler.attach(session)
    if args.strategy == "ddp":
        strategy: isthmus.Strategy = isthmus.DDP(session, model, opt)
    else:
        strategy = isthmus.DiLoCo(session, model, opt, isthmus.DiLoCoConfig(sync_every=4))
    with session:
        full = 0
        while strategy.step_count < args.steps:
            x, y = data.batch(sampler.indices(session.rank, session.world))
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            strategy.step()
            opt.zero_grad()
            session.report(step=strategy.step_count, loss=loss.item())
            full = max(full, session.world)
            short = args.short_delay is not None and session.world < full
            time.sleep(args.short_delay if short else args.delay)
        strategy.finish()
    print(f"{session.name}: step {strategy.step_count}, state {session.state.digest()}")


if __name__ == "__main__":
    main()
