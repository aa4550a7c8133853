"""A user's own training script, as `isthmus run --peers N user_train.py` starts it.

Its own model (a small MLP with a BatchNorm, so buffers are shared too), its own data and loop;
the run is found through the environment (isthmus.SessionConfig.from_env). ``--crash-at STEP``
makes the first process of peer 1 die at that step (exit code 3), once: the launcher's
``--max-restarts`` starts it again as a joiner.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import isthmus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model on every peer
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = isthmus.Session(
        isthmus.SessionConfig.from_env(
            collective_timeout=15.0,
            round_timeout=90.0,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=2,
            resume=args.resume,
        )
    )
    strategy = isthmus.DiLoCo(session, model, inner, isthmus.DiLoCoConfig(sync_every=5))
    if strategy.resumed_from is not None:
        print(f"{session.name}: resumed from revision {strategy.resumed_from}", flush=True)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    with session:
        while strategy.step_count < args.steps:
            step = strategy.step_count
            if step == args.crash_at and session.name == "peer1":
                os._exit(3)  # a crash: no leave, no cleanup
            g = torch.Generator().manual_seed(1000 * step + session.rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            loss.backward()
            strategy.step()
            inner.zero_grad()
            session.report(step=strategy.step_count, loss=loss.item())
            time.sleep(args.delay)
        strategy.finish()
    print(f"{session.name}: step {strategy.step_count}, state {session.state.digest()}")


if __name__ == "__main__":
    main()
