"""``isthmus bench allreduce``: isthmus's all-reduce against raw Gloo on the same emulated links.

One run builds the emulated network (:class:`~isthmus.lab.netns.WanNetwork`: a namespace per
peer, links shaped with tc tbf; the coordinator embedded in this process inside its own
namespace), starts one worker process per peer, and each worker measures, alternating so that both
see the same conditions:

* **raw Gloo**: a ``ProcessGroupGloo`` built directly on a ``TCPStore`` (the coordinator's store,
  under its own prefix), timed ``allreduce`` calls;
* **isthmus fp32**: a :class:`~isthmus.comm.session.Session`, timed ``session.run_round(...)``
  doing ``Group.all_reduce`` (the whole round: begin, the collective, commit);
* **isthmus compressed** (``compression=``): the same round through the strategies' path,
  :class:`~isthmus.reduce.reducer.Reducer` with that compressor (``make_compressor``).

Before every timed operation the workers meet at a small Gloo barrier, so each timing starts
together. Per repetition the slowest worker's time counts (a collective ends when its last peer
is done); the reported time is the median over repetitions. Bus bandwidth is
``2(n-1)/n x bytes x 8 / time`` (the figure NCCL's tests report: for a ring it equals each link's
payload rate). Sizes are in MB of fp32 data (10^6 bytes), rates in Mbit/s (10^6 bit/s).

Without root or iproute2 the benchmark falls back to loopback without shaping and says so
(``network: loopback`` with the reason, ``link_mbit: null``); loopback numbers measure CPU and
memory bandwidth, not a link. Failures: a worker that dies or times out raises
:class:`BenchError` with the end of its log; the network is torn down on every exit path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab.netns import (
    LabError,
    LabUnavailable,
    inside_namespace,
    unavailable_reason,
)
from isthmus.lab.netspec import Impairment
from isthmus.lab.wan import WanNetwork

__all__ = ["BenchConfig", "BenchError", "bus_bandwidth_mbit", "format_bench", "run_bench"]


class BenchError(RuntimeError):
    """A benchmark worker failed or timed out; the message carries the end of its log."""


def bus_bandwidth_mbit(nbytes: float, peers: int, seconds: float) -> float:
    """Bus bandwidth of an all-reduce of ``nbytes`` per peer over ``peers`` taking ``seconds``:
    ``2(n-1)/n x 8 x nbytes / seconds`` in Mbit/s. Raises ``ValueError`` for a non-positive time
    or fewer than two peers (one peer moves nothing)."""
    if peers < 2:
        raise ValueError(f"bus bandwidth needs at least 2 peers, got {peers}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"time must be a positive number of seconds, got {seconds!r}")
    return 2 * (peers - 1) / peers * 8 * nbytes / seconds / 1e6


@dataclass(kw_only=True)
class BenchConfig:
    """Settings of ``isthmus bench allreduce``."""

    peers: int = 4
    """Worker processes, one per namespace (at least 2)."""
    rate_mbit: float | None = 100.0
    """Every link's rate in each direction, Mbit/s; ``None``: unshaped veth."""
    sizes_mb: tuple[float, ...] = (32.0,)
    """All-reduce sizes, MB of fp32 per peer; the top-level figures are for the last one."""
    reps: int = 3
    """Timed repetitions per size and method (the median is reported)."""
    warmup: int = 1
    """Untimed repetitions first (connections, allocations)."""
    compression: str | None = None
    """Also time the Reducer path with this compressor spec (e.g. ``int8``, ``int4``)."""
    network: str = "auto"
    """``auto`` (namespaces if possible, else loopback), ``netns`` (or fail), ``loopback``."""
    collectives: bool = False
    """Also time raw Gloo ``all_to_all`` and ``all_gather`` that each send what one stage of the
    int8 quantized all-reduce sends (a quarter of the fp32 bytes, times (n-1)/n, per peer): the
    two collectives that all-reduce is made of, to see which one falls short of the link."""
    congestion_control: str | None = None
    """TCP congestion control in the namespaces (e.g. ``reno``, ``bbr``); ``None``: the host's.
    Reported back as ``tcp_congestion_control`` (what the namespaces used)."""
    connections: int = 1
    """TCP connections per peer pair that the isthmus collectives are striped over
    (``SessionConfig.connections``); the raw Gloo baseline has one."""
    rtt_ms: float = 0.0
    """Round trip between two peers (every peer link is a delay line); 0: none."""
    jitter_ms: float = 0.0
    """The round trip varies within +- this (at most ``rtt_ms``)."""
    loss: float = 0.0
    """Share of packets lost one way between two peers."""
    prefix: str = "isthb"
    """Prefix of the namespace names."""
    timeout_s: float = 900.0
    """Bound on the whole benchmark."""

    def __post_init__(self) -> None:
        if not isinstance(self.peers, int) or self.peers < 2:
            raise ValueError(
                f"peers must be an int >= 2 (an all-reduce needs two), got {self.peers!r}"
            )
        if self.rate_mbit is not None and not (
            math.isfinite(self.rate_mbit) and self.rate_mbit > 0
        ):
            raise ValueError(f"rate must be a positive number of Mbit/s, got {self.rate_mbit!r}")
        self.sizes_mb = tuple(float(s) for s in self.sizes_mb)
        if not self.sizes_mb or any(not (math.isfinite(s) and s > 0) for s in self.sizes_mb):
            raise ValueError(f"sizes must be positive numbers of MB, got {self.sizes_mb!r}")
        if isinstance(self.connections, bool) or not (
            isinstance(self.connections, int) and 1 <= self.connections <= 64
        ):
            raise ValueError(f"connections must be an int from 1 to 64, got {self.connections!r}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got {self.reps}, {self.warmup}")
        if self.compression in ("", "none"):
            self.compression = None
        if self.compression is not None:
            from isthmus.reduce.compress import make_compressor

            make_compressor(self.compression)  # a bad spec fails here, not in every worker
        if self.network not in ("auto", "netns", "loopback"):
            raise ValueError(f"network must be auto, netns or loopback, got {self.network!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        self.impairment()  # a bad round trip, jitter or loss fails here, with what to write

    def impairment(self) -> Impairment | None:
        """The peers' links' round trip, jitter and loss; ``None`` when there are none. Raises
        ``ValueError`` (a :class:`~isthmus.spec.SpecError`) for impossible values."""
        imp = Impairment(rtt_ms=self.rtt_ms, jitter_ms=self.jitter_ms, loss=self.loss)
        return imp if imp.active else None

    def op_timeout_s(self) -> float:
        """Bound on one collective: three times its ideal duration at the link rate, at least 60 s,
        plus a second per 10 ms of round trip (a window-bound stream takes longer)."""
        rate = (self.rate_mbit or 1000.0) * 1e6
        ideal = 2 * max(self.sizes_mb) * 1e6 * 8 / rate
        return max(60.0, 3 * ideal + 30) + self.rtt_ms / 10


@contextlib.contextmanager
def _network(cfg: BenchConfig) -> Iterator[tuple[WanNetwork | None, str | None]]:
    if cfg.network == "loopback":
        yield None, "asked for (--network loopback)"
        return
    reason = unavailable_reason()
    if reason is None:
        net = WanNetwork(
            cfg.peers,
            rates_mbit=cfg.rate_mbit,
            prefix=cfg.prefix,
            congestion_control=cfg.congestion_control,
            impairments=cfg.impairment(),
        )
        try:
            net.start()
        except LabUnavailable as e:
            reason = str(e)
        else:
            try:
                yield net, None
            except BaseException:
                with contextlib.suppress(LabError):
                    net.close()
                raise
            net.close()
            return
    if cfg.network == "netns":
        raise LabUnavailable(f"the emulated network cannot be built here: {reason}")
    print(
        f"isthmus bench: no emulated network ({reason}); falling back to loopback WITHOUT "
        "shaping: the figures measure this machine's CPU, not a link",
        file=sys.stderr,
    )
    yield None, reason


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark and return its result object (see :func:`format_bench` for a table).

    Keys: ``peers``, ``link_mbit`` (``None`` on loopback), ``network``, ``network_note``,
    ``size_mb`` and, for that (the last) size, ``gloo_time_s``, ``isthmus_time_s``,
    ``gloo_busbw_mbit``, ``isthmus_busbw_mbit``, ``ratio_vs_gloo``, ``link_utilization``
    (isthmus bus bandwidth / link rate; ``None`` on loopback), and with a compressor
    ``compression``, ``fp32_time_s``, ``time_s``, ``speedup_vs_fp32``; with ``collectives``
    ``stage_bytes_per_peer``, ``all_to_all_time_s``, ``all_to_all_mbit``, ``all_gather_time_s``,
    ``all_gather_mbit``, ``exchange_time_s``, ``exchange_mbit`` (payload Mbit/s sent per peer;
    ``exchange`` is isthmus's :meth:`~isthmus.comm.group.Group.exchange`, the all-to-all the
    quantized all-reduce uses); ``results`` holds the same per size; ``tcp_congestion_control``:
    what the namespaces used (``None`` on loopback). Raises :class:`BenchError` if a worker fails.
    """
    from isthmus.coordinator.membership import MembershipConfig
    from isthmus.coordinator.server import Coordinator, CoordinatorConfig

    token = secrets.token_hex(16)
    with (
        _network(cfg) as (net, fallback),
        tempfile.TemporaryDirectory(prefix="isthmus-bench-") as tmp,
    ):
        ctx = inside_namespace(net.coordinator.netns) if net else contextlib.nullcontext()
        host = net.coordinator.ip if net else "127.0.0.1"
        with ctx:
            coordinator = Coordinator(
                CoordinatorConfig(
                    token=token,
                    host=host,
                    port=0,
                    membership=MembershipConfig(
                        start_peers=cfg.peers,
                        start_timeout=120.0,
                        heartbeat_timeout=10.0,
                        commit_timeout=cfg.op_timeout_s() * 2,
                    ),
                    heartbeat_interval=1.0,
                    # raw Gloo meets on the coordinator's plain TCPStore (and so does isthmus
                    # here, as in the figures this benchmark is compared with)
                    rendezvous="tcpstore",
                )
            ).start()
        try:
            job = {
                "coordinator": coordinator.address,
                "store_host": host,
                "store_port": coordinator.store_port,
                "token": token,
                "peers": cfg.peers,
                "hosts": [p.ip for p in net.peers] if net else ["127.0.0.1"] * cfg.peers,
                "sizes_mb": list(cfg.sizes_mb),
                "reps": cfg.reps,
                "warmup": cfg.warmup,
                "compression": cfg.compression,
                "collectives": cfg.collectives,
                "connections": cfg.connections,
                "op_timeout_s": cfg.op_timeout_s(),
                "out": tmp,
            }
            job_path = Path(tmp) / "job.json"
            job_path.write_text(json.dumps(job))
            per_rank = _run_workers(cfg, net, job_path, Path(tmp))
        finally:
            coordinator.stop()
        cc = net.tcp_congestion_control() if net else None
    out = _combine(cfg, per_rank, "netns" if net else "loopback", fallback)
    out["tcp_congestion_control"] = cc
    return out


def _run_workers(
    cfg: BenchConfig, net: WanNetwork | None, job_path: Path, tmp: Path
) -> list[dict[str, Any]]:
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    try:
        for rank in range(cfg.peers):
            argv = [sys.executable, "-m", "isthmus.lab.bench", str(job_path), str(rank)]
            logp = tmp / f"worker{rank}.log"
            with logp.open("wb") as log:
                if net is None:
                    p = subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
                    )
                else:
                    p = net.popen(rank, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append((p, logp))
        deadline = time.monotonic() + cfg.timeout_s
        for rank, (p, logp) in enumerate(procs):
            try:
                rc = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(
                    f"worker {rank} still running after {cfg.timeout_s:.0f}s; log:\n{_tail(logp)}"
                ) from None
            if rc != 0:
                raise BenchError(f"worker {rank} failed (exit {rc}); log:\n{_tail(logp)}")
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
    return [json.loads((tmp / f"result{r}.json").read_text()) for r in range(cfg.peers)]


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def _combine(
    cfg: BenchConfig, per_rank: list[dict[str, Any]], mode: str, fallback: str | None
) -> dict[str, Any]:
    n = cfg.peers
    link = cfg.rate_mbit if mode == "netns" else None
    results = []
    for i, size in enumerate(cfg.sizes_mb):
        nbytes = per_rank[0]["sizes"][i]["nbytes"]

        def median_of_max(key: str, i: int = i) -> float:
            reps = zip(*(r["sizes"][i][key] for r in per_rank), strict=True)
            return statistics.median(max(times) for times in reps)

        gloo_t, isth_t = median_of_max("gloo"), median_of_max("isthmus")
        gloo_bw = bus_bandwidth_mbit(nbytes, n, gloo_t)
        isth_bw = bus_bandwidth_mbit(nbytes, n, isth_t)
        row: dict[str, Any] = {
            "size_mb": size,
            "nbytes": nbytes,
            "gloo_time_s": round(gloo_t, 4),
            "isthmus_time_s": round(isth_t, 4),
            "gloo_busbw_mbit": round(gloo_bw, 2),
            "isthmus_busbw_mbit": round(isth_bw, 2),
            "ratio_vs_gloo": round(isth_bw / gloo_bw, 4),
            "link_utilization": round(isth_bw / link, 4) if link else None,
            "gloo_link_utilization": round(gloo_bw / link, 4) if link else None,
        }
        if cfg.compression:
            comp_t = median_of_max("compressed")
            row.update(
                {
                    "compression": cfg.compression,
                    "fp32_time_s": round(isth_t, 4),
                    "time_s": round(comp_t, 4),
                    "speedup_vs_fp32": round(isth_t / comp_t, 3),
                    "wire_bytes_per_peer": per_rank[0]["sizes"][i]["compressed_bytes"],
                    "fp32_wire_bytes_per_peer": per_rank[0]["sizes"][i]["fp32_bytes"],
                }
            )
        if cfg.collectives:
            stage = per_rank[0]["sizes"][i]["stage_bytes"]
            for key in ("all_to_all", "all_gather", "exchange"):
                t = median_of_max(key)
                row[f"{key}_time_s"] = round(t, 4)
                row[f"{key}_mbit"] = round(8 * stage / t / 1e6, 2)
            row["stage_bytes_per_peer"] = stage
        results.append(row)
    out: dict[str, Any] = {
        "peers": n,
        "connections": cfg.connections,
        "link_mbit": link,
        "rtt_ms": cfg.rtt_ms if mode == "netns" else None,
        "jitter_ms": cfg.jitter_ms if mode == "netns" else None,
        "loss": cfg.loss if mode == "netns" else None,
        "network": mode,
        "network_note": None
        if mode == "netns"
        else f"loopback without shaping ({fallback}): figures measure CPU, not a link",
        "reps": cfg.reps,
        **results[-1],
        "results": results,
    }
    return out


def format_bench(r: dict[str, Any]) -> str:
    """The result of :func:`run_bench` as a few readable lines."""
    link = f"{r['link_mbit']:g} Mbit/s links" if r["link_mbit"] else "loopback, unshaped"
    if r.get("rtt_ms"):
        link += f", RTT {r['rtt_ms']:g} ms"
        if r.get("jitter_ms"):
            link += f" +- {r['jitter_ms']:g}"
    if r.get("loss"):
        link += f", loss {r['loss']:g}"
    cc = r.get("tcp_congestion_control")
    tcp = f", TCP {cc}" if cc else ""
    k = r.get("connections", 1)
    conns = f", isthmus on {k} connections per pair" if k != 1 else ""
    lines = [
        f"all-reduce, {r['peers']} peers, {link} ({r['network']}{tcp}{conns}, "
        f"median of {r['reps']})"
    ]
    if r["network_note"]:
        lines.append(f"NOTE: {r['network_note']}")
    for x in r["results"]:
        util = (
            f", link utilization {100 * x['link_utilization']:.1f}% "
            f"(gloo {100 * x['gloo_link_utilization']:.1f}%)"
            if x["link_utilization"] is not None
            else ""
        )
        lines.append(
            f"  {x['size_mb']:g} MB: gloo {x['gloo_busbw_mbit']:.1f} Mbit/s ({x['gloo_time_s']:.3f} s), "
            f"isthmus {x['isthmus_busbw_mbit']:.1f} Mbit/s ({x['isthmus_time_s']:.3f} s), "
            f"ratio {x['ratio_vs_gloo']:.3f}{util}"
        )
        if "all_to_all_time_s" in x:
            lines.append(
                f"    raw Gloo, {x['stage_bytes_per_peer']:,} bytes sent per peer: all_to_all "
                f"{x['all_to_all_time_s']:.3f} s ({x['all_to_all_mbit']:.1f} Mbit/s), all_gather "
                f"{x['all_gather_time_s']:.3f} s ({x['all_gather_mbit']:.1f} Mbit/s); isthmus "
                f"exchange {x['exchange_time_s']:.3f} s ({x['exchange_mbit']:.1f} Mbit/s)"
            )
        if "compression" in x:
            lines.append(
                f"    {x['compression']}: {x['time_s']:.3f} s vs fp32 {x['fp32_time_s']:.3f} s, "
                f"speedup {x['speedup_vs_fp32']:.2f}x "
                f"({x['wire_bytes_per_peer']:,} vs {x['fp32_wire_bytes_per_peer']:,} bytes sent per peer)"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the worker


def _worker(job_path: str, rank: int) -> None:
    """One peer of the benchmark (runs inside its namespace); writes ``result<rank>.json``."""
    import datetime

    import torch
    import torch.distributed as dist

    from isthmus.comm.group import build_process_group
    from isthmus.comm.session import Session, SessionConfig
    from isthmus.reduce.reducer import Reducer

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    n, host, timeout = job["peers"], job["hosts"][rank], float(job["op_timeout_s"])
    store = dist.TCPStore(
        job["store_host"],
        int(job["store_port"]),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    # the coordinator's store, under a prefix of our own: the sessions use per-epoch prefixes
    pg = build_process_group(
        dist.PrefixStore("bench-raw/", store), rank, n, timeout_s=timeout, hostname=host
    )
    session = Session(
        SessionConfig(
            coordinator=job["coordinator"],
            token=job["token"],
            name=f"bench{rank}",
            hostname=host,
            collective_timeout=timeout,
            round_timeout=timeout * 2,
            connections=int(job.get("connections", 1)),
        )
    )
    reducer = Reducer(compression=job["compression"]) if job["compression"] else None
    out: dict[str, Any] = {"rank": rank, "sizes": []}
    try:
        for size_mb in job["sizes_mb"]:
            out["sizes"].append(
                _measure(
                    pg,
                    session,
                    reducer,
                    size_mb,
                    rank,
                    job["warmup"],
                    job["reps"],
                    collectives=bool(job.get("collectives")),
                )
            )
    finally:
        session.close()
    (Path(job["out"]) / f"result{rank}.json").write_text(json.dumps(out))


def _measure(
    pg: Any,
    session: Any,
    reducer: Any,
    size_mb: float,
    rank: int,
    warmup: int,
    reps: int,
    *,
    collectives: bool = False,
) -> dict[str, Any]:
    """Time one size: per repetition a raw Gloo all-reduce, an isthmus round, (with a reducer)
    a compressed round and (with ``collectives``) a raw all_to_all and all_gather, each after a
    barrier, from the same data."""
    import torch

    numel = max(1, int(size_mb * 1e6 / 4))
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
    buf = torch.empty_like(base)
    tiny = torch.zeros(1)
    rec: dict[str, Any] = {"nbytes": numel * 4, "gloo": [], "isthmus": [], "compressed": []}
    n = pg.size()
    # one int8 byte per value, cut into n equal slices: all_to_all sends n-1 of them, and so
    # does the ring all_gather of one slice
    slice_n = max(1, numel // n)
    u8 = torch.randint(0, 256, (slice_n * n,), dtype=torch.uint8)
    u8_out = torch.empty_like(u8)
    rec["stage_bytes"] = (n - 1) * slice_n
    rec["all_to_all"], rec["all_gather"], rec["exchange"] = [], [], []

    def timed(fn: Any) -> tuple[float, int]:
        pg.allreduce([tiny]).wait()  # barrier: every peer starts together
        buf.copy_(base)
        sent = session.stats.bytes_sent
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, session.stats.bytes_sent - sent

    def gloo() -> None:
        pg.allreduce([buf]).wait()

    def isthmus() -> None:
        session.run_round(lambda rnd: rnd.group.all_reduce(buf))

    def compressed() -> None:
        session.run_round(lambda rnd: reducer.mean(rnd, [("x", buf)], contribute=True))
        reducer.commit()

    def all_to_all() -> None:
        pg.alltoall_base(u8_out, u8, [], []).wait()

    def all_gather() -> None:
        pg._allgather_base(u8_out, u8[:slice_n]).wait()

    def exchange() -> None:
        session.run_round(lambda rnd: rnd.group.exchange(u8))

    for i in range(warmup + reps):
        times = {"gloo": timed(gloo)[0]}
        times["isthmus"], rec["fp32_bytes"] = timed(isthmus)
        if reducer is not None:
            times["compressed"], rec["compressed_bytes"] = timed(compressed)
        if collectives:
            times["all_to_all"] = timed(all_to_all)[0]
            times["all_gather"] = timed(all_gather)[0]
            times["exchange"] = timed(exchange)[0]
        if i >= warmup:
            for k, v in times.items():
                rec[k].append(v)
    return rec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m isthmus.lab.bench JOB.json RANK (started by isthmus bench)",
            file=sys.stderr,
        )
        return 1
    _worker(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
