"""A pre-trained starting point for fine-tuning runs (``isthmus demo --strategy zo``).

Zeroth-order training (MeZO) is a fine-tuning method: from a random initialization it needs
orders of magnitude more steps than backpropagation. So the demo of ``zo`` starts from the
built-in GPT pre-trained by a short run of backpropagation on one process (AdamW, the run's
batch size; what DDP on one peer computes), on a *held-out slice* of the corpus: the standard
library's files that come after the run's corpus in sorted order. The fine-tuning run then adapts
the model to files it has never seen (the run's corpus), and its eval loss on them falls.

The result is cached (``$XDG_CACHE_HOME/isthmus/pretrained`` or ``~/.cache/isthmus/pretrained``),
keyed by everything it depends on, and written atomically, so two demos never train it twice
and a killed pre-training leaves no file behind. ``--init-from FILE`` takes any file holding the
model's ``state_dict`` (``torch.save(model.state_dict(), FILE)``) instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from isthmus.data import Corpus, evaluate
from isthmus.data.corpus import stdlib_files
from isthmus.run.config import RunConfig

__all__ = [
    "PRETRAIN_BYTES",
    "PRETRAIN_STEPS",
    "ZO_DEMO_OPTIONS",
    "pretrain",
    "pretrained_start",
    "pretraining_corpus",
    "zo_demo",
]

PRETRAIN_STEPS = 300
"""Steps of the demo's pre-training (made once per model and data, then cached)."""
PRETRAIN_BYTES = 2_000_000
"""Bytes of the pre-training slice."""


ZO_DEMO_OPTIONS: dict[str, Any] = {"lr": 1e-3, "perturbations": 2}
"""The demo's ``zo`` options unless given (MeZO's lr 1e-6 is for billions of parameters and
barely moves this GPT): chosen by measurement from the pre-trained default model on the run's
corpus (see docs/BENCHMARKS.md)."""


def zo_demo(run: RunConfig) -> RunConfig:
    """``run`` as the demo of ``zo``: :data:`ZO_DEMO_OPTIONS` for the options it does not name,
    and the cached pre-trained model (:func:`pretrained_start`, made now if missing) unless
    ``model.init_from`` names one."""
    from isthmus.run.config import apply_overrides

    changes: dict[str, Any] = {"option": {**ZO_DEMO_OPTIONS, **run.strategy.options}}
    if not run.model.init_from:
        changes["init_from"] = str(pretrained_start(run))
    return apply_overrides(run, changes)


def pretraining_corpus(run: RunConfig, max_bytes: int = PRETRAIN_BYTES) -> Corpus:
    """The standard library's ``.py`` files after the first ``run.data.corpus_bytes`` bytes (the
    run's own corpus, whose last file is skipped whole, so no file is in both), up to
    ``max_bytes``. Raises ValueError if the standard library has nothing left after them."""
    import sysconfig

    base = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[tuple[str, bytes]] = []
    offset = total = 0
    for rel in stdlib_files(base):
        if total >= max_bytes:
            break
        data = (base / rel).read_bytes()
        start, offset = offset, offset + len(data)
        if start < run.data.corpus_bytes:
            continue  # in the run's corpus (or cut by it)
        data = data[: max_bytes - total]
        if data:
            pieces.append((rel, data))
            total += len(data)
    if len(pieces) < 2:
        raise ValueError(
            f"the standard library has no files left after the run's {run.data.corpus_bytes} "
            f"bytes of corpus: lower data.corpus_bytes or give --init-from"
        )
    return Corpus.from_pieces(pieces, seed=run.data.seed)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "isthmus" / "pretrained"


def _key(run: RunConfig, corpus: Corpus, steps: int) -> str:
    parts = {
        "model": dataclasses.asdict(run.model) | {"init_from": None},
        "corpus": corpus.fingerprint,
        "steps": steps,
        "lr": run.optim.lr,
        "weight_decay": run.optim.weight_decay,
        "batch_size": run.data.batch_size,
        "torch": torch.__version__,
    }
    return xxhash.xxh3_64_hexdigest(json.dumps(parts, sort_keys=True).encode())


def pretrain(
    run: RunConfig, path: Path, *, steps: int = PRETRAIN_STEPS, max_bytes: int = PRETRAIN_BYTES
) -> dict[str, float]:
    """Train the run's model on :func:`pretraining_corpus` for ``steps`` AdamW steps on this
    process and save its ``state_dict`` to ``path`` (atomically). Returns the eval losses on the
    run's own corpus before and after (``initial``, ``pretrained``)."""
    from isthmus.run.job import build_corpus, build_model

    held_out = pretraining_corpus(run, max_bytes)
    model = build_model(
        dataclasses.replace(run, model=dataclasses.replace(run.model, init_from=None))
    )
    block = model.config.block_size
    opt = torch.optim.AdamW(
        model.parameters(), lr=run.optim.lr, weight_decay=run.optim.weight_decay, betas=(0.9, 0.95)
    )
    own = build_corpus(run)
    n_eval = run.eval.eval_batches
    before = evaluate(model, own, batch_size=run.data.batch_size, n_batches=n_eval)
    for step in range(steps):
        x, y = held_out.batch(
            step=step, rank=0, world=1, batch_size=run.data.batch_size, block_size=block, seed=0
        )
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = evaluate(model, own, batch_size=run.data.batch_size, n_batches=n_eval)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return {"initial": before, "pretrained": after}


def pretrained_start(run: RunConfig, *, steps: int = PRETRAIN_STEPS) -> Path:
    """The cached pre-trained ``state_dict`` for ``run``'s model (see the module docstring),
    made now if it is not there yet (saying so on stderr). Raises what :func:`pretrain` raises
    (OSError if the cache cannot be written)."""
    held_out = pretraining_corpus(run)
    path = _cache_dir() / f"{run.model.preset}-{_key(run, held_out, steps)}.pt"
    if path.exists():
        return path
    print(
        f"pre-training the {run.model.preset} model for {steps} steps on one process "
        f"(held-out slice: {len(held_out.train_sources)} stdlib files after the run's corpus; "
        f"cached at {path})",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.monotonic()
    losses = pretrain(run, path, steps=steps)
    print(
        f"pre-trained in {time.monotonic() - t0:.0f}s: eval loss on the run's corpus "
        f"{losses['initial']:.3f} -> {losses['pretrained']:.3f}",
        file=sys.stderr,
        flush=True,
    )
    return path
