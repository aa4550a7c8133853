"""examples/fsdp_llama.py three ways: one island of 4 ranks (torchrun), 2 islands x 2 ranks
(isthmus), 4 single-rank peers (isthmus, no FSDP).

    python benchmarks/islands.py [--steps 30] [--width 384] [--layers 6] [--vocab 16384]

Every rank prints its tokens per second, its peak resident memory and the bytes it sent across
islands; this sums the tokens per second of a run's ranks, takes the largest peak, and the bytes
each island (or single peer) sent. All processes share this machine's cores (one thread each).
Prints a markdown table and the JSON it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp_llama.py"
LINE = re.compile(
    r"(?:\[(?P<peer>peer\d+)\] )?rank (?P<rank>\d+): step \d+, loss (?P<loss>[\d.]+), "
    r"(?P<tps>\d+) tokens/s, peak RSS (?P<rss>\d+) MB, sent (?P<sent>\d+) B "
    r"\(island (?P<island>\d+) B\)"
)


def run(label: str, argv: list[str], timeout: float) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    rows = [m.groupdict() for m in LINE.finditer(p.stdout + p.stderr)]
    if p.returncode != 0 or not rows:
        tail = (p.stdout + p.stderr)[-3000:]
        raise SystemExit(f"{label} failed ({p.returncode}):\n{tail}")
    islands: dict[str, int] = {}
    for r in rows:
        islands[r["peer"] or "island"] = int(r["island"])
    return {
        "run": label,
        "ranks": len(rows),
        "tokens_per_s": sum(int(r["tps"]) for r in rows),
        "peak_rss_mb": max(int(r["rss"]) for r in rows),
        "bytes_per_island": sorted(islands.values()),
        "final_loss": [float(r["loss"]) for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    model = [
        "--steps", str(args.steps), "--sync-every", str(args.sync_every), "--width",
        str(args.width), "--layers", str(args.layers), "--vocab", str(args.vocab),
        "--block-size", str(args.block_size),
    ]  # fmt: skip
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        isthmus = [py, "-m", "isthmus.cli", "run", "--no-progress", "--run-dir"]
        results = [
            run("torchrun --nproc-per-node 4 (one island of 4)",
                [py, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(EXAMPLE), *model],
                args.timeout),
            run("isthmus run --peers 2 --nproc-per-peer 2",
                [*isthmus, f"{tmp}/islands", "--peers", "2", "--nproc-per-peer", "2",
                 str(EXAMPLE), *model], args.timeout),
            run("isthmus run --peers 4 (single-rank peers)",
                [*isthmus, f"{tmp}/single", "--peers", "4", str(EXAMPLE), *model],
                args.timeout),
        ]  # fmt: skip
    print("| run | ranks | tokens/s (sum) | peak RSS per rank | bytes sent per island |")
    print("|---|---|---|---|---|")
    for r in results:
        sent = ", ".join(f"{b / 1e6:.1f} MB" for b in r["bytes_per_island"])  # type: ignore[attr-defined]
        print(
            f"| {r['run']} | {r['ranks']} | {r['tokens_per_s']:,} | {r['peak_rss_mb']} MB | {sent} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
