"""A ``transformers.Trainer`` script trained across peers by an isthmus strategy.

Start two peers on this machine (any strategy: ``--strategy ddp``, ``diloco``, ``streaming``...)::

    isthmus run --peers 2 --max-restarts 1 examples/hf_trainer.py --steps 60 --out runs/hf-model

The model is a small Llama built from a config and the data a ``datasets.Dataset`` made here
from text (byte tokens cut into fixed blocks); nothing is downloaded. The Trainer is the usual
one; the lines marked ``# isthmus`` are all that is added: a session, an elastic reader of the
dataset (every sample of an epoch used once across the peers, across kills and joins), a
strategy around the optimizer, and :func:`isthmus.integrations.hf.prepare`. A peer that dies
and is started again (``--max-restarts``) joins the running run and continues from its shared
state. At the end one peer writes the model with ``save_pretrained`` (load it back with
``LlamaForCausalLM.from_pretrained``); ``--checkpoint-dir`` adds isthmus checkpoints. Each peer
prints its step and the digest of its shared state, equal on every peer.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import isthmus
from isthmus.integrations.hf import ElasticReader, prepare

TEXT = (
    "Peers join, fail and leave; the run goes on with whoever is there. Every round commits "
    "everywhere or nowhere, and the shared state stays the same on every peer. "
)


def build_dataset(block: int, rows: int) -> Any:
    """``rows`` blocks of ``block`` byte tokens of :data:`TEXT`, each at its own offset."""
    from datasets import Dataset

    data = (TEXT * (rows * block // len(TEXT) + 2)).encode()
    ids = [list(data[i * 7 : i * 7 + block]) for i in range(rows)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "row": list(range(rows))})


def build_model(block: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)  # the same initial weights on every peer
    return LlamaForCausalLM(config)


def model_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's state dict (names and bytes), for comparing peers bit for bit."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(
    argv: Sequence[str] | None = None,
    *,
    faults: isthmus.FaultInjector | None = None,
    callbacks: Sequence[Any] = (),
) -> None:
    """Parse ``argv`` and train; ``faults`` (the session's) and ``callbacks`` (the Trainer's,
    added after isthmus's) are for tests that kill or slow a peer."""
    from transformers import Trainer, TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps of the run")
    ap.add_argument("--strategy", default="diloco", help="isthmus strategy by name")
    ap.add_argument("--sync-every", type=int, default=10, help="H of the DiLoCo family")
    ap.add_argument("--global-batch", type=int, default=8, help="samples per step, all peers")
    ap.add_argument("--rows", type=int, default=96, help="rows of the made-up dataset")
    ap.add_argument("--block", type=int, default=32, help="tokens per row")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=None, help="save_pretrained directory (written by one peer)")
    ap.add_argument("--checkpoint-dir", default=None, help="isthmus checkpoints here")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="rounds between checkpoints")
    ap.add_argument("--used-dir", default=None, help="log the rows each committed round used")
    ap.add_argument("--trainer-dir", default="runs/hf-trainer", help="TrainingArguments.output_dir")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    dataset = build_dataset(args.block, args.rows)
    model = build_model(args.block)
    training = TrainingArguments(
        output_dir=args.trainer_dir,
        max_steps=args.steps,  # the run's length: every peer stops when the run reached it
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    session = isthmus.Session(  # isthmus
        isthmus.SessionConfig.from_env(
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every
        ),
        faults=faults,
    )
    used = Path(args.used_dir) / f"used-{session.name}.jsonl" if args.used_dir else None
    reader = ElasticReader(  # isthmus: before the strategy, so a resume restores its position
        dataset, global_batch=args.global_batch, session=session, used_log=used
    )
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    options = {"sync_every": args.sync_every} if args.strategy != "ddp" else {}
    strategy = isthmus.make_strategy(args.strategy, session, model, inner, **options)  # isthmus
    trainer = Trainer(model=model, args=training, train_dataset=dataset)
    hook = prepare(trainer, strategy, reader=reader, save_pretrained=args.out)  # isthmus
    for callback in callbacks:
        trainer.add_callback(callback)
    with session:  # isthmus
        trainer.train()
    print(
        f"{session.name}: step {strategy.step_count}, state {session.state.digest()}, "
        f"model {model_digest(model)}, joined at step {hook.joined_at or 0}"
    )
    if hook.saved is not None:
        print(f"{session.name} wrote the model to {hook.saved}")


if __name__ == "__main__":
    main()
