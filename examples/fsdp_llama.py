"""A small Llama sharded with FSDP2 inside each peer, DiLoCo across peers: torchrun code.

The script is what torchrun runs: it initializes the process group from the environment,
shards the model with ``fully_shard`` and trains. It runs unchanged in both ways::

    torchrun --nproc-per-node 2 examples/fsdp_llama.py                 # one island, no isthmus
    isthmus run --peers 2 --nproc-per-peer 2 examples/fsdp_llama.py    # 2 islands x 2 ranks

Under ``isthmus run --nproc-per-peer N`` each peer is an *island* of N processes with its own
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``isthmus.Session`` on every rank finds the
island from the default process group, its rank 0 holds the island's one membership slot, and
every rank exchanges its own FSDP shard of the outer gradient with the same rank of the other
islands (DiLoCo every ``--sync-every`` steps). Without ``ISTHMUS_COORDINATOR`` (plain torchrun)
there is no session and DiLoCo's outer step runs on the island alone.

The model is a tiny Llama built from a ``transformers`` config (nothing is downloaded; the
built-in GPT when transformers is not installed); the data are synthetic sequences with a
pattern to learn (each token is the previous one plus a per-sequence stride), different on
every rank. Each rank prints its tokens per second, its peak memory and the bytes it sent.

With ``--checkpoint-dir DIR`` (under ``isthmus run``) every rank of every island writes its own
shards of the shared state after every ``--checkpoint-every`` rounds; ``--resume DIR`` starts a
run from the latest one, on any number of islands of any size::

    isthmus run --peers 2 --nproc-per-peer 2 examples/fsdp_llama.py --checkpoint-dir ck
    isthmus run --peers 1 --nproc-per-peer 4 examples/fsdp_llama.py --resume ck --steps 60
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import isthmus


def build_model(vocab: int, block: int, width: int, layers: int) -> tuple[torch.nn.Module, list]:
    """The model and the blocks that FSDP2 shards one by one."""
    torch.manual_seed(0)  # the same initial weights on every rank and every island
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        from isthmus.models import GPT, GPTConfig

        gpt = GPT(GPTConfig(vocab_size=vocab, block_size=block, n_embd=width, n_layer=layers))
        return gpt, list(gpt.blocks)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block,
        tie_word_embeddings=False,
    )
    llama = LlamaForCausalLM(config)
    return llama, list(llama.model.layers)


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x) if hasattr(model, "config") else model(x)
    return out.logits if hasattr(out, "logits") else out[0]


def batch(step: int, who: int, size: int, block: int, vocab: int) -> torch.Tensor:
    """Synthetic sequences: token t+1 = token t + stride (mod vocab), different per rank."""
    g = torch.Generator().manual_seed(10_000 * step + who)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(block + 1)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto",
        help="between islands: auto is NCCL for CUDA state; gloo where islands share one GPU "
        "(NCCL refuses two ranks of a group on one device)",
    )  # fmt: skip
    ap.add_argument(
        "--outer-state-device", choices=("auto", "cpu", "same"), default="auto",
        help="DiLoCo's theta and momentum in host memory (cpu) or beside the model (same); "
        "auto: cpu, or same with --backend nccl",
    )  # fmt: skip
    ap.add_argument("--checkpoint-dir", default=None, help="checkpoints (every rank its shards)")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="rounds between checkpoints")
    ap.add_argument("--resume", default=None, help="start from the latest checkpoint here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # torchrun, or isthmus run --nproc-per-peer N
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model, blocks = build_model(args.vocab, args.block_size, args.width, args.layers)
    if torch.cuda.is_available():
        model = model.cuda()
    if dist.is_initialized():
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    session = None
    if os.environ.get("ISTHMUS_COORDINATOR"):  # started by isthmus run
        config = dataclasses.replace(
            isthmus.SessionConfig.from_env(),
            backend=args.backend,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0,
            resume=args.resume,
        )
        session = isthmus.Session(config)
    strategy = isthmus.DiLoCo(
        session,
        model,
        inner,
        isthmus.DiLoCoConfig(
            sync_every=args.sync_every, outer_state_device=args.outer_state_device
        ),
    )
    if strategy.resumed_from is not None:
        print(f"rank {rank}: resumed from revision {strategy.resumed_from}", flush=True)
    tokens, t0 = 0, time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    while strategy.step_count < args.steps:
        island = session.rank if session is not None else 0
        seq = batch(strategy.step_count, island * local + rank, args.batch_size, args.block_size,
                    args.vocab).to(device)  # fmt: skip
        x, y = seq[:, :-1], seq[:, 1:]
        logits = logits_of(model, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        strategy.step()
        inner.zero_grad()
        tokens += x.numel()
        if session is not None:
            session.report(step=strategy.step_count, loss=loss.item())
    strategy.finish()
    elapsed = time.monotonic() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sent = session.stats.bytes_sent if session is not None else 0
    island_sent = sum(getattr(session, "island_bytes", [sent]))
    print(
        f"rank {rank}: step {strategy.step_count}, loss {loss.item():.3f}, "
        f"{tokens / elapsed:.0f} tokens/s, peak RSS {peak_mb:.0f} MB, sent {sent} B "
        f"(island {island_sent} B)",
        flush=True,
    )
    if session is not None:
        session.close()  # every rank together: the island's final digest
        print(f"rank {rank}: state {session.state.digest()}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
