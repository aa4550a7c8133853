"""What every foreign worker of ``benchmarks/peers.py`` shares: the job, the model, the data, the
eval and the record file. Runs in the peers' virtual environment (``make bench-peers-env``), where
isthmus is installed beside torchft and hivemind, so the workers train exactly isthmus's tiny GPT
on isthmus's corpus, with isthmus's batches and eval batches.

A worker is started as ``python benchmarks/peers_<system>.py JOB.json SLOT NAME [--join]``. It
writes ``<out>/<NAME>.jsonl``: one JSON object per line, each with ``ts`` (wall clock) and
``kind``: ``ready`` (imports, model and the system's own set-up done), ``start`` (past the start
barrier: every starting peer is ready), ``step`` (one inner step: ``step``, ``loss`` and, every
``eval_every`` steps, ``eval_loss``), ``commit`` (the system's own notion of a committed
synchronization, with what the system says about it), ``log`` (a line of the system's own log
that the benchmark reads) and ``done``. A worker that fails writes ``error`` with the traceback
and exits 1.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from isthmus.data import Corpus, evaluate
from isthmus.models import GPT, GPTConfig

REQUIRED = (
    "system",
    "mode",
    "peers",
    "hosts",
    "store_host",
    "store_port",
    "steps",
    "batch_size",
    "lr",
    "weight_decay",
    "corpus_bytes",
    "data_seed",
    "model_seed",
    "eval_every",
    "eval_batches",
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "fragments",
    "overlap",
    "alpha",
    "collective_timeout",
    "heartbeat_timeout",
    "start_timeout",
    "step_delay",
    "out",
)


def load_job(path: str) -> dict[str, Any]:
    """The job the driver wrote. Raises ValueError naming the keys that are missing."""
    job = json.loads(Path(path).read_text())
    missing = [k for k in REQUIRED if k not in job]
    if missing:
        raise ValueError(f"{path}: job lacks {', '.join(missing)}")
    return job


class Recorder:
    """Appends one JSON object per line to ``<out>/<name>.jsonl``, flushed at once (a SIGKILL
    loses at most the line being written, which the reader skips)."""

    def __init__(self, out: str, name: str) -> None:
        self.path = Path(out) / f"{name}.jsonl"
        self.f = self.path.open("a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        self.f.write(json.dumps({"ts": round(time.time(), 4), "kind": kind, **fields}) + "\n")

    def close(self) -> None:
        self.f.close()


class Trainer:
    """isthmus's GPT (the job's ``model`` preset: ``tiny``, ``default`` or ``medium``), its corpus, batches
    and eval, and AdamW as isthmus's built-in job makes it (``isthmus.run.job``: betas 0.9/0.95,
    the run's lr and weight decay)."""

    def __init__(self, job: dict[str, Any], slot: int) -> None:
        torch.set_num_threads(1)
        self.job = job
        self.slot = slot
        self.corpus = Corpus.from_stdlib(max_bytes=job["corpus_bytes"], seed=job["data_seed"])
        # the job's model preset as isthmus's built-in job builds it (``isthmus.run.job``)
        self.model = GPT(GPTConfig.preset(job.get("model", "tiny")), seed=job["model_seed"])
        self.block_size = self.model.config.block_size

    def inner_optimizer(self, params: Any = None) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            self.model.parameters() if params is None else params,
            lr=self.job["lr"],
            weight_decay=self.job["weight_decay"],
            betas=(0.9, 0.95),
        )

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch isthmus's job draws at ``step`` as rank ``slot`` of ``peers``."""
        return self.corpus.batch(
            step=step,
            rank=self.slot,
            world=self.job["peers"],
            batch_size=self.job["batch_size"],
            block_size=self.block_size,
            seed=self.job["data_seed"],
        )

    def loss(self, model: Any, step: int) -> torch.Tensor:
        x, y = self.batch(step)
        _, loss = model(x, y)
        assert loss is not None
        return loss

    def eval_loss(self) -> float:
        """isthmus's eval: the same fixed eval batches, the mean next-byte cross entropy."""
        return evaluate(
            self.model,
            self.corpus,
            batch_size=self.job["batch_size"],
            n_batches=self.job["eval_batches"],
        )


def connect_store(job: dict[str, Any]) -> Any:
    """The driver's TCPStore in the coordinator's namespace (start barrier, addresses)."""
    import torch.distributed as dist

    return dist.TCPStore(
        job["store_host"],
        job["store_port"],
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=job["start_timeout"]),
    )


def barrier(store: Any, key: str, n: int, timeout_s: float) -> None:
    """Wait until ``n`` processes called this with ``key``. Raises TimeoutError after
    ``timeout_s`` naming how many arrived."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        arrived = store.add(key, 0)
        if arrived >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"start barrier {key!r}: {arrived} of {n} after {timeout_s:.0f}s")
        time.sleep(0.02)


def run_worker(main: Callable[[dict[str, Any], int, str, bool, Recorder], None]) -> None:
    """Parse ``JOB.json SLOT NAME [--join]``, run ``main`` and exit: 0 when it returned, 1 with
    an ``error`` record when it raised. Exits with ``os._exit`` so that no library's background
    threads (a DHT process, a lighthouse client) hold the process at interpreter exit."""
    args = sys.argv[1:]
    if len(args) not in (3, 4) or (len(args) == 4 and args[3] != "--join"):
        print(f"usage: {sys.argv[0]} JOB.json SLOT NAME [--join]", file=sys.stderr)
        os._exit(2)
    job = load_job(args[0])
    rec = Recorder(job["out"], args[2])
    code = 0
    try:
        main(job, int(args[1]), args[2], len(args) == 4, rec)
        rec.write("done")
    except BaseException as e:  # everything is reported; the driver reads the record
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" ({Path(where.filename).name}:{where.lineno} in {where.name})" if where else ""
        rec.write("error", error=f"{type(e).__name__}: {e}{at}", traceback=traceback.format_exc())
        traceback.print_exc()
        code = 1
    rec.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
