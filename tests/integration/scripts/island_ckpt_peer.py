"""A torchrun-style script for checkpoints of islands: `isthmus run --peers M --nproc-per-peer N`
(FSDP2 on Gloo inside each island) or plain peers. DiLoCo (a round every 2 steps) on a tiny MLP,
data from an ElasticSampler split across islands and across each island's ranks, checkpoints
every round with ``--checkpoint-dir``, a resume with ``--resume``. ``--exit-at S`` SIGKILLs
every rank at step S (a run that dies whole; restarted ranks, ``peer0.1``, do not). Writes ``<out>/<peer>.<rank>.pt``: the full
gathered shared state right after the strategy was built (after a resume) and at the end, the
losses, the revisions; each rank's sampler appends its commits to ``<out>/used-<peer>.<rank>``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import isthmus
from isthmus.data import ElasticSampler


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.b = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def full_state(session: Any) -> dict[str, torch.Tensor]:
    state = session.state
    return state.gathered() if hasattr(state, "gathered") else state.snapshot()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--exit-at", type=int, default=0, help="every first rank SIGKILLs itself here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # an island (of any size) started by isthmus run
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = dist.get_world_size() if dist.is_initialized() else 1
    data = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    target = data @ torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # the untrained model's loss, before FSDP2 shards it
        fresh = torch.nn.functional.mse_loss(model(data), target).item()
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
    config = isthmus.SessionConfig.from_env(
        collective_timeout=30.0,
        round_timeout=120.0,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=1 if args.checkpoint_dir else 0,
        resume=args.resume,
    )
    session = isthmus.Session(config)
    peer = int(os.environ["ISTHMUS_PEER"])
    out = Path(args.out)
    sampler = ElasticSampler(64, 8, seed=0, used_log=out / f"used-{peer}.{rank}")
    sampler.attach(session)  # before the strategy: a resume loads the sampler's position too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = isthmus.DiLoCo(session, model, opt, isthmus.DiLoCoConfig(sync_every=2))
    start = {
        "full": full_state(session),
        "revision": session.revision,
        # the inner optimizer's steps so far (its state is made, zero, with the strategy): above
        # zero after a resume that found this rank's local state
        "inner": max((float(st.get("step", 0)) for st in opt.state.values()), default=0.0),
    }
    losses = []
    while strategy.step_count < args.steps:
        if args.exit_at and strategy.step_count == args.exit_at and "." not in config.name:
            os.kill(os.getpid(), signal.SIGKILL)
        idx = sampler.indices(session.rank, session.world, local_rank=rank, local_world=local)
        loss = torch.nn.functional.mse_loss(model(data[idx]), target[idx])
        loss.backward()
        strategy.step()
        opt.zero_grad()
        losses.append(loss.item())
    strategy.finish()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(data), target).item()
    if dist.is_initialized():
        model.reshard()  # type: ignore[operator]  # a forward without backward leaves it gathered
    record = {
        "eval": (fresh, final),
        "start": start,
        "full": full_state(session),
        "losses": losses,
        "revision": session.revision,
        "resumed_from": strategy.resumed_from,
        "netns": os.readlink("/proc/self/ns/net"),  # the lab: which namespace this rank ran in
        "name": config.name,
    }
    session.close()
    record["digest"] = session.state.digest()
    torch.save(record, out / f"{peer}.{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
