"""A torchrun-style script for island tests: `isthmus run --peers M --nproc-per-peer N` (each
peer an island of N ranks, FSDP2 on Gloo inside) or `--nproc-per-peer 1` (plain peers, no
process group). Trains a tiny MLP with a LayerNorm and a persistent buffer; the batch of rank
``r`` of peer ``p`` is batch ``p * N + r`` of every step, so M islands of N ranks see the same
data as M * N single peers (or, with ``--island-sizes``, as M single peers each drawing the
batches of one island's ranks at once). With ``--global-batch B`` (ddp) every step consumes the
samples at positions ``[t B, (t + 1) B)`` (:func:`position_loss`), split among the islands and
their ranks by isthmus. Writes ``<out>/<peer>.<rank>.pt``: the full gathered shared state
(every rank assembles it from the island's shards), its digest, the island digest and bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

import isthmus
from isthmus.comm.state import tensor_bytes


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.b = torch.nn.Linear(10, 3)
        self.register_buffer("seen", torch.zeros(3))  # a persistent buffer, replicated
        self.calls = 0  # forward passes of this process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():  # running statistics: each rank's own forward passes move them
            self.seen.mul_(0.5).add_(x[:, :3].mean(0))
        return self.b(torch.relu(self.norm(self.a(x))))


TARGET = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))


def position_loss(model: torch.nn.Module) -> Any:
    """A fixed global batch's loss function: the mean squared error over the samples at the
    given global-stream positions (sample ``p``: inputs seeded with ``p``)."""

    def loss_fn(positions: list[int]) -> torch.Tensor:
        x = torch.cat(
            [
                torch.randn(1, 6, generator=torch.Generator().manual_seed(10_000 + p))
                for p in positions
            ]
        )
        return torch.nn.functional.mse_loss(model(x), x @ TARGET)

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--strategy", choices=["diloco", "ddp", "streaming", "localsgd", "eager", "co2"],
        default="diloco",
    )  # fmt: skip
    ap.add_argument("--compression", default=None, help="the reducer's compression spec")
    ap.add_argument("--aggregator", default=None, help="the reducer's robust aggregator spec")
    ap.add_argument("--phase-seconds", type=float, default=None, help="diloco: a time budget")
    ap.add_argument(
        "--island-sizes", default=None,
        help="plain peers only: peer p draws the batches of the N_p ranks of island p of "
        "islands sized so (e.g. 2,1), so that its gradient is theirs",
    )  # fmt: skip
    ap.add_argument("--global-batch", type=int, default=0, help="ddp: a fixed global batch")
    ap.add_argument("--micro-batch", type=int, default=0, help="with --global-batch")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault", default=None, help="a fault spec fired by --fault-rank")
    ap.add_argument("--fault-rank", default="peer1.1", help="NAME.RANK (first incarnation)")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds per step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # started as an island (of any size) by isthmus run
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = Net()
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
    config = isthmus.SessionConfig.from_env(collective_timeout=30.0, round_timeout=120.0)
    mine = args.fault and f"{config.name}.{rank}" == args.fault_rank
    faults = isthmus.FaultInjector([isthmus.Fault.parse(args.fault)] if mine else [])
    session = isthmus.Session(config, faults=faults)
    refusals = {}
    if hasattr(session, "island"):  # what cannot run on islands says so, before touching anything
        for name, build in (
            ("gossip", lambda: isthmus.make_strategy("gossip", session, model, torch.optim.SGD(
                model.parameters(), lr=0.1), total_steps=4)),
            ("compressed", lambda: isthmus.DiLoCo(session, model, torch.optim.SGD(
                model.parameters(), lr=0.1), compression="topk:0.1+ef")),
        ):  # fmt: skip
            try:
                build()
            except ValueError as e:
                refusals[name] = str(e)
    comp = args.compression
    if args.strategy == "ddp":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        strategy: isthmus.Strategy = isthmus.DDP(
            session, model, opt, isthmus.DDPConfig(
                global_batch=args.global_batch, micro_batch=args.micro_batch
            ), compression=comp, aggregator=args.aggregator,
        )  # fmt: skip
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        options: dict[str, object] = {"sync_every": 2}
        if args.phase_seconds is not None:  # phases end on the clock (or after 4 steps)
            options = {"sync_every": 4, "inner_budget": "time", "phase_seconds": args.phase_seconds}
        if args.strategy == "streaming":  # two fragments of whole tensors packed by full size
            options = {"sync_every": 4, "fragments": 2, "pattern": "balanced", "overlap": 1}
        strategy = isthmus.make_strategy(
            args.strategy, session, model, opt, compression=comp, aggregator=args.aggregator,
            **options,
        )  # fmt: skip
    peer = int(os.environ["ISTHMUS_PEER"])
    w = TARGET
    # the batches of this process: its own, or those of every rank of the island it stands for
    n = int(args.island_sizes.split(",")[peer]) if args.island_sizes else 1
    base = peer * (n if args.island_sizes else local)
    batches = [base + rank] if not args.island_sizes else [base + r for r in range(n)]
    while args.global_batch and strategy.step_count < args.steps:
        strategy.step(position_loss(model))  # the samples are picked inside the round
        time.sleep(args.delay)
    while strategy.step_count < args.steps:
        seeds = [1000 * strategy.step_count + k for k in batches]
        x = torch.cat(
            [torch.randn(8, 6, generator=torch.Generator().manual_seed(k)) for k in seeds]
        )
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        strategy.step()
        opt.zero_grad()
        time.sleep(args.delay)
    strategy.finish()
    state = session.state
    full = state.gathered() if hasattr(state, "gathered") else state.snapshot()
    h = xxhash.xxh3_64()
    for n, t in full.items():
        h.update(n.encode())
        h.update(tensor_bytes(t))
    island_bytes = getattr(session, "island_bytes", [session.stats.bytes_sent])
    session.close()  # every rank together: the island's final digest
    record = {
        "full": full,
        "full_digest": h.hexdigest(),
        "digest": state.digest(),
        "bytes": session.stats.bytes_sent,
        "island_bytes": island_bytes,
        "revision": session.revision,
        "step": strategy.step_count,
        "refusals": refusals,
        "phase_steps": strategy.metrics().get("phase_steps", []),
        "loss": float(getattr(strategy, "last_loss", float("nan"))),
        "calls": model.calls,
    }
    torch.save(record, Path(args.out) / f"{peer}.{rank}.pt")
    print(f"peer {peer} rank {rank}: full state {record['full_digest']}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
