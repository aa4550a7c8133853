"""Tokens per second of examples/hf_causal_lm.py on 1, 2 and 4 peers against plain torch.

    python benchmarks/hf_example.py [--steps 200] [--peers 1,2,4] [--size tiny] [--out DIR]

Plain torch is the same model, optimizer, batch and loop in one process, with no isthmus at all.
The isthmus runs are `isthmus run --peers P examples/hf_causal_lm.py ...` on this machine
(loopback): each peer prints its own tokens per second, and the run's throughput is their sum.
All peers share this machine's cores, so more peers than cores measure contention, not scale: the
table says how many cores there were. Prints a markdown table and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from hf_causal_lm import build_model  # noqa: E402

from isthmus.data import TokenDataset, prepare  # noqa: E402


def plain(data_dir: Path, steps: int, batch: int, block: int, size: str) -> float:
    """Tokens per second of the example's loop without isthmus, one process, one thread."""
    torch.set_num_threads(1)
    data = TokenDataset(data_dir, block, split="train")
    model = build_model(data.vocab_size or 256, block, size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    tokens, t0 = 0, time.monotonic()
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch,), generator=g).tolist()
        x, y = data.batch(idx)
        logits = model(input_ids=x).logits
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        tokens += x.numel()
    return tokens / (time.monotonic() - t0)


def with_isthmus(data_dir: Path, out: Path, peers: int, steps: int, batch: int, size: str) -> float:
    """Sum over peers of the tokens per second each reports (global batch = peers x batch)."""
    run = out / f"peers{peers}"
    cmd = [
        sys.executable, "-m", "isthmus.cli", "run", "--no-progress", "--run-dir", str(run),
        "--peers", str(peers), str(ROOT / "examples" / "hf_causal_lm.py"), "--data", str(data_dir),
        "--steps", str(steps), "--batch-size", str(batch * peers), "--size", size,
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"isthmus run failed ({p.returncode}): {p.stderr[-2000:]}")
    rates = []
    for log in sorted(run.glob("peer*.log")):
        m = re.search(r"([0-9]+) tokens/s", log.read_text())
        if m:
            rates.append(float(m.group(1)))
    return sum(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--peers", default="1,2,4")
    ap.add_argument("--batch-size", type=int, default=16, help="per peer")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--out", default="runs/bench-hf")
    args = ap.parse_args()
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    data = out / "data"
    prepare([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], data, progress=False)
    rows = [
        {
            "run": "plain torch, 1 process",
            "tokens_per_s": plain(data, args.steps, args.batch_size, 64, args.size),
        }
    ]
    for n in (int(x) for x in args.peers.split(",")):
        rate = with_isthmus(data, out, n, args.steps, args.batch_size, args.size)
        rows.append({"run": f"isthmus run --peers {n} (DiLoCo, H=20)", "tokens_per_s": rate})
    (out / "results.json").write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))
    base = rows[0]["tokens_per_s"]
    print(
        f"\n{os.cpu_count()} cores, {args.steps} steps, batch {args.batch_size} x 64 tokens per peer\n"
    )
    print("| run | tokens/s | vs plain torch |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
