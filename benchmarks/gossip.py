"""Gossip benchmark: eval loss against bytes per topology and schedule, against DDP; then a
quarter of the peers dropped mid-run, data-holding peers against connectivity-only peers.

Every run is a real isthmus run: an embedded coordinator and ``--peers`` peer processes (this
script, ``worker`` mode) training the tiny GPT with AdamW on the stdlib corpus, split *non-IID*:
data-holding peer ``k`` trains only on the ``k``-th contiguous part of the corpus. The part is
pinned to the peer (by its peer id, not its rank), so when a data-holding peer dies its data is
gone for good, as in "Exploring the Impact of Disrupted Peer-to-Peer Communications on Fully
Decentralized Learning in Disaster Scenarios" (2023). Each peer evaluates its own model every
``--eval-every`` steps on the same held-out batches and records the bytes it has sent so far
(Gloo wire bytes as counted by ``Group``, no TCP headers); a run's curve is the mean of the
peers' eval losses against the sum of their bytes. The last point is the model after the final
merge, identical on every surviving peer (checked through ``model_digest``).

Experiments:

* ``topologies``: every topology with the same schedule, every schedule on the
  Barabasi-Albert graph, and DDP, all peers holding data.
* ``drop``: Barabasi-Albert graph (rebuild mode ``repair``: surviving edges are kept, the fewest
  edges are added to reconnect), the two best-connected peers of the initial graph carry only
  connectivity (``train=False``: they mix and relay but hold no data), the others hold one shard
  each. At ``--drop-at`` a quarter of the peers is SIGKILLed: either the connectivity-only peers
  or as many data-holding peers (the best-connected ones among them); plus a run without drops.

Usage (the figures in docs/BENCHMARKS.md)::

    .venv/bin/python benchmarks/gossip.py all --steps 240 --out /tmp/gossip-bench \\
        --json docs/benchmarks/gossip.json

Times are wall-clock on a shared 2-core machine: they are reported, never compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKEN = "gossip-benchmark"
HERE = Path(__file__).resolve()


# -- one peer ------------------------------------------------------------------------------------


def train_peer(job: dict[str, Any], session: Any, corpus: Any) -> None:
    """Train one peer until the run's step counter reaches ``steps`` (or until its ``kill_at``
    step, in thread mode), writing ``<name>.jsonl`` (eval points) and ``<name>.final.json``."""
    import torch

    from isthmus.data import evaluate
    from isthmus.models import GPT, GPTConfig
    from isthmus.run.job import model_digest
    from isthmus.strategies import make_strategy

    out = Path(job["out_dir"])
    cfg = GPTConfig.tiny()
    model = GPT(cfg, seed=job["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    pid = int(session.peer_id)
    if str(pid) not in job["roles"]:
        # roles, data shards and the initial graph are keyed by the ids a fresh coordinator hands
        # out (0..peers-1); a peer evicted during start-up comes back with a new id
        raise RuntimeError(
            f"peer id {pid} outside 0..{len(job['roles']) - 1}: peers were evicted and renumbered "
            f"during start-up; rerun with a larger --heartbeat-timeout"
        )
    role = job["roles"][str(pid)]
    options = dict(job["options"])
    if job["strategy"] == "gossip":
        options["total_steps"] = job["steps"]
    strategy = make_strategy(
        job["strategy"], session, model, opt, compression=job.get("compression"), **options
    )
    data = role.get("data")
    if data is None:
        strategy.train = False  # type: ignore[attr-defined]
    kill_at = role.get("kill_at") if job["threads"] else None
    records = (out / f"{job['name']}.jsonl").open("w", buffering=1)

    def record(step: int) -> None:
        loss = evaluate(model, corpus, batch_size=16, n_batches=job["eval_batches"])
        rec = {"peer": pid, "step": step, "bytes": session.stats.bytes_sent, "eval_loss": loss}
        records.write(json.dumps(rec) + "\n")

    t0 = time.monotonic()
    record(0)
    try:
        while strategy.step_count < job["steps"]:
            step = strategy.step_count
            if step == kill_at:
                return  # this peer is gone: no final record, its bytes stay in the jsonl
            if data is not None:
                x, y = corpus.batch(
                    step=step,
                    rank=data,
                    world=job["data_world"],
                    batch_size=job["batch_size"],
                    block_size=cfg.block_size,
                    seed=job["seed"],
                    shard="contiguous",
                )
                _, loss = model(x, y)
                assert loss is not None
                loss.backward()
            strategy.step()
            opt.zero_grad(set_to_none=False)
            done = strategy.step_count
            # every eval_every steps, and once more just before the last step (and its merge)
            if (
                done != step
                and done < job["steps"]
                and (done % job["eval_every"] == 0 or done == job["steps"] - 1)
            ):
                record(done)
        strategy.finish()
        final = {
            "peer": pid,
            "name": job["name"],
            "role": role,
            "step": strategy.step_count,
            "bytes": session.stats.bytes_sent,
            "bytes_by_op": dict(session.stats.by_op),
            "eval_loss": evaluate(model, corpus, batch_size=16, n_batches=job["eval_batches"]),
            "model_digest": model_digest(model),
            "wall_s": round(time.monotonic() - t0, 2),
            "metrics": strategy.metrics(),
        }
        (out / f"{job['name']}.final.json").write_text(json.dumps(final, indent=1))
    finally:
        records.close()


def worker(job_path: str) -> int:
    """Process mode: one peer process with a real session (kills are real SIGKILLs)."""
    import torch

    from isthmus.comm.faults import Fault, FaultInjector
    from isthmus.comm.session import Session, SessionConfig
    from isthmus.data import Corpus

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    corpus = Corpus.from_stdlib(max_bytes=job["corpus_bytes"], seed=0)
    session = Session(
        SessionConfig(
            coordinator=job["coordinator"],
            token=TOKEN,
            name=job["name"],
            collective_timeout=30.0,
            round_timeout=600.0,
        )
    )
    kill_at = job["roles"][str(session.peer_id)].get("kill_at")
    if kill_at is not None:
        session.faults = FaultInjector([Fault.parse(f"kill@step:step={kill_at}")])
    try:
        train_peer(job, session, corpus)
    finally:
        session.close()
    return 0


class ThreadSession:
    """Thread mode's stand-in for a Session: every round commits; the round's group and members
    follow the run's membership timeline (all peers until the drop step, the survivors after),
    which is what the coordinator would form once it noticed the dead peers. Bytes are counted
    by the real Gloo groups, into one :class:`CommStats` per peer across epochs."""

    def __init__(self, peer_id: int, epochs: list[tuple[int, tuple[int, ...], list[Any]]]) -> None:
        from isthmus.comm.faults import FaultInjector
        from isthmus.comm.group import CommStats
        from isthmus.comm.state import SharedState

        self.peer_id = peer_id
        self.epochs = epochs  # (last step counter value of the epoch, members, groups by rank)
        self.state, self.faults, self.stats = SharedState(), FaultInjector(), CommStats()
        self.revision = 0
        self.rank, self.world = 0, 1

    def register(self, name: str, tensor: Any) -> None:
        self.state.register(name, tensor)

    def run_round(self, fn: Any) -> Any:
        step = int(self.state["meta/step"])
        _, members, groups = next(e for e in self.epochs if step <= e[0])
        group = groups[members.index(self.peer_id)]
        group.stats = self.stats  # count this peer's bytes in one place across epochs
        rnd = _ThreadRound(self, group, members)
        out = fn(rnd)
        self.revision += 1
        self.rank, self.world = group.rank, group.world
        return out


class _ThreadRound:
    def __init__(self, session: ThreadSession, group: Any, members: tuple[int, ...]) -> None:
        self.group, self.plan = group, _Plan(members)
        self.number, self.epoch, self.resynced = session.revision, 0, False
        self.rank, self.world = group.rank, group.world

    def check_faults(self, point: str, *, step: int | None = None) -> None:
        pass


@dataclass
class _Plan:
    members: tuple[int, ...]


def run_threads(spec: RunSpec, args: argparse.Namespace, out: Path) -> list[int]:
    import threading

    import torch

    from isthmus.data import Corpus
    from isthmus.testing import local_groups

    torch.set_num_threads(1)
    corpus = Corpus.from_stdlib(max_bytes=args.corpus_bytes, seed=0)
    everyone = tuple(range(args.peers))
    victims = {i for i, r in spec.roles.items() if r.get("kill_at") is not None}
    epochs: list[tuple[int, tuple[int, ...], list[Any]]] = []
    if victims:
        survivors = tuple(i for i in everyone if i not in victims)
        epochs.append((args.drop_at, everyone, local_groups(len(everyone))))
        epochs.append((1 << 62, survivors, local_groups(len(survivors))))
    else:
        epochs.append((1 << 62, everyone, local_groups(len(everyone))))
    if spec.strategy != "gossip" and victims:
        raise ValueError("thread mode simulates drops for gossip only")
    errors: list[BaseException] = []

    def peer(i: int) -> None:
        try:
            train_peer(_job(spec, args, out, i, threads=True), ThreadSession(i, epochs), corpus)
        except BaseException as e:  # reported after the join
            errors.append(e)
            for _, _, groups in epochs:
                for g in groups:
                    g.abort(f"peer {i} failed")

    threads = [threading.Thread(target=peer, args=(i,), daemon=True) for i in everyone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout)
    if errors:
        raise errors[0]
    return [0 if (out / f"peer{i}.final.json").exists() else -9 for i in everyone]


def _job(
    spec: RunSpec, args: argparse.Namespace, out: Path, i: int, *, threads: bool
) -> dict[str, Any]:
    return {
        "name": f"peer{i}",
        "out_dir": str(out),
        "strategy": spec.strategy,
        "options": spec.options,
        "roles": {str(k): v for k, v in spec.roles.items()},
        "data_world": spec.data_world,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": 0,
        "corpus_bytes": args.corpus_bytes,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "threads": threads,
        "compression": spec.compression,
    }


# -- one run -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunSpec:
    name: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    roles: dict[int, dict[str, Any]] = field(default_factory=dict)
    """peer id -> {"data": shard index or None (connectivity only), "kill_at": step or None}"""
    data_world: int = 8
    compression: str | None = None


def run_one(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Run the peers of one run (threads, or processes with ``--processes``) and summarize."""
    out = Path(args.out) / spec.name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json*"):
        old.unlink()
    t0 = time.monotonic()
    if not args.processes:
        codes = run_threads(spec, args, out)
        return summarize(spec, out, codes, None, time.monotonic() - t0)
    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    coord = Coordinator(
        CoordinatorConfig(
            token=TOKEN,
            port=0,
            heartbeat_interval=0.25,
            # a killed peer is noticed at once (its heartbeat connection closes); the long
            # timeout only keeps slow-starting peers on a loaded machine from being evicted
            membership=MembershipConfig(
                start_peers=args.peers, heartbeat_timeout=args.heartbeat_timeout
            ),
        )
    ).start()
    procs = []
    try:
        for i in range(args.peers):
            job = {**_job(spec, args, out, i, threads=False), "coordinator": coord.address}
            path = out / f"peer{i}.job.json"
            path.write_text(json.dumps(job))
            log = (out / f"peer{i}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), "worker", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
            log.close()
        codes = [p.wait(args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        status = coord.status(events=0)
        coord.stop()
    return summarize(spec, out, codes, status, time.monotonic() - t0)


def summarize(
    spec: RunSpec, out: Path, codes: list[int], status: dict[str, Any] | None, wall: float
) -> dict[str, Any]:
    curves: dict[int, list[dict[str, Any]]] = {}
    for f in out.glob("peer*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            curves.setdefault(r["peer"], []).append(r)
    finals = [json.loads(f.read_text()) for f in sorted(out.glob("peer*.final.json"))]
    steps = sorted({r["step"] for c in curves.values() for r in c})
    points = []
    for s in steps:
        losses = [r["eval_loss"] for c in curves.values() for r in c if r["step"] == s]
        # a dead peer's bytes stay counted at its last record
        sent = sum(
            max((r["bytes"] for r in c if r["step"] <= s), default=0) for c in curves.values()
        )
        points.append({"step": s, "bytes": sent, "mean_eval_loss": sum(losses) / len(losses)})
    final_bytes = sum(f["bytes"] for f in finals) + sum(
        max(r["bytes"] for r in c)
        for pid, c in curves.items()
        if pid not in {f["peer"] for f in finals}
    )
    digests = {f["model_digest"] for f in finals}
    if finals and len(digests) == 1:
        points.append(
            {
                "step": finals[0]["step"],
                "bytes": final_bytes,
                "mean_eval_loss": finals[0]["eval_loss"],
                "merged": True,
            }
        )
    m0 = finals[0]["metrics"] if finals else {}
    summary = {
        "name": spec.name,
        "strategy": spec.strategy,
        "options": spec.options,
        "peers_finished": len(finals),
        "exit_codes": codes,
        "identical_after_merge": len(digests) == 1,
        "final_eval_loss": finals[0]["eval_loss"] if finals and len(digests) == 1 else None,
        "final_bytes": final_bytes,
        "merge_consensus_distance": m0.get("merge_consensus_distance"),
        "rounds_by_kind": m0.get("rounds_by_kind"),
        "rounds_committed": status["counters"].get("rounds_committed") if status else None,
        "rounds_aborted": status["counters"].get("rounds_aborted") if status else None,
        "graph": m0.get("graph"),
        "graph_changes": m0.get("graph_changes"),
        "curve": points,
        "wall_s": round(wall, 1),
    }
    return summary


# -- experiments -----------------------------------------------------------------------------------


def _ba_graph(peers: int, m: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """The initial Barabasi-Albert graph over peer ids 0..peers-1 (a fresh coordinator numbers
    the peers in registration order, so the ids are exactly these)."""
    from isthmus.strategies.gossip.math import PeerGraph, TopologySpec

    seq, _ = PeerGraph(TopologySpec(name="barabasi_albert", seed=seed, options={"m": m})).plan(
        range(peers)
    )
    top = seq.at(0)
    return [top.degree(i) for i in range(peers)], [list(e) for e in top.edges()]


def topology_runs(args: argparse.Namespace) -> list[RunSpec]:
    data = {i: {"data": i} for i in range(args.peers)}
    every = f"constant:every={args.every}"
    runs = [RunSpec(name="ddp", strategy="ddp", roles=data, data_world=args.peers)]
    for top in ("ring", "torus", "exponential", "barabasi_albert", "complete"):
        runs.append(
            RunSpec(
                name=f"{top}-{every}",
                strategy="gossip",
                options={"topology": top, "schedule": every, "seed": args.seed},
                roles=data,
                data_world=args.peers,
            )
        )
    runs.append(
        RunSpec(
            name=f"barabasi_albert-{every}-int8",
            strategy="gossip",
            options={"topology": "barabasi_albert", "schedule": every, "seed": args.seed},
            roles=data,
            data_world=args.peers,
            compression="int8",
        )
    )
    for sched in ("constant:every=1", args.late_heavy, "single_merge"):
        runs.append(
            RunSpec(
                name=f"barabasi_albert-{sched}",
                strategy="gossip",
                options={"topology": "barabasi_albert", "schedule": sched, "seed": args.seed},
                roles=data,
                data_world=args.peers,
            )
        )
    return runs


def drop_runs(args: argparse.Namespace) -> list[RunSpec]:
    degrees, _ = _ba_graph(args.peers, 2, args.seed)
    by_degree = sorted(range(args.peers), key=lambda i: (-degrees[i], i))
    drop = max(1, args.peers // 4)
    relays = sorted(by_degree[:drop])
    holders = [i for i in range(args.peers) if i not in relays]
    data_victims = sorted([i for i in by_degree if i in holders][:drop])

    def roles(victims: list[int]) -> dict[int, dict[str, Any]]:
        return {
            i: {
                "data": holders.index(i) if i in holders else None,
                "kill_at": args.drop_at if i in victims else None,
                "degree": degrees[i],
            }
            for i in range(args.peers)
        }

    options = {
        "topology": "barabasi_albert",
        "schedule": f"constant:every={args.every}",
        "rebuild": "repair",
        "seed": args.seed,
    }
    return [
        RunSpec(
            name=f"drop-{label}",
            strategy="gossip",
            options=options,
            roles=roles(v),
            data_world=len(holders),
        )
        for label, v in (
            ("none", []),
            ("connectivity-only", relays),
            ("data-holding", data_victims),
        )
    ]


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| run | final eval loss (merged) | total bytes sent | consensus distance before merge | rounds (gossip/merge) | peers finished |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        kinds = r.get("rounds_by_kind") or {}
        cd = r.get("merge_consensus_distance")
        lines.append(
            f"| {r['name']} | {r['final_eval_loss']:.4f} | {r['final_bytes'] / 1e6:.1f} MB | "
            f"{'-' if cd is None else f'{cd:.4f}'} | "
            f"{kinds.get('gossip', '-')}/{kinds.get('merge', '-')} | {r['peers_finished']} |"
            if r["final_eval_loss"] is not None
            else f"| {r['name']} | (not identical) | {r['final_bytes'] / 1e6:.1f} MB | - | - | {r['peers_finished']} |"
        )
    return "\n".join(lines)


def curves_markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| run | step: mean eval loss @ MB sent |", "|---|---|"]
    for r in results:
        pts = ", ".join(
            f"{p['step']}{' merged' if p.get('merged') else ''}: {p['mean_eval_loss']:.3f} @ "
            f"{p['bytes'] / 1e6:.1f}"
            for p in r["curve"]
        )
        lines.append(f"| {r['name']} | {pts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("experiment", choices=["topologies", "drop", "all"])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--every", type=int, default=4, help="gossip period of the constant schedule")
    p.add_argument("--late-heavy", default="late_heavy:start_every=16,end_every=1")
    p.add_argument("--drop-at", type=int, default=None, help="default: steps // 2")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=800_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated run names to keep")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument(
        "--heartbeat-timeout", type=float, default=30.0, help="process mode: coordinator's"
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="one process per peer with an embedded coordinator and real SIGKILLs (slow to "
        "start on a loaded machine) instead of threads in this process",
    )
    p.add_argument("--out", default="/tmp/gossip-bench")
    p.add_argument("--json", default=None, help="also write every result here")
    args = p.parse_args(argv)
    if args.drop_at is None:
        args.drop_at = args.steps // 2
    runs: list[RunSpec] = []
    if args.experiment in ("topologies", "all"):
        runs += topology_runs(args)
    if args.experiment in ("drop", "all"):
        runs += drop_runs(args)
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r.name in keep]
    results = []
    for spec in runs:
        print(f"running {spec.name} ...", file=sys.stderr, flush=True)
        r = run_one(spec, args)
        r["roles"] = {str(k): v for k, v in spec.roles.items()}
        results.append(r)
        print(
            f"  {r['name']}: eval {r['final_eval_loss']}, {r['final_bytes'] / 1e6:.1f} MB, "
            f"{r['peers_finished']} finished, {r['wall_s']} s",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1, default=str)
        )
    print(markdown(results))
    print()
    print(curves_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
