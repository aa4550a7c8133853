"""The ring order the coordinator picks from link bandwidths against a random order, in one run.

Builds a scenario's network (default ``scenarios/two_region.toml``: 2 + 2 peers, 1 Gbit/s inside
each region, 50 Mbit/s and 80 ms between), takes each pair's bandwidth from the scenario (the
slowest of the two peers' links and, between sites, the site link), orders the ring with
:func:`isthmus.coordinator.ring.order_ring`, draws a random order that makes a worse ring (for 2 + 2 peers: one that crosses four times), and times a raw
Gloo fp32 all-reduce in each order, alternating within every repetition (so both see the same
conditions; the slowest peer counts, median over repetitions). A group's ranks are the order, so
Gloo's ring runs around it. Needs root (network namespaces); prints a table and writes JSON.

    sudo .venv/bin/python benchmarks/ring_order.py [--scenario FILE] [--size-mb 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def pair_rates_mbit(network: Any) -> dict[tuple[int, int], float]:
    """Each ordered pair's bandwidth in Mbit/s from a scenario's ``[network]``: the slower of the
    two peers' own links and, across sites, the site link (unshaped links count as 10 Gbit/s)."""
    cap = 10_000.0
    own = [cap if r is None else r / 1e6 for r in network.rates_bps]
    site_of: dict[int, str] = {}
    between: dict[frozenset[str], float] = {}
    if network.sites is not None:
        for s in network.sites.sites:
            site_of.update({p: s.name for p in s.peers})
        for link in network.sites.links:
            between[frozenset(link.sites)] = cap if link.rate_bps is None else link.rate_bps / 1e6
    out = {}
    for a in range(network.peers):
        for b in range(network.peers):
            if a != b:
                r = min(own[a], own[b])
                sa, sb = site_of.get(a), site_of.get(b)
                if sa != sb and sa is not None and sb is not None:
                    r = min(r, between.get(frozenset((sa, sb)), cap))
                out[(a, b)] = r
    return out


def _worker(job_path: str, peer: int) -> None:
    """One peer: two Gloo groups (ranks in each order) timed alternately; writes its JSON."""
    import torch
    import torch.distributed as dist

    from isthmus.comm.group import build_process_group

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    n, timeout = len(job["orders"]["measured"]), float(job["timeout_s"])
    store = dist.TCPStore(
        job["store_host"],
        job["store_port"],
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    pgs = {
        name: build_process_group(
            dist.PrefixStore(f"{name}/", store),
            order.index(peer),
            n,
            timeout_s=timeout,
            hostname=job["hosts"][peer],
        )
        for name, order in sorted(job["orders"].items())
    }
    numel = int(job["size_mb"] * 1e6 / 4)
    buf = torch.randn(numel, generator=torch.Generator().manual_seed(peer))
    tiny = torch.zeros(1)
    times: dict[str, list[float]] = {name: [] for name in pgs}
    for i in range(job["warmup"] + job["reps"]):
        for name, pg in sorted(pgs.items()):
            pg.allreduce([tiny]).wait()  # every peer starts together
            t = time.perf_counter()
            pg.allreduce([buf]).wait()
            if i >= job["warmup"]:
                times[name].append(time.perf_counter() - t)
    (Path(job["out"]) / f"peer{peer}.json").write_text(json.dumps(times))


def run(scenario: Path, size_mb: float, reps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Build the network, run the peers, return the result (raises RuntimeError if a peer
    fails or does not finish within the bound)."""
    import torch.distributed as dist

    from isthmus.coordinator.ring import crossings, order_ring, ring_key
    from isthmus.lab.netns import inside_namespace
    from isthmus.lab.scenario import load_scenario
    from isthmus.lab.wan import WanNetwork

    network = load_scenario(scenario).network
    rates = pair_rates_mbit(network)
    n = network.peers
    measured = order_ring(range(n), rates)
    rng = random.Random(seed)
    rand = measured
    while sorted(ring_key(rand, rates)) == sorted(ring_key(measured, rates)):
        rand = rng.sample(range(n), n)  # a random order that is not as good a ring
    orders = {"measured": measured, "random": rand}
    region = {}
    if network.sites is not None:
        region = {p: s.name for s in network.sites.sites for p in s.peers}
    bound = 60 + (warmup + reps) * 2 * 3 * size_mb * 8 / min(rates.values())
    with WanNetwork.from_spec(network, prefix="isthr") as net, tempfile.TemporaryDirectory() as tmp:
        with inside_namespace(net.coordinator.netns):
            store = dist.TCPStore(
                net.coordinator.ip,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=bound),
            )
        job = {
            "orders": orders,
            "hosts": [p.ip for p in net.peers],
            "store_host": net.coordinator.ip,
            "store_port": store.port,
            "size_mb": size_mb,
            "reps": reps,
            "warmup": warmup,
            "timeout_s": bound,
            "out": tmp,
        }
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
        procs = [net.popen(i, [*argv, str(i)], env={"OMP_NUM_THREADS": "1"}) for i in range(n)]
        for i, p in enumerate(procs):
            try:
                if p.wait(bound) != 0:
                    raise RuntimeError(f"peer {i} exited with {p.returncode}")
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"peer {i} did not finish within {bound:.0f}s") from None
        per = [json.loads((Path(tmp) / f"peer{i}.json").read_text()) for i in range(n)]
    out: dict[str, Any] = {"scenario": str(scenario), "size_mb": size_mb, "reps": reps, "peers": n}
    for name, order in orders.items():
        t = statistics.median(max(ts) for ts in zip(*(p[name] for p in per), strict=True))
        out[name] = {
            "order": order,
            "crossings": crossings(order, region) if region else None,
            "bottleneck_mbit": min(ring_key(order, rates)),
            "time_s": round(t, 3),
            "busbw_mbit": round(2 * (n - 1) / n * 8 * size_mb * 1e6 / t / 1e6, 2),
        }
    out["speedup"] = round(out["random"]["time_s"] / out["measured"]["time_s"], 3)
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=ROOT / "scenarios" / "two_region.toml")
    ap.add_argument("--size-mb", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = ap.parse_args()
    r = run(a.scenario, a.size_mb, a.reps, a.warmup, a.seed)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    print(
        f"{r['peers']} peers, {r['size_mb']:g} MB fp32 all-reduce, raw Gloo, median of {r['reps']}"
    )
    for name in ("measured", "random"):
        x = r[name]
        print(
            f"  {name:8s} order {x['order']}: crossings {x['crossings']}, bottleneck "
            f"{x['bottleneck_mbit']:g} Mbit/s, {x['time_s']:.3f} s, bus bandwidth {x['busbw_mbit']:.1f} Mbit/s"
        )
    print(f"  measured order is {r['speedup']:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
