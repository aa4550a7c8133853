"""One peer training a user's own model against a test's coordinator (real process: real kills).

The models are what a user brings and the GPT does not have: a CNN with BatchNorm (floating and
integer buffers), a model whose head is tied to its embedding, frozen parameters and a
non-persistent buffer (a rotary-style table). ``tests/integration/test_model_state_runs.py`` starts
this script with ``subprocess`` and imports its models for one-process runs.

    python model_peer.py --coordinator HOST:PORT --token T --name a --strategy ddp --model cnn
        [--dtype bf16] [--fault kill@collective:step=10] [--frozen-offset 1.0] --out DIR

It writes ``DIR/<name>.pt``: the model's final ``state_dict``, the shared state's digest and
schema, the strategy's ``model_keys`` and the rounds this peer took part in.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

CLASSES = 4
VOCAB = 16


class ConvNet(nn.Module):
    """Two conv + BatchNorm blocks, a frozen output scale and a non-persistent input mean."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, CLASSES)
        self.scale = nn.Parameter(torch.full((CLASSES,), 0.5), requires_grad=False)
        self.register_buffer("pixel_mean", torch.full((3, 1, 1), 0.1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x - self.pixel_mean.to(x.dtype)).flatten(1)
        return self.head(h) * self.scale

    def frozen(self) -> torch.Tensor:
        return self.scale


class TiedNet(nn.Module):
    """Embedding tied to the output head, a BatchNorm over features, a frozen position table, a
    dropout (so checkpoints must restore the RNG) and a non-persistent rotary-style buffer."""

    def __init__(self, dim: int = 12, length: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.1, requires_grad=False)
        self.norm = nn.BatchNorm1d(dim)
        self.mix = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", freq, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        angle = torch.arange(tokens.shape[1]).float()[:, None] * self.inv_freq[None, :]
        h = h + torch.cat([angle.sin(), angle.cos()], dim=-1).to(h.dtype) * 0.01
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.drop(torch.relu(self.mix(h))))

    def frozen(self) -> torch.Tensor:
        return self.pos


MODELS = {"cnn": ConvNet, "tied": TiedNet}


def build(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """The same initial model for a seed, in ``dtype``."""
    torch.manual_seed(seed)
    return MODELS[kind]().to(dtype)


def loss_of(model: nn.Module, kind: str, step: int, rank: int) -> torch.Tensor:
    """This peer's loss on its batch for ``step`` (a function of step and rank only)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    dtype = next(model.parameters()).dtype
    if kind == "cnn":
        x = torch.randn(8, 3, 6, 6, generator=g).to(dtype)
        y = torch.randint(0, CLASSES, (8,), generator=g)
        return nn.functional.cross_entropy(model(x).float(), y)
    tokens = torch.randint(0, VOCAB, (8, 6), generator=g)
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def options(strategy: str, sync_every: int) -> dict[str, Any]:
    if strategy == "ddp":
        return {}
    if strategy == "streaming":
        # the models have no numbered layers: two fragments of about equal size, overlapped
        return {"sync_every": sync_every, "fragments": 2, "overlap": 1, "pattern": "balanced"}
    return {"sync_every": sync_every}


def main() -> None:
    import isthmus
    from isthmus.comm.faults import Fault, FaultInjector
    from isthmus.strategies import make_strategy

    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--model", default="cnn", choices=sorted(MODELS))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--fault", default="")
    ap.add_argument("--frozen-offset", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args.model, dtype)
    if args.frozen_offset:
        with torch.no_grad():
            model.frozen().add_(args.frozen_offset)  # type: ignore[operator]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = FaultInjector([Fault.parse(args.fault)] if args.fault else [])
    session = isthmus.Session(
        isthmus.SessionConfig(
            coordinator=args.coordinator,
            token=args.token,
            name=args.name,
            collective_timeout=15.0,
            connect_timeout=15.0,
            round_timeout=90.0,
        ),
        faults=faults,
    )
    strategy = make_strategy(
        args.strategy, session, model, opt, **options(args.strategy, args.sync_every)
    )
    with session:
        while strategy.step_count < args.steps:
            loss = loss_of(model, args.model, strategy.step_count, session.rank)
            if not math.isfinite(loss.item()):
                raise SystemExit(f"{args.name}: loss is not finite at step {strategy.step_count}")
            loss.backward()
            strategy.step()
            opt.zero_grad()
        strategy.finish()
        record = {
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "digest": session.state.digest(),
            "schema": [(n, str(t.dtype)) for n, t in session.state.items()],
            "model_keys": strategy.model_keys(),
            "rounds": list(session.rounds),
            "step": strategy.step_count,
        }
    torch.save(record, Path(args.out) / f"{args.name}.pt")


if __name__ == "__main__":
    main()
