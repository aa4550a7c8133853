"""Peak memory of a training step: zeroth order (``zo``) against backpropagation with AdamW and
against plain inference, for the built-in GPT (issue 18).

Each mode runs in a fresh process (so that one's peak does not hide another's): build the model
and a batch, note the peak resident set size, run a few steps, and report by how much the peak
grew. The growth is what the step itself needs (activations kept for backward, gradients,
optimizer moments, zo's copy of the parameters and its ``z``); the torch library and the model's
own parameters are in the baseline of all three.

    python benchmarks/zo_memory.py [--model default|tiny] [--batch-size 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def one(mode: str, preset: str, batch_size: int, steps: int) -> dict[str, float]:
    import torch

    from isthmus.data import Corpus
    from isthmus.models import GPT, GPTConfig
    from isthmus.strategies.zo import ZO, ZOConfig

    torch.set_num_threads(1)
    cfg = GPTConfig.tiny() if preset == "tiny" else GPTConfig.default()
    model = GPT(cfg, seed=0)
    corpus = Corpus.from_stdlib(max_bytes=200_000)
    x, y = corpus.batch(step=0, rank=0, world=1, batch_size=batch_size, block_size=cfg.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zo = ZO(None, model, opt, ZOConfig(lr=1e-4)) if mode == "zo" else None
    base = _peak_mb()
    for _ in range(steps):
        if mode == "inference":
            with torch.no_grad():
                model(x, y)
        elif zo is not None:
            zo.step(lambda: model(x, y)[1])
        else:
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"baseline_mb": round(base, 1), "growth_mb": round(_peak_mb() - base, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", choices=["default", "tiny"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # one measurement, in a child process
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one(args.mode, args.model, args.batch_size, args.steps)))
        return
    out = {}
    for mode in ("inference", "zo", "backprop"):
        cmd = [sys.executable, __file__, f"--mode={mode}", f"--model={args.model}"]
        cmd += [f"--batch-size={args.batch_size}", f"--steps={args.steps}"]
        res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        out[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    out["zo_over_backprop"] = round(
        out["zo"]["growth_mb"] / max(out["backprop"]["growth_mb"], 0.1), 3
    )
    print(json.dumps({"model": args.model, "batch_size": args.batch_size, **out}, indent=1))


if __name__ == "__main__":
    main()
