"""A torchrun-style script for the whole-tensor strategies on islands (SparseLoCo, DeMo, ZO):
`isthmus run --peers M --nproc-per-peer N,...` (each peer an island, FSDP2 on Gloo inside) or
`--nproc-per-peer 1` (plain peers, no process group). Trains a tiny MLP with a LayerNorm and a
persistent buffer. Every rank of peer ``p`` draws the same batch at a step (batch ``p``), so an
island computes what one unsharded peer with that batch does: the ranks' gradients, losses and
buffers are equal and their means are exact, and a run of islands can be compared bit for bit
with a run of plain peers. Writes ``<out>/<peer>.<rank>.pt``: the full gathered shared state,
its digest, the island digest, bytes, the strategy's metrics and the model as built.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

import isthmus
from isthmus.comm.state import tensor_bytes

OPTIONS: dict[str, dict[str, object]] = {
    # chunks of 16 elements cut across the shards' bounds (a.weight's 60 elements split at 30);
    # two fragments, one step of overlap: the message's round in flight behind an inner step
    "sparseloco": {
        "sync_every": 4,
        "fragments": 2,
        "pattern": "balanced",
        "overlap": 1,
        "chunk": 16,
        "top_k": 4,
        "bits": 2,
        "outer_lr": 1.0,
    },
    # a.weight (10 x 6) is one 10 x 6 tile, which its shards' rows (5 + 5) cut in two
    "decoupled_momentum": {"chunk": 64, "top_k": 8},
    "zo": {"lr": 1e-2, "eps": 1e-2, "perturbations": 2},
}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.b = torch.nn.Linear(10, 3)
        self.register_buffer("seen", torch.zeros(3))  # a persistent buffer, replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # running statistics: each rank's own forward passes move them
            self.seen.mul_(0.5).add_(x[:, :3].mean(0))
        return self.b(torch.relu(self.norm(self.a(x))))


def train(
    strategy: isthmus.Strategy,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    name: str,
    peer: int,
    steps: int,
    delay: float = 0.0,
) -> None:
    """The training loop of peer ``peer`` (every rank of it draws the same batch), finished."""
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    while strategy.step_count < steps:
        gen = torch.Generator().manual_seed(1000 * strategy.step_count + peer)
        x = torch.randn(8, 6, generator=gen)
        if name == "zo":
            strategy.step(lambda x=x: torch.nn.functional.mse_loss(model(x), x @ w))
        else:
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            loss.backward()
            strategy.step()
            opt.zero_grad()
        time.sleep(delay)
    strategy.finish()


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer (DeMo reads its lr and weight decay; ZO none of it)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=sorted(OPTIONS), required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault", default=None, help="a fault spec fired by --fault-rank")
    ap.add_argument("--fault-rank", default="peer1.1", help="NAME.RANK (first incarnation)")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--checkpoint-dir", default=None, help="a checkpoint every round")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # started as an island (of any size) by isthmus run
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = Net()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
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
    mine = args.fault and f"{config.name}.{rank}" == args.fault_rank
    faults = isthmus.FaultInjector([isthmus.Fault.parse(args.fault)] if mine else [])
    session = isthmus.Session(config, faults=faults)
    opt = optimizer(model)
    strategy = isthmus.make_strategy(args.strategy, session, model, opt, **OPTIONS[args.strategy])
    peer = int(os.environ["ISTHMUS_PEER"])
    train(strategy, model, opt, args.strategy, peer, args.steps, args.delay)
    state = session.state
    full = state.gathered() if hasattr(state, "gathered") else state.snapshot()
    h = xxhash.xxh3_64()
    for n, t in full.items():
        h.update(n.encode())
        h.update(tensor_bytes(t))
    metrics = strategy.metrics()
    island_bytes = getattr(session, "island_bytes", [session.stats.bytes_sent])
    session.close()  # every rank together: the island's final digest
    record = {
        "full": full,
        "init": init,
        "full_digest": h.hexdigest(),
        "digest": state.digest(),
        "bytes": session.stats.bytes_sent,
        "island_bytes": island_bytes,
        "revision": session.revision,
        "step": strategy.step_count,
        "resumed_from": strategy.resumed_from,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))},
    }
    torch.save(record, Path(args.out) / f"{peer}.{rank}.pt")
    print(f"peer {peer} rank {rank}: full state {record['full_digest']}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
