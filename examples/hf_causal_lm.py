"""A Hugging Face causal LM trained with DiLoCo across peers on a token file.

Prepare tokens once, then start the peers with the launcher (here two on this machine)::

    isthmus data prepare notes.txt --out data/
    isthmus run --peers 2 examples/hf_causal_lm.py --data data/ --steps 200 --out model/

The model is a small Llama built from a config (nothing is downloaded); every peer builds the
same initial weights from the same seed. Its whole state is shared: parameters (the tied input
and output embedding once), persistent buffers; the rotary tables (non-persistent buffers) stay
local, as Hugging Face recomputes them. The elastic sampler splits each global batch among the
peers that are there, and every sample of an epoch is used once by a committed round, across
kills and joins. At the end the first peer writes the model with ``save_pretrained``; load it
back with ``LlamaForCausalLM.from_pretrained("model/")``.

Across machines, run ``isthmus coordinator --host 0.0.0.0 --token-file token.txt`` somewhere and
``isthmus run --coordinator HOST:29400 --token-file token.txt --peers N examples/hf_causal_lm.py
...`` on every machine. Prints, per peer, the tokens it trained on per second.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import isthmus
from isthmus.data import ElasticSampler, TokenDataset


def build_model(vocab_size: int, block_size: int, size: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    width, layers = {"tiny": (64, 2), "small": (256, 4)}[size]
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block_size,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)  # the same initial weights on every peer
    return LlamaForCausalLM(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="token directory from `isthmus data prepare`")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    ap.add_argument(
        "--batch-size", type=int, default=16, help="global batch (all peers), sequences"
    )
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--out", default=None, help="save_pretrained directory")
    ap.add_argument("--saver", default="peer0", help="the peer that writes --out (default peer0)")
    ap.add_argument("--used-log", default=None, help="append the sample indices each round used")
    args = ap.parse_args()
    torch.set_num_threads(1)

    data = TokenDataset(args.data, args.block_size, split="train")
    model = build_model(data.vocab_size or 256, args.block_size, args.size)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    session = isthmus.Session(isthmus.SessionConfig.from_env())
    sampler = ElasticSampler(len(data), args.batch_size, seed=0, used_log=args.used_log)
    sampler.attach(session)  # its position is shared state: joiners and checkpoints get it
    strategy = isthmus.DiLoCo(
        session, model, inner, isthmus.DiLoCoConfig(sync_every=args.sync_every)
    )
    tokens, t0 = 0, time.monotonic()
    with session:
        while strategy.step_count < args.steps:
            x, y = data.batch(sampler.indices(session.rank, session.world))
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            strategy.step()
            inner.zero_grad()
            tokens += x.numel()
            session.report(step=strategy.step_count, loss=loss.item())
        strategy.finish()
        elapsed = time.monotonic() - t0
        if args.out and session.name == args.saver:
            model.save_pretrained(args.out)
    print(
        f"{session.name}: step {strategy.step_count}, loss {loss.item():.3f}, "
        f"{tokens / elapsed:.0f} tokens/s, state {session.state.digest()}"
    )


if __name__ == "__main__":
    main()
