"""How the coordinator scales with the number of peers: 10, 100, 1,000 protocol-only peers on
loopback (``coordinator_swarm.py``: registration, heartbeats over the websocket, begin and
commit with hashes, the same messages real peers send, no torch).

    python benchmarks/coordinator_scale.py [--peers 10,100,1000] [--rounds 30] [--procs 2]
        [--idle 5] [--mode two|one|both] [--transport frames|http] [--profile DIR]
        [--heartbeat-timeout S] [--parity-every K] [--json FILE]

For each size: a coordinator in a process of its own (its defaults, but ``start_peers`` = the
size so that the first round waits for everyone), and the peers spread over ``--procs`` client
processes (one asyncio loop each). Every peer registers and opens its heartbeat websocket; for
``--idle`` seconds only heartbeats flow (the heartbeat fan-in: heartbeats per second and the
coordinator's CPU per heartbeat); then every peer runs ``--rounds`` rounds back to back (begin
with hashes, commit at once, begin again), the first ``--warmup`` of them not counted. With
``--mode one`` each peer's ``ok`` rides in its next begin (``Begin.prev``: one request per
member and round; the last round is committed with a commit); ``--mode both`` measures the two
modes back to back for each size. With ``--transport frames`` (the default) begin and commit
go as frames on each peer's heartbeat websocket where the coordinator lists ``ws-rounds`` (as
a real peer's client sends them), else as HTTP requests; ``--transport http`` always uses
HTTP. The ``transport`` of each result says which one the peers used.

Figures (per counted round): formation latency, from the last member's begin sent to the last
member's ``go`` received; commit latency, from the last commit sent to the last ``committed``
received (with the vote in the begin: from the last carrying begin sent to the last answer
that the round committed, which is also the next round's formation); the round's wall time (last ``committed`` to last ``committed``); the coordinator's
CPU time (user + system of its whole process, sampled in the process at every commit; each
counted round's in ``cpu_ms_by_round``), the part of it spent in the cyclic garbage collector
(``gc_ms_per_round``; ``gc_by_generation``: passes and seconds of each generation over the
whole run); the begins that carried the full list of hashes rather than its digest
(``hash_lists_per_round``: every begin's list where the coordinator does not list
``hash-digest``, else the first begins' and those asked); and its RSS at the end. ``--profile DIR`` runs the coordinator under cProfile from the commit of
round ``--warmup`` on (the counted rounds only: not the registrations nor the first rounds) and
writes
``DIR/coordinator-<n>.pstats`` (and the top functions by cumulative time on stdout).

Join tokens: each peer registers with a join token of its own (a realistic large run; the
admin token's request and registration buckets are shared by every peer that uses it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _light_import() -> None:
    """Make ``isthmus`` an empty package object, so that its subpackages import without the
    package's ``__init__`` (which imports the whole public API, and torch)."""
    if "isthmus" not in sys.modules:
        import types

        pkg = types.ModuleType("isthmus")
        pkg.__path__ = [str(Path(__file__).resolve().parents[1] / "src" / "isthmus")]
        sys.modules["isthmus"] = pkg


# The driver and its client processes (spawned: they import this module again) never import
# torch; the coordinator's own process ("serve") imports the real package.
if len(sys.argv) < 2 or sys.argv[1] != "serve":
    _light_import()

TOKEN = "scale-bench-token"


# -- the coordinator's process ---------------------------------------------------------------
def serve(
    port: int,
    peers: int,
    out: Path,
    profile: Path | None,
    warmup: int = 0,
    heartbeat_timeout: float = 0.0,
    parity_every: int = 1,
) -> None:
    """Run a coordinator on ``port`` until stdin closes, then write what it measured to
    ``out`` (JSON): the CPU time and clock at every commit, RSS, counters.
    ``heartbeat_timeout``: the membership's bound, where positive (else its default);
    ``parity_every``: the membership's, hashes checked every this many rounds."""
    import cProfile
    import gc
    import resource
    import threading

    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    cfg = CoordinatorConfig(
        token=TOKEN,
        host="127.0.0.1",
        port=port,
        membership=MembershipConfig(
            start_peers=peers,
            start_timeout=600.0,
            **({"heartbeat_timeout": heartbeat_timeout} if heartbeat_timeout > 0 else {}),
            **({"parity_every": parity_every} if parity_every > 1 else {}),
        ),
    )
    coord = Coordinator(cfg)
    commits: list[tuple[int, float, float]] = []
    m = coord.membership
    commit_round = m.commit_round

    prof = cProfile.Profile() if profile is not None else None

    gc_s = [0.0, 0.0]  # seconds in the cyclic garbage collector, and the start of a pass
    gc_gens = [[0, 0.0] for _ in range(3)]  # passes and seconds of each generation

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_s[1] = time.process_time()
        else:
            spent = time.process_time() - gc_s[1]
            gc_s[0] += spent
            gen = gc_gens[info["generation"]]
            gen[0] += 1
            gen[1] += spent

    gc.callbacks.append(gc_timer)

    def timed_commit(now: float) -> None:
        commit_round(now)
        commits.append((m.revision, time.process_time(), time.monotonic(), gc_s[0]))
        if prof is not None and m.revision == warmup:
            prof.enable()  # on the loop's thread, which runs the rounds

    m.commit_round = timed_commit  # type: ignore[method-assign]

    def report() -> None:
        status = coord.status(events=0)
        with open("/proc/self/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        tmp = out.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "commits": commits,
                    "rss_mb": rss_kb / 1024,
                    "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "counters": status["counters"],
                    "gc_by_generation": gc_gens,
                }
            )
        )
        os.replace(tmp, out)  # whole, or not there

    def stop_on_eof() -> None:
        sys.stdin.read()
        report()  # before stopping: closing a thousand sockets may take a while
        coord.stop()

    threading.Thread(target=stop_on_eof, daemon=True).start()
    coord.serve_forever()
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(profile))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


# -- a client process ------------------------------------------------------------------------
def client_main(
    base: str,
    names: list[str],
    rounds: int,
    limit_s: float,
    conn: Any,
    carry: bool = False,
    frames: bool = True,
    parity_every: int = 1,
) -> None:
    """Host the peers ``names`` in this process: register them, connect their heartbeats, say
    ``ready``, wait for ``go``, run ``rounds`` rounds and send back every peer's round times.
    ``carry``: each vote rides in the next begin (one request per round); ``frames``: begin
    and commit as websocket frames where the coordinator offers them."""
    import asyncio

    from coordinator_swarm import ProtoPeer, SwarmConfig, open_session

    from isthmus.coordinator.auth import join_token

    async def main() -> None:
        async with open_session() as session:
            cfg = SwarmConfig(vote_in_begin=carry, frames=frames, parity_every=parity_every)
            peers = [ProtoPeer(base, join_token(TOKEN, n), n, session, cfg) for n in names]
            for i in range(0, len(peers), 50):  # not all at once: the loop's accept backlog
                await asyncio.gather(*(p.register() for p in peers[i : i + 50]))
            for i in range(0, len(peers), 50):
                await asyncio.gather(*(p.connect() for p in peers[i : i + 50]))
            conn.send(("ready", 0))
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "count":
                    conn.send(("count", sum(p.heartbeats for p in peers)))
                elif cmd == "go":
                    break
            deadline = time.monotonic() + limit_s
            beats_before = sum(p.heartbeats for p in peers)
            await asyncio.gather(*(p.run_until(rounds, deadline) for p in peers))
            beats = (
                sum(p.heartbeats for p in peers) - beats_before,
                sum(getattr(p, "infos_in_begins", 0) for p in peers),
                sum(getattr(p, "lists_sent", 0) for p in peers),
            )
            lost = (sum(p.evictions for p in peers), sum(p.failures for p in peers))
            assert not carry or all(p.carries() for p in peers), "vote-in-begin not listed"
            framed = sum(p.frames_sent for p in peers)
            kinds: dict[str, int] = {}
            for p in peers:
                for k, v in p.failure_kinds.items():
                    kinds[k] = kinds.get(k, 0) + v
            rounds_of = [[vars(r) for r in p.rounds] for p in peers]
            conn.send(("rounds", (rounds_of, lost, framed, kinds, beats)))
            await asyncio.gather(*(p.close() for p in peers))

    asyncio.run(main())


# -- the driver ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(
    n: int,
    *,
    rounds: int,
    warmup: int,
    procs: int,
    idle: float,
    limit_s: float,
    profile: Path | None,
    carry: bool = False,
    frames: bool = True,
    heartbeat_timeout: float = 0.0,
    parity_every: int = 1,
) -> dict[str, Any]:
    port = _free_port()
    out = Path(f"/tmp/coordinator-scale-{os.getpid()}-{n}.json")
    path = [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "serve",
            *(
                str(x)
                for x in (port, n, out, profile or "", warmup, heartbeat_timeout, parity_every)
            ),
        ],
        stdin=subprocess.PIPE,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/healthz", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the coordinator did not start") from None
            time.sleep(0.2)
    rss0 = _rss_mb(server.pid)
    ctx = mp.get_context("spawn")
    names = [f"p{i:05d}" for i in range(n)]
    k = max(1, min(procs, n))
    pipes, workers = [], []
    for j in range(k):
        a, b = ctx.Pipe()
        w = ctx.Process(
            target=client_main,
            args=(base, names[j::k], rounds, limit_s, b, carry, frames, parity_every),
            daemon=True,
        )
        w.start()
        pipes.append(a)
        workers.append(w)
    t_reg = time.monotonic()
    for a in pipes:
        assert a.recv()[0] == "ready"
    t_reg = time.monotonic() - t_reg
    rss_reg = _rss_mb(server.pid)

    def beats() -> int:
        for a in pipes:
            a.send("count")
        return sum(a.recv()[1] for a in pipes)

    time.sleep(1.0)
    b0, c0, t0 = beats(), _cpu_s(server.pid), time.monotonic()
    time.sleep(idle)
    b1, c1, t1 = beats(), _cpu_s(server.pid), time.monotonic()
    for a in pipes:
        a.send("go")
    records: list[dict[str, Any]] = []
    evicted = failed = framed = 0
    failure_kinds: dict[str, int] = {}
    t_rounds = time.monotonic()
    round_beats = carried = lists = 0
    for a in pipes:
        kind, (per_peer, (ev, fails), sent, kinds, (hb, infos, full)) = a.recv()
        assert kind == "rounds"
        round_beats += hb
        carried += infos
        lists += full
        evicted += ev
        failed += fails
        framed += sent
        for what, v in kinds.items():
            failure_kinds[what] = failure_kinds.get(what, 0) + v
        for rs in per_peer:
            records.extend(rs)
    t_rounds = time.monotonic() - t_rounds
    rss_end = _rss_mb(server.pid)
    server.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()  # its figures are written; its shutdown is not what is measured
    for w in workers:
        w.join(10)
    stats = json.loads(out.read_text())
    out.unlink()
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["outcome"] == "committed":
            by_round.setdefault(r["round"], []).append(r)
    counted = [r for r in sorted(by_round) if r >= warmup]
    if not counted:
        return {
            "peers": n,
            "mode": "one" if carry else "two",
            "failed": f"{len(by_round)} rounds committed in {t_rounds:.0f} s",
            "evicted": evicted,
            "request_failures": failed,
            "failure_kinds": failure_kinds,
        }
    form = [
        max(x["go"] for x in by_round[r]) - max(x["begin_sent"] for x in by_round[r])
        for r in counted
    ]
    commit = [
        max(x["done"] for x in by_round[r]) - max(x["commit_sent"] for x in by_round[r])
        for r in counted
    ]
    wall = [
        max(x["done"] for x in by_round[r]) - max(x["done"] for x in by_round[r - 1])
        for r in counted
        if r - 1 in by_round
    ]
    cpu_at = {rev: cpu for rev, cpu, *_ in stats["commits"]}
    cpu = [cpu_at[r + 1] - cpu_at[r] for r in counted if r in cpu_at and r + 1 in cpu_at]
    gc_at = {c[0]: c[3] for c in stats["commits"] if len(c) > 3}
    gc_cpu = [gc_at[r + 1] - gc_at[r] for r in counted if r in gc_at and r + 1 in gc_at]
    hb_rate = (b1 - b0) / (t1 - t0)
    idle_frac = (c1 - c0) / (t1 - t0)
    committed = max(1, stats["counters"]["rounds_committed"])
    return {
        "peers": n,
        "mode": "one" if carry else "two",
        "parity_every": parity_every,
        "transport": "frames" if framed else "http",
        "frames_sent": framed,
        "procs": k,
        "rounds": len(counted),
        "world": statistics.median(len(by_round[r]) for r in counted),
        "register_s": t_reg,
        "formation_ms": {"median": 1e3 * statistics.median(form), "p99": 1e3 * _pct(form, 0.99)},
        "commit_ms": {"median": 1e3 * statistics.median(commit), "p99": 1e3 * _pct(commit, 0.99)},
        "round_wall_ms": {"median": 1e3 * statistics.median(wall), "p99": 1e3 * _pct(wall, 0.99)},
        "cpu_ms_per_round": {
            "median": 1e3 * statistics.median(cpu),
            "p99": 1e3 * _pct(cpu, 0.99),
            "mean": 1e3 * statistics.mean(cpu),
        },
        "cpu_ms_by_round": [round(1e3 * c, 1) for c in cpu],
        "gc_ms_per_round": {
            "median": 1e3 * statistics.median(gc_cpu) if gc_cpu else None,
            "mean": 1e3 * statistics.mean(gc_cpu) if gc_cpu else None,
        },
        "gc_by_generation": stats.get("gc_by_generation"),
        "cpu_ms_per_round_net": 1e3
        * (statistics.median(cpu) - idle_frac * statistics.median(wall)),
        "heartbeats_per_round": round_beats / committed,
        "infos_in_begins_per_round": carried / committed,
        "hash_lists_per_round": lists / committed,
        "heartbeats_per_s": hb_rate,
        "idle_cpu_pct": 100 * (c1 - c0) / (t1 - t0),
        "cpu_us_per_heartbeat": 1e6 * (c1 - c0) / max(1, b1 - b0),
        "rss_mb": {
            "start": rss0,
            "registered": rss_reg,
            "end": rss_end,
            "peak": stats["maxrss_mb"],
        },
        "rounds_s": t_rounds,
        "evicted": evicted,
        "request_failures": failed,
        "failure_kinds": failure_kinds,
        "counters": {k: stats["counters"][k] for k in ("rounds_committed", "rounds_aborted")},
    }


def _row(r: dict[str, Any]) -> str:
    if "failed" in r:
        return (
            f"| {r['peers']} | {r['mode']} | {r['failed']}; {r['evicted']} evictions, "
            f"{r['request_failures']} requests failed or timed out |"
        )
    f, c, w, cpu, rss = (
        r["formation_ms"],
        r["commit_ms"],
        r["round_wall_ms"],
        r["cpu_ms_per_round"],
        r["rss_mb"],
    )
    return (
        f"| {r['peers']} | {r['mode']} | {r['transport']} | {r['rounds']} | {f['median']:.1f} / {f['p99']:.1f} | {c['median']:.1f} / {c['p99']:.1f} "
        f"| {w['median']:.1f} / {w['p99']:.1f} | {cpu['median']:.1f} / {cpu['p99']:.1f} "
        f"| {r['cpu_ms_per_round_net']:.0f} | {r['heartbeats_per_round']:.0f} / {r['infos_in_begins_per_round']:.0f} "
        f"| {r['heartbeats_per_s']:.0f} | {r['cpu_us_per_heartbeat']:.0f} | {r['idle_cpu_pct']:.1f} "
        f"| {rss['start']:.0f} / {rss['end']:.0f} | {r['counters']['rounds_aborted']} / {r['evicted']} / {r['request_failures']} |"
    )


HEADER = (
    "| peers | requests | transport | rounds | formation ms (median / p99) | commit ms | round wall ms | coordinator CPU ms per round "
    "| net of idle CPU over the round's wall (ms) | heartbeats / infos in begins per round "
    "| heartbeats/s (idle) | CPU us per heartbeat | idle CPU % | RSS MB (start / end) | aborts / evictions / failed requests |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        _, _, port, n, out, prof, warmup, hb, parity = sys.argv
        serve(
            int(port),
            int(n),
            Path(out),
            Path(prof) if prof else None,
            int(warmup),
            float(hb),
            int(parity),
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="10,100,1000")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per size, warm-up included")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of heartbeats only")
    ap.add_argument(
        "--limit", type=float, default=300.0, help="seconds of rounds per size, at most"
    )
    ap.add_argument("--profile", type=Path, default=None, help="a directory for cProfile dumps")
    ap.add_argument(
        "--mode",
        choices=("two", "one", "both"),
        default="two",
        help="two requests per member and round (commit, then begin), one (the vote in the "
        "next begin), or both back to back for each size",
    )
    ap.add_argument(
        "--transport",
        choices=("frames", "http"),
        default="frames",
        help="begin and commit as websocket frames where the coordinator offers them, or "
        "always as HTTP requests",
    )
    ap.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=0.0,
        help="the coordinator's heartbeat_timeout in seconds (default: its own, 5 s); a "
        "longer one keeps a machine that other work loads from evicting starved clients",
    )
    ap.add_argument(
        "--parity-every",
        type=int,
        default=1,
        help="the coordinator's parity_every (hashes checked every this many rounds; the peers "
        "send hashes only then, and when asked); default 1, the coordinator's own",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = []
    modes = {"two": (False,), "one": (True,), "both": (False, True)}[a.mode]
    for n, carry in ((int(x), c) for x in a.peers.split(",") for c in modes):
        prof = None
        if a.profile is not None:
            a.profile.mkdir(parents=True, exist_ok=True)
            prof = a.profile / f"coordinator-{n}-{'one' if carry else 'two'}.pstats"
        r = measure(
            n,
            rounds=a.rounds,
            warmup=a.warmup,
            procs=a.procs,
            idle=a.idle,
            limit_s=a.limit,
            profile=prof,
            carry=carry,
            frames=a.transport == "frames",
            heartbeat_timeout=a.heartbeat_timeout,
            parity_every=a.parity_every,
        )
        results.append(r)
        print(json.dumps(r), flush=True)
        if prof is not None:
            import pstats

            pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(25)
    print(HEADER)
    for r in results:
        print(_row(r))
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
