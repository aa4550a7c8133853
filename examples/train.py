"""A peer's training script: your own model and loop, made fault-tolerant and low-communication.

Run the coordinator once (anywhere the peers can reach), with TLS; it prints its certificate's
fingerprint:

    isthmus coordinator --host 0.0.0.0 --port 29400 --token-file admin.txt --tls self-signed

give each peer machine a join token of its own (``isthmus token new --name NAME
--token-file admin.txt > token.txt``), then run this script there:

    python examples/train.py --coordinator coord.example.org:29400 --token-file token.txt \
        --coordinator-fingerprint AB:CD:...

Peers may start late, die, or be restarted at any time; the run goes on with whoever is there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import isthmus
from isthmus.data import Corpus, evaluate
from isthmus.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--coordinator-fingerprint", help="pin the coordinator's TLS certificate")
    ap.add_argument("--interface", default=None, help="network interface for Gloo, e.g. eth0")
    ap.add_argument(
        "--mesh", action="store_true", help="tensors inside the run's WireGuard mesh (root)"
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=["default", "tiny"], default="default")
    args = ap.parse_args()

    torch.set_num_threads(1)
    corpus = Corpus.from_stdlib(max_bytes=1_000_000)
    config = GPTConfig.tiny() if args.model == "tiny" else GPTConfig.default()
    model = GPT(config, seed=0)  # every peer builds the same initial model
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    session = isthmus.Session(
        isthmus.SessionConfig(
            coordinator=args.coordinator,
            token=Path(args.token_file).read_text().strip(),
            coordinator_fingerprint=args.coordinator_fingerprint,
            interface=args.interface,
            mesh=args.mesh,
        )
    )
    # DiLoCo: 20 local AdamW steps, then one averaged outer step (Nesterov SGD, lr 0.7).
    strategy = isthmus.DiLoCo(session, model, inner, isthmus.DiLoCoConfig(sync_every=20))
    strategy.run_steps = args.steps  # the last round begins no other
    with session:
        strategy.join()  # the catch-up round now, not as a first step whose work is dropped
        while strategy.step_count < args.steps:
            x, y = corpus.batch(
                step=strategy.step_count,
                rank=session.rank,
                world=session.world,
                batch_size=16,
                block_size=config.block_size,
            )
            _, loss = model(x, y)
            loss.backward()
            strategy.step()  # instead of inner.step()
            inner.zero_grad()
        strategy.finish()  # end on the shared global model
        print(
            f"{session.name}: step {strategy.step_count}, eval loss {evaluate(model, corpus):.3f}, "
            f"state {session.state.digest()}"
        )


if __name__ == "__main__":
    main()
