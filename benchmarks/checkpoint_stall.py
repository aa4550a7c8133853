"""The training thread's stall per checkpoint against a synchronous torch.save, in one process,
interleaved so that both see the same load (this box is shared: a run of the built-in job,
``benchmarks/checkpoint.py``, times the two minutes apart).

    python benchmarks/checkpoint_stall.py [--peers 1,2,4] [--saves 20] [--steps-between 10]

The state of a DiLoCo peer on the default GPT (1,288,640 parameters): the shared state (the
global model, the outer momentum, the step counter) of which a peer of N writes its part
(``assign_parts``, rank 0 here), and the local state (AdamW's two moments and the local model,
with the RNG state), as ``Strategy.local_state`` returns it. Between two checkpoints the peer
takes ``--steps-between`` AdamW steps (forward, backward, step) and then an outer step writes
the shared state; before it, the peer calls ``Checkpointer.settle`` when the checkpointer has
it (what ``DiLoCo.sync`` does before its round). The stall per checkpoint is the median wall
time of ``maybe_save`` (the snapshot on the training thread, and starting the writer; the
previous write is waited for first, apart: how long a write takes is the store's speed, not the
snapshot's) plus the mean time the training thread waited in ``settle`` for a background copy
(before a round, or an optimizer step). The reference is ``torch.save`` of the whole shared
state to a file, fsynced, timed right after each checkpoint. Runs against whichever isthmus is on ``PYTHONPATH`` (the ``background_shared`` and
``background_local`` options are used when the Checkpointer has them, the latter settled by a
step pre-hook on the optimizer, as ``DiLoCo.step_written_local`` sets it up).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from isthmus.checkpoint import Checkpointer
from isthmus.comm.state import SharedState
from isthmus.models.gpt import GPT, GPTConfig


class _Session:
    """What the checkpointer needs of a session; the coordinator's answer never completes a
    checkpoint (one peer of N writes its part)."""

    def __init__(self, world: int) -> None:
        self.state = SharedState()
        self.revision = 0
        self.rank, self.world, self.name, self.run_id = 0, world, "peer0", "bench"

    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"complete": False, "write_manifest": False}


def _sync_save(shared: dict[str, torch.Tensor], path: Path) -> float:
    t0 = time.perf_counter()
    with path.open("wb") as f:
        torch.save(shared, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def one(world: int, saves: int, steps_between: int, root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.default(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 64))

    def step() -> None:
        logits = model(x)
        loss = (logits[0] if isinstance(logits, tuple) else logits).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    s = _Session(world)
    shared: dict[str, torch.Tensor] = {}
    for i, (n, p) in enumerate(model.named_parameters()):
        shared[f"global/{n}"] = p.detach().clone()
        shared[f"outer/{i}/momentum_buffer"] = torch.zeros_like(p)
    shared["meta/step"] = torch.zeros((), dtype=torch.int64)
    for n, t in shared.items():
        s.state.register(n, t)

    def local_state() -> dict[str, Any]:
        return {
            "rng": torch.get_rng_state(),
            "optimizer": opt.state_dict(),
            "model": {n: p.detach() for n, p in model.named_parameters()},
        }

    kw: dict[str, Any] = {}
    background = "background_shared" in inspect.signature(Checkpointer).parameters
    if background:
        kw["background_shared"] = set(shared)
    ck = Checkpointer(s, str(root / f"ck{world}"), every=1, keep=2, local_state=local_state, **kw)
    waits: list[float] = []  # the training thread's time in settle, per checkpoint

    def timed_settle() -> None:
        t0 = time.perf_counter()
        ck.settle()
        waits[-1] += time.perf_counter() - t0

    if hasattr(ck, "background_local"):  # what DiLoCo.step_written_local sets up
        opt.register_step_pre_hook(lambda *_: timed_settle())
        names = {n for n, _ in model.named_parameters()}
        ck.background_local = lambda p: p[0] == "optimizer" or (p[0] == "model" and p[1] in names)
    sync: list[float] = []
    snap: list[float] = []  # wall seconds of maybe_save, the previous write already done
    snap_cpu: list[float] = []  # the training thread's CPU seconds in it
    settled: list[float] = []  # per checkpoint: waits for the previous one's background copy
    waits.append(0.0)
    for k in range(saves):
        for _ in range(steps_between):
            step()
        if hasattr(ck, "settle"):
            timed_settle()  # the strategy's round may now write the shared state
        settled.append(waits[-1])
        waits.append(0.0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                shared[f"global/{n}"].add_(p, alpha=1e-3)
            shared["meta/step"] += 1
        s.revision = k + 1
        ck.wait(60)  # a write still running is the store's speed, not the snapshot's
        t0, c0 = time.perf_counter(), time.thread_time()
        assert ck.maybe_save()
        snap.append(time.perf_counter() - t0)
        snap_cpu.append(time.thread_time() - c0)
        sync.append(_sync_save(shared, root / "sync.pt"))
    ck.wait(60)
    nbytes = sum(t.numel() * t.element_size() for t in shared.values())
    med = statistics.median
    stall = med(snap) + statistics.mean(settled)
    return {
        "peers": world,
        "background": background,
        "snapshot_ms": 1e3 * med(snap),
        "snapshot_cpu_ms": 1e3 * med(snap_cpu),
        "settle_ms": 1e3 * statistics.mean(settled),
        "stall_ms": 1e3 * stall,
        "sync_save_ms": 1e3 * med(sync),
        "ratio": stall / med(sync),
        "shared_mb": nbytes / 1e6,
        "failures": ck.failures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="1,2,4")
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--steps-between", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)  # a peer of several on two cores
    with tempfile.TemporaryDirectory() as d:
        rows = [one(int(n), a.saves, a.steps_between, Path(d)) for n in a.peers.split(",")]
    print(
        "| peers (part written) | background copy | snapshot ms (its CPU ms) | settle ms "
        "| stall ms | torch.save, fsynced (ms) | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['peers']} (1/{r['peers']} of {r['shared_mb']:.1f} MB) | {r['background']} "
            f"| {r['snapshot_ms']:.2f} ({r['snapshot_cpu_ms']:.2f}) | {r['settle_ms']:.2f} "
            f"| {r['stall_ms']:.2f} | {r['sync_save_ms']:.1f} | {r['ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
