"""What checkpoints cost: the training thread's stall against a synchronous torch.save of the same
state, the bytes each peer writes against the number of peers, and the time to resume.

    python benchmarks/checkpoint.py [--model default] [--peers 1,2,4] [--steps 120] [--out DIR]

For each peer count: a DiLoCo run of the built-in job (H=10) checkpointing after every outer
round, then a resume of its last checkpoint. The stall is what the checkpointer's
``maybe_save`` cost the training threads per checkpoint (the snapshot; writing runs in the
background), against ``torch.save`` of the consolidated shared state to a file, fsynced, timed
in this process (what a synchronous save in the training loop would cost the slowest peer: all
of it), and that stall by part where the checkpointer reports one (its
``checkpoint_stall_split_s``). Bytes per peer are the parts of the manifest. Resume time is the
peers' ``load_latest`` (read, verify every hash, copy in). Prints markdown tables and writes
``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from isthmus.checkpoint import CheckpointStore, read_manifest
from isthmus.checkpoint.inspect import templates
from isthmus.checkpoint.load import load_shared
from isthmus.run.builtin_run import demo_config, run_builtin
from isthmus.run.record import RunDir


def sync_save_s(url: str, reps: int = 5) -> tuple[float, int]:
    """Median seconds of torch.save (fsynced) of the latest checkpoint's whole shared state."""
    store = CheckpointStore(url)
    m = read_manifest(store, store.revisions()[-1])
    state = load_shared(store, m, templates(m.schema))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(reps):
            path = Path(d) / f"s{i}.pt"
            t0 = time.perf_counter()
            with path.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes


def one(out: Path, peers: int, model: str, steps: int) -> dict[str, Any]:
    ck = out / f"ck{peers}"
    base = {
        "model": model,
        "peers": peers,
        "strategy": "diloco",
        "option": {"sync_every": 10},
        "progress": False,
    }
    cfg = demo_config(
        {
            **base,
            "steps": steps,
            "run_dir": str(out / f"run{peers}"),
            "checkpoint_dir": str(ck),
            "checkpoint_every": 1,
        }
    )
    summary, _, run_dir = run_builtin(cfg)
    stalls, counts, splits = [], [], []
    for name in summary.exit_codes:
        r = run_dir.result(name)
        if r is not None and r.checkpoint:
            stalls.append(r.checkpoint["checkpoint_stall_s"])
            counts.append(r.checkpoint["checkpoint_parts_written"])
            split = r.checkpoint.get("checkpoint_stall_split_s")  # where the checkpointer has it
            if split:
                n = max(r.checkpoint["checkpoint_parts_written"], 1)
                splits.append({k: v / n for k, v in split.items()})
    per_ckpt = statistics.mean(s / max(c, 1) for s, c in zip(stalls, counts, strict=True))
    # per checkpoint, the mean over the peers, by part
    split_per_ckpt = (
        {k: statistics.mean(sp[k] for sp in splits) for k in splits[0]} if splits else {}
    )
    sync_s, state_bytes = sync_save_s(str(ck))
    store = CheckpointStore(str(ck))
    m = read_manifest(store, store.revisions()[-1])
    part_bytes = [int(v) for v in m.bytes.values()]
    resumed = demo_config(
        {**base, "steps": steps + 10, "run_dir": str(out / f"resume{peers}"), "resume": str(ck)}
    )
    _, _, rdir = run_builtin(resumed)
    resume_s = [
        r.checkpoint.get("resume_s", 0.0)
        for r in (RunDir(rdir.path).result(n) for n in summary.exit_codes)
        if r is not None
    ]
    return {
        "peers": peers,
        "checkpoints": summary.checkpoints_written,
        "stall_per_checkpoint_s": per_ckpt,
        "stall_split_per_checkpoint_s": split_per_ckpt,
        "sync_torch_save_s": sync_s,
        "stall_ratio": per_ckpt / sync_s,
        "state_bytes": state_bytes,
        "max_part_bytes": max(part_bytes),
        "part_share": max(part_bytes) / state_bytes,
        "resume_s": max(resume_s) if resume_s else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default", choices=["tiny", "default"])
    ap.add_argument("--peers", default="1,2,4")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", default="runs/bench-checkpoint")
    args = ap.parse_args()
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    rows = [one(out, int(n), args.model, args.steps) for n in args.peers.split(",")]
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(
        f"\nmodel {args.model}, DiLoCo H=10, a checkpoint after every outer round, {os.cpu_count()} cores\n"
    )
    print(
        "| peers | checkpoints | stall per checkpoint (ms) | torch.save, fsynced (ms) | ratio | state (MB) | largest part / state | resume (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['peers']} | {r['checkpoints']} | {1000 * r['stall_per_checkpoint_s']:.2f} | "
            f"{1000 * r['sync_torch_save_s']:.1f} | {r['stall_ratio']:.3f} | {r['state_bytes'] / 1e6:.2f} | "
            f"{r['part_share']:.3f} | {r['resume_s']} |"
        )
    if any(r["stall_split_per_checkpoint_s"] for r in rows):
        print("\nstall per checkpoint by part (ms, mean over the peers)\n")
        parts = next(
            iter(
                r["stall_split_per_checkpoint_s"] for r in rows if r["stall_split_per_checkpoint_s"]
            )
        )
        print("| peers | " + " | ".join(parts) + " |")
        print("|---|" + "---|" * len(parts))
        for r in rows:
            sp = r["stall_split_per_checkpoint_s"]
            if sp:
                print(
                    f"| {r['peers']} | " + " | ".join(f"{1000 * sp[k]:.3f}" for k in parts) + " |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
