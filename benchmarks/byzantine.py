"""Byzantine robustness benchmark: every attack against every aggregator on the tiny GPT.

Each run trains the tiny GPT with ``n`` peers of which the last ``k`` are byzantine, for a few
dozen DDP steps, and records the final eval loss, the bytes each peer sent per round and the time
the reductions took. The peers are threads of this process, each with its own model, optimizer,
real :class:`~isthmus.strategies.ddp.DDP` (or DiLoCo) strategy and
:class:`~isthmus.reduce.reducer.Reducer`, joined by real Gloo groups over loopback
(``isthmus.testing.local_groups``); the attack is installed by the same code as in a peer process
(``isthmus.run.job.install_attack``: attackers know their own update and the committed aggregates).
Only the coordinator is left out (every round commits), which keeps a run to a few seconds on two
cores. Byte counts are Gloo's wire bytes as counted by ``Group``; times are wall-clock on a
shared 2-core machine and only meaningful relative to plain mean in the same sweep.

A baseline run trains the honest peers alone (``n - k`` peers, plain mean).

``cost`` measures what robustness costs without any attack: for each aggregator, the reducer's
round (all ranks released together by a barrier) on fixed random updates of the tiny GPT's size
and of the default GPT's size, median over repetitions, with the bytes each peer sent.

Usage (the figures in docs/BENCHMARKS.md)::

    .venv/bin/python benchmarks/byzantine.py train --settings 5:1,7:2 --steps 60 --json OUT.json
    .venv/bin/python benchmarks/byzantine.py cost --peers 5,7 --json COST.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from isthmus.comm.group import Group
from isthmus.data import Corpus, evaluate
from isthmus.models import GPT, GPTConfig
from isthmus.reduce.reducer import Reducer
from isthmus.run.job import install_attack
from isthmus.strategies import make_strategy
from isthmus.testing import local_groups, run_parallel

AGGREGATORS = [
    "mean",
    "median",
    "trimmed_mean",
    "meamed",
    "krum",
    "multi_krum",
    "geometric_median",
    # tau about twice the honest gradients' spread around their mean (about 0.5 at the start)
    "centered_clipping:tau=1,iterations=3",
    "flag",
    "nnm+krum",
]
ATTACKS = [
    "none",
    "sign_flip",
    "ipm:tau=0.1",
    "ipm:tau=10",
    "alie",
    "alie:center=aggregate",
    "gaussian",
    "nan",
    "label_flip",
]
TINY_PARAMS = 34_688  # parameters of GPTConfig.tiny() and GPTConfig.default()
DEFAULT_PARAMS = 1_288_640


# -- a session without a coordinator: every round commits at once ----------------------------------


class _NoFaults:
    def check(self, *_: Any, **__: Any) -> None:
        return None


class _State:
    def register(self, _name: str, _t: torch.Tensor) -> None:
        return None


class _Round:
    """What strategies and the reducer use of :class:`isthmus.comm.session.Round`."""

    def __init__(self, group: Group, number: int) -> None:
        self.group = group
        self.number = number
        self.epoch = 1
        self.resynced = False

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world

    def check_faults(self, *_: Any, **__: Any) -> None:
        return None


class _Session:
    """Stands in for :class:`isthmus.comm.session.Session` inside one process."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank, self.world = group.rank, group.world
        self.revision = 0
        self.state = _State()
        self.faults = _NoFaults()
        self.stats = group.stats

    def register(self, name: str, t: torch.Tensor) -> None:
        return None

    def run_round(self, fn: Any) -> Any:
        out = fn(_Round(self.group, self.revision))
        self.revision += 1
        return out


# -- one run -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunConfig:
    peers: int
    byzantine: int
    attack: str
    aggregator: str
    f: int
    steps: int = 50
    strategy: str = "ddp"
    sync_every: int = 5
    batch_size: int = 16
    lr: float = 3e-3
    corpus_bytes: int = 400_000
    seed: int = 0
    eval_batches: int = 16
    label: str = field(default="")


def run(cfg: RunConfig, corpus: Corpus) -> dict[str, Any]:
    """Train one configuration; returns eval loss, bytes per peer per round, reduce time."""
    n, k = cfg.peers, cfg.byzantine
    groups = local_groups(n, timeout_s=120.0)
    mcfg = GPTConfig.tiny()
    models = [GPT(mcfg, seed=cfg.seed) for _ in range(n)]
    strategies = []
    flips: list[Any] = []
    for r in range(n):
        opt = torch.optim.AdamW(
            models[r].parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95)
        )
        options = {"sync_every": cfg.sync_every} if cfg.strategy == "diloco" else {}
        st = make_strategy(
            cfg.strategy,
            _Session(groups[r]),  # type: ignore[arg-type]
            models[r],
            opt,
            aggregator=None if cfg.aggregator == "mean" else cfg.aggregator,
            byzantine_f=cfg.f,
            **options,
        )
        byz = r >= n - k and cfg.attack != "none"
        flips.append(install_attack(cfg.attack, st) if byz else None)
        strategies.append((st, opt))

    def train(g: Group) -> None:
        st, opt = strategies[g.rank]
        model = models[g.rank]
        while st.step_count < cfg.steps:
            x, y = corpus.batch(
                step=st.step_count,
                rank=g.rank,
                world=n,
                batch_size=cfg.batch_size,
                block_size=mcfg.block_size,
                seed=cfg.seed,
            )
            if flips[g.rank] is not None:
                y = flips[g.rank](y)
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            st.step()
            opt.zero_grad(set_to_none=False)
        st.finish()

    t0 = time.perf_counter()
    run_parallel(groups, train, timeout_s=1800.0)
    wall = time.perf_counter() - t0
    # every peer, byzantine ones included, applied the same aggregates
    ref = [p.detach() for p in models[0].parameters()]
    parity = all(
        all(torch.equal(a, b.detach()) for a, b in zip(ref, m.parameters(), strict=True))
        for m in models[1:]
    )
    finite = all(bool(torch.isfinite(p).all()) for p in ref)
    eval_loss = evaluate(models[0], corpus, batch_size=cfg.batch_size, n_batches=cfg.eval_batches)
    rounds = max(1, strategies[0][0].session.revision)  # type: ignore[union-attr]
    reducer = strategies[0][0].reducer
    assert reducer is not None
    out = {
        **asdict(cfg),
        "eval_loss": eval_loss,
        "rounds": rounds,
        "bytes_per_peer_round": sum(g.stats.bytes_sent for g in groups) / n / rounds,
        "reduce_ms_per_round": 1000.0 * reducer.timing.comm_s / max(1, reducer.timing.reductions),
        "wall_s": wall,
        "parity": parity,
        "finite": finite,
        "skipped_rounds": reducer.rejected_sums,
    }
    for g in groups:
        g.abort("benchmark run over")
    return out


# -- the sweep -----------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    corpus = Corpus.from_stdlib(max_bytes=args.corpus_bytes, seed=0)
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for setting in args.settings.split(","):
        n, k = (int(x) for x in setting.split(":"))
        common = {
            "steps": args.steps,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "corpus_bytes": args.corpus_bytes,
            "strategy": args.strategy,
            "sync_every": args.sync_every,
        }
        plan = [
            RunConfig(
                peers=n - k,
                byzantine=0,
                attack="none",
                aggregator="mean",
                f=0,
                label="honest-only",
                **common,
            )
        ]
        for agg in args.aggregators:
            for attack in args.attacks:
                plan.append(
                    RunConfig(
                        peers=n,
                        byzantine=k,
                        attack=attack,
                        aggregator=agg,
                        f=k,
                        label=f"{n}:{k}",
                        **common,
                    )
                )
        for cfg in plan:
            t = time.perf_counter()
            try:
                res = run(cfg, corpus)
            except Exception as e:  # one broken configuration must not lose the whole sweep
                res = {**asdict(cfg), "error": f"{type(e).__name__}: {e}"}
            res["setting"] = f"{n}:{k}"
            results.append(res)
            print(
                f"[{time.perf_counter() - t:5.1f}s] n={cfg.peers} k={cfg.byzantine} "
                f"{cfg.aggregator:<18} {cfg.attack:<12} "
                + (
                    f"eval={res['eval_loss']:.3f} parity={res['parity']}"
                    if "eval_loss" in res
                    else res["error"]
                ),
                flush=True,
            )
    return results


def markdown(results: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for setting in dict.fromkeys(r["setting"] for r in results):
        rows = [r for r in results if r["setting"] == setting]
        base = next(r for r in rows if r["label"] == "honest-only")
        runs = {(r["aggregator"], r["attack"]): r for r in rows if r["label"] != "honest-only"}
        n, k = setting.split(":")
        aggs = list(dict.fromkeys(a for a, _ in runs))
        attacks = list(dict.fromkeys(a for _, a in runs))
        out.append(
            f"#### {n} peers, {k} byzantine (f = {k}); honest-only run ({int(n) - int(k)} peers, "
            f"plain mean): eval loss {base['eval_loss']:.3f}\n"
        )
        out.append("| aggregator | " + " | ".join(attacks) + " | worst - honest-only |")
        out.append("| --- |" + " ---: |" * (len(attacks) + 1))
        for agg in aggs:
            cells, worst = [], -float("inf")
            for a in attacks:
                r = runs.get((agg, a))
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("error")
                else:
                    mark = "" if r["parity"] and r["finite"] else " (!)"
                    mark += "*" if r["skipped_rounds"] else ""
                    cells.append(f"{r['eval_loss']:.3f}{mark}")
                    worst = max(worst, r["eval_loss"])
            delta = f"{worst - base['eval_loss']:+.2f}" if worst > -float("inf") else "-"
            out.append(f"| {agg} | " + " | ".join(cells) + f" | {delta} |")
        skipped = [
            f"{a} / {b}: {r['skipped_rounds']}"
            for (a, b), r in runs.items()
            if r.get("skipped_rounds")
        ]
        if skipped:
            out.append("\n\\* rounds whose update every peer skipped: " + "; ".join(skipped))
        bad = [
            f"{a} / {b}"
            for (a, b), r in runs.items()
            if "error" not in r and not (r["parity"] and r["finite"])
        ]
        if bad:
            out.append("\n(!) peers disagreed or state not finite: " + ", ".join(bad))
        m = runs.get(("mean", "none"))
        if m is not None and "error" not in m:
            ratios = [
                r["bytes_per_peer_round"] / m["bytes_per_peer_round"]
                for (_, a), r in runs.items()
                if a == "none" and "error" not in r
            ]
            out.append(
                f"\nBytes per peer and round without attack: plain mean "
                f"{m['bytes_per_peer_round']:,.0f}; robust rules {min(ratios):.3f} to "
                f"{max(ratios):.3f} times that."
            )
        out.append("")
    return "\n".join(out)


# -- cost without attack ---------------------------------------------------------------------------


def cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    sizes = [int(x) for x in args.sizes.split(",")]
    out: list[dict[str, Any]] = []
    for n in (int(x) for x in args.peers.split(",")):
        f = (n - 3) // 2  # the largest f every listed rule accepts (Krum: n >= 2f + 3)
        groups = local_groups(n, timeout_s=300.0)
        for d in sizes:
            gen = torch.Generator().manual_seed(d)
            updates = [torch.randn(d, generator=gen) for _ in range(n)]
            for agg in args.aggregators:
                reducers = [
                    Reducer(aggregator=None if agg == "mean" else agg, byzantine_f=f)
                    for _ in range(n)
                ]
                times: list[float] = []
                before = [g.stats.bytes_sent for g in groups]

                def one(
                    g: Group,
                    rnd: int,
                    reducers: list[Reducer] = reducers,
                    updates: list[torch.Tensor] = updates,
                ) -> float:
                    g.barrier()
                    t = time.perf_counter()
                    reducers[g.rank].mean(_Round(g, rnd), [("u", updates[g.rank])], contribute=True)
                    reducers[g.rank].commit()
                    return time.perf_counter() - t

                for rnd in range(args.reps):
                    times.append(max(run_parallel(groups, lambda g, r=rnd: one(g, r))))
                sent = [g.stats.bytes_sent - b for g, b in zip(groups, before, strict=True)]
                rec = {
                    "peers": n,
                    "f": f,
                    "d": d,
                    "aggregator": agg,
                    "ms_median": 1000 * statistics.median(times[1:] or times),
                    "bytes_per_peer_round": sum(sent) / n / args.reps,
                }
                out.append(rec)
                print(json.dumps(rec), flush=True)
        for g in groups:
            g.abort("cost benchmark over")
    return out


def cost_markdown(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for n in dict.fromkeys(r["peers"] for r in rows):
        for d in dict.fromkeys(r["d"] for r in rows if r["peers"] == n):
            sel = [r for r in rows if r["peers"] == n and r["d"] == d]
            m = next(r for r in sel if r["aggregator"] == "mean")
            out.append(f"{n} peers (f = {sel[0]['f']}), d = {d:,} float32:\n")
            out.append("| aggregator | bytes/peer/round | vs mean | ms/round | vs mean |")
            out.append("| --- | --- | --- | --- | --- |")
            for r in sel:
                out.append(
                    f"| {r['aggregator']} | {r['bytes_per_peer_round']:,.0f} | "
                    f"{r['bytes_per_peer_round'] / m['bytes_per_peer_round']:.3f} | "
                    f"{r['ms_median']:.1f} | {r['ms_median'] / m['ms_median']:.2f} |"
                )
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="every attack against every aggregator")
    t.add_argument("--settings", default="5:1,7:2", help="PEERS:BYZANTINE,... (f = BYZANTINE)")
    # specs contain commas ("cc:tau=1,iterations=3"): the lists are space-separated
    t.add_argument("--aggregators", nargs="+", default=AGGREGATORS, metavar="SPEC")
    t.add_argument("--attacks", nargs="+", default=ATTACKS, metavar="SPEC")
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--corpus-bytes", type=int, default=400_000)
    t.add_argument("--strategy", default="ddp", choices=["ddp", "diloco"])
    t.add_argument("--sync-every", type=int, default=5, help="DiLoCo's H")
    rep = sub.add_parser("report", help="tables from a JSON file written by train or cost")
    rep.add_argument("inputs", nargs="+", help="later files replace earlier runs of a config")
    c = sub.add_parser("cost", help="bytes and time per round without attack")
    c.add_argument("--peers", default="5,7")
    c.add_argument("--sizes", default=f"{TINY_PARAMS},{DEFAULT_PARAMS}")
    c.add_argument("--aggregators", nargs="+", default=AGGREGATORS, metavar="SPEC")
    c.add_argument("--reps", type=int, default=7)
    for q in (t, c, rep):
        q.add_argument("--json", help="write every record here")
        q.add_argument("--markdown", help="write the tables here (also printed)")
    args = p.parse_args(argv)
    if args.cmd == "report":
        merged: dict[tuple[Any, ...], dict[str, Any]] = {}
        for path in args.inputs:
            for r in json.loads(Path(path).read_text()):
                if "error" in r and "unknown aggregator" in r["error"]:
                    continue  # a spec mangled by an older command line; rerun separately
                key = (
                    r.get("setting"),
                    r.get("peers"),
                    r.get("d"),
                    r["aggregator"],
                    r.get("attack"),
                )
                merged[key] = r
        results = list(merged.values())
        text = markdown(results) if "setting" in results[0] else cost_markdown(results)
        bad = []
    elif args.cmd == "train":
        results = sweep(args)
        text = markdown(results)
        bad = [r for r in results if "error" in r or not (r["parity"] and r["finite"])]
    else:
        results = cost(args)
        text = cost_markdown(results)
        bad = []
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    for r in bad:
        print(f"problem: {r}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
