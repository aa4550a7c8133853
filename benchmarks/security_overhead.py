"""What TLS, join tokens and the authenticated rendezvous cost, against plain HTTP, one shared
token and torch's TCPStore, in one run of this script (issue 21).

    python benchmarks/security_overhead.py [--repeats 3] [--steps 40] [--kill-step 20] [--out DIR]

For each repeat, both setups in turn (secure, plain, secure, plain, ...): a coordinator in this
process and 3 peers of the built-in job (DDP, tiny model); the peer ``b`` SIGKILLs itself inside
the collective of step ``--kill-step``. Figures:

* epoch change: from the coordinator's eviction of ``b`` (its heartbeat socket closed, within
  milliseconds of the kill) to the commit of the round it was in, retried by the survivors in a
  new epoch with new process groups (coordinator clock);
* round latency: the median of the survivors' committed rounds (begin to commit, this peer's
  clock), the rounds that changed epoch left out;
* group formation: 3 ranks (threads of this process, each with its own client) meet through
  the rendezvous, connect a Gloo group and run one all-reduce; the median of 15 epochs;
* store ops: the median of 200 set+get pairs on one client, in this process.

Prints a markdown table and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from isthmus.comm.connect import CoordinatorStores, StoreClients, connect_gloo
from isthmus.comm.wires import Wires
from isthmus.coordinator.auth import join_token
from isthmus.coordinator.client import CoordinatorClient
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.store_client import CoordinatorStore
from isthmus.coordinator.tls import TLSFiles, self_signed
from isthmus.run.job import PeerJob

ADMIN = "benchmark-admin-token"


def coordinator(secure: bool, tls: TLSFiles) -> Coordinator:
    return Coordinator(
        CoordinatorConfig(
            token=ADMIN,
            port=0,
            tls=tls if secure else None,
            rendezvous="coordinator" if secure else "tcpstore",
            heartbeat_interval=0.25,
            membership=MembershipConfig(start_peers=3, heartbeat_timeout=3.0),
        )
    ).start()


def one_run(secure: bool, tls: TLSFiles, steps: int, kill_step: int, out: Path) -> dict[str, Any]:
    c = coordinator(secure, tls)
    procs = {}
    try:
        for name in ("a", "b", "c"):
            faults = [f"kill@collective:step={kill_step}"] if name == "b" else []
            job = PeerJob.from_flat(
                coordinator=c.address,
                token=join_token(ADMIN, name) if secure else ADMIN,
                coordinator_fingerprint=tls.fingerprint if secure else None,
                name=name,
                out_dir=str(out),
                model="tiny",
                corpus_bytes=200_000,
                batch_size=8,
                strategy="ddp",
                steps=steps,
                faults=faults,
                collective_timeout=10.0,
                connect_timeout=10.0,
                round_timeout=60.0,
            )
            path = out / f"{name}.job.json"
            path.write_text(job.to_json())
            with (out / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "isthmus.run.job", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
        for p in procs.values():
            p.wait(300)
        events = c.status(events=10_000)["events"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        c.stop()
    dead = next(e for e in events if e["kind"] == "dead")
    aborted = next(e["round"] for e in events if e["kind"] == "abort")
    commit = next(
        e for e in events if e["kind"] == "commit" and e["round"] == aborted and e["t"] > dead["t"]
    )
    final = json.loads((out / "a.final.json").read_text())
    epochs = {r["round"] for r in final["rounds"] if r["outcome"] == "aborted"}
    lat = [
        r["t_end"] - r["t_start"]
        for r in final["rounds"]
        if r["outcome"] == "committed" and r["round"] not in epochs and r["round"] > 0
    ]
    return {
        "epoch_change_s": commit["t"] - dead["t"],
        "round_latency_ms": 1000 * statistics.median(lat),
        "digest": final["digest"],
    }


def store_ops_ms(secure: bool, tls: TLSFiles, n: int = 200) -> float:
    """Median ms of one set + get on the rendezvous store from one client."""
    c = coordinator(secure, tls)
    client = CoordinatorClient(
        c.address, join_token(ADMIN, "bench"), fingerprint=tls.fingerprint if secure else None
    )
    try:
        if secure:
            pid = client.register("bench").peer_id
            store: dist.Store = CoordinatorStore(client, pid, c.run_id, timeout_s=10)
        else:
            store = dist.TCPStore(
                "127.0.0.1",
                c.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )
        times = []
        prefix = f"isthmus/{c.run_id}/bench/"
        for i in range(n):
            t = time.perf_counter()
            store.set(f"{prefix}{i}", b"10.0.0.1 40000")
            store.get(f"{prefix}{i}")
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)
    finally:
        client.close()
        c.stop()


def formation_s(secure: bool, tls: TLSFiles, epochs: int = 15, world: int = 3) -> float:
    """Median seconds for ``world`` ranks to form a Gloo group through the rendezvous (each
    rank with a client of its own, as peers) and run one all-reduce."""
    c = coordinator(secure, tls)
    clients: list[CoordinatorClient] = []
    rdv: list[Any] = []
    for r in range(world):
        cl = CoordinatorClient(
            c.address, join_token(ADMIN, f"f{r}"), fingerprint=tls.fingerprint if secure else None
        )
        clients.append(cl)
        if secure:
            pid = cl.register(f"f{r}").peer_id
            rdv.append(CoordinatorStores(cl, pid, c.run_id, timeout_s=60))
        else:
            rdv.append(StoreClients("127.0.0.1", c.store_port, timeout_s=60))
    times = []
    try:
        with ThreadPoolExecutor(world) as pool:
            for e in range(epochs):

                def build(r: int, e: int = e) -> Any:
                    w = Wires(f"rank {r}")
                    store = dist.PrefixStore(
                        f"isthmus/{c.run_id}/e{e}/", rdv[r].take(w, lambda: None)
                    )
                    pg = connect_gloo(store, r, world, timeout_s=60, wires=w, hostname="127.0.0.1")
                    pg.allreduce([torch.ones(4)]).wait()
                    return pg

                t = time.perf_counter()
                groups = list(pool.map(build, range(world)))
                times.append(time.perf_counter() - t)
                del groups
                time.sleep(0.3)  # the next TCPStore clients connect ahead, as in a run
    finally:
        for cl in clients:
            cl.close()
        c.stop()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-step", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="isthmus-security-bench-"))
    tls = self_signed(str(out / "tls"))
    results: dict[str, list[dict[str, Any]]] = {"secure": [], "plain": []}
    for i in range(args.repeats):
        for label in ("secure", "plain"):
            d = out / f"{label}{i}"
            d.mkdir(parents=True)
            r = one_run(label == "secure", tls, args.steps, args.kill_step, d)
            print(label, i, r, flush=True)
            results[label].append(r)
    ops = {label: store_ops_ms(label == "secure", tls) for label in ("secure", "plain")}
    form = {label: formation_s(label == "secure", tls) for label in ("secure", "plain")}
    digests = {r["digest"] for rs in results.values() for r in rs}
    (out / "results.json").write_text(
        json.dumps({"runs": results, "store_ops_ms": ops, "formation_s": form}, indent=1)
    )
    print()
    print(
        "| setup | epoch change (s), median [min-max] | round latency (ms), median | "
        "group formation (s) | store set+get (ms) |"
    )
    print("|---|---|---|---|---|")
    names = {
        "secure": "TLS + join tokens + coordinator rendezvous",
        "plain": "HTTP + one token + TCPStore",
    }
    for label, rs in results.items():
        ec = [r["epoch_change_s"] for r in rs]
        rl = [r["round_latency_ms"] for r in rs]
        print(
            f"| {names[label]} | {statistics.median(ec):.3f} [{min(ec):.3f}-{max(ec):.3f}] | "
            f"{statistics.median(rl):.1f} | {form[label]:.3f} | {ops[label]:.2f} |"
        )
    print(f"\nfinal digests: {len(digests)} distinct over {sum(map(len, results.values()))} runs")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
