"""``isthmus bench link``: how faithfully the lab emulates one link with a round trip.

For every round trip asked for, two peers are joined by links of that rate and round trip (each
a delay line, :mod:`isthmus.lab.delayline`), and measured from inside their namespaces:

* **ping**: round trips (``ping``; without it, TCP connect times from :mod:`isthmus.lab.linkprobe`),
  the first one dropped (it waits for ARP), against the setting;
* **windowed transfer**: a TCP stream whose application keeps at most ``window`` bytes
  unacknowledged (:mod:`isthmus.lab.linkprobe`), against ``min(payload rate, window / (RTT + chunk /
  rate))``, the rate such a stream gets on a real link of that round trip;
* **bulk TCP**: one stream with the kernel's own windows (``iperf3`` when installed, else the
  probe without a window), with what TCP reported (retransmissions, largest congestion window,
  mean round trip), against ``min(payload rate, tcp_wmem max / RTT)``: Linux's send buffer (4 MiB by
  default) bounds what one connection keeps in flight, which is why a single stream cannot fill
  a long fat link;
* **CPU**: the delay lines' CPU seconds per second during the bulk transfer (cores), in all and
  in user space alone (the rest is the kernel's receive path of the frames they write, which a
  veth would run in softirq anyway).

Failures: :class:`~isthmus.lab.netns.LabUnavailable` without root; a probe that fails or runs
past its bound raises :class:`~isthmus.lab.netns.LabError` with its message. Every network is
torn down on every exit path.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab import linkprobe as probe
from isthmus.lab.netns import LabError
from isthmus.lab.netspec import Impairment
from isthmus.lab.wan import WanNetwork

__all__ = ["LinkBenchConfig", "format_link_bench", "measure_rtt_ms", "run_link_bench", "windowed"]

PROBE = [sys.executable, "-I", str(Path(probe.__file__))]
PAYLOAD_SHARE = 1448 / 1514
"""TCP payload per byte the shapers count (a full frame: 1448 payload bytes behind Ethernet, IP
and TCP headers with timestamps)."""


@dataclass(kw_only=True)
class LinkBenchConfig:
    """Settings of ``isthmus bench link``."""

    rate_mbit: float | None = 100.0
    """Both links' rate in each direction; ``None``: unshaped."""
    rtts_ms: tuple[float, ...] = (10.0, 40.0, 80.0, 150.0, 300.0)
    """Round trips to measure, one network each."""
    jitter_ms: float = 0.0
    loss: float = 0.0
    seconds: float = 6.0
    """Length of each transfer (the first third is slow start, not counted)."""
    window_kib: int = 256
    """The windowed transfer's window."""
    pings: int = 20
    congestion_control: str | None = None
    """TCP congestion control in the namespaces (e.g. ``reno``); ``None``: the host's."""
    prefix: str = "isthl"

    def __post_init__(self) -> None:
        self.rtts_ms = tuple(float(r) for r in self.rtts_ms)
        for r in self.rtts_ms:
            Impairment(rtt_ms=r, jitter_ms=min(self.jitter_ms, r), loss=self.loss)  # checks
        if not (math.isfinite(self.seconds) and self.seconds >= 2):
            raise ValueError(f"seconds must be at least 2, got {self.seconds!r}")
        if self.window_kib < 16 or self.pings < 2:
            raise ValueError("window_kib must be at least 16 and pings at least 2")


def _ping_times(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"time=([0-9.]+) ms", out)]


def measure_rtt_ms(net: WanNetwork, a: int, b: int, count: int = 10) -> list[float]:
    """Round trips from peer ``a`` to peer ``b``, in ms: ``ping`` where installed, TCP connect
    times otherwise (a probe server must listen on ``b``: :func:`serve_probe`). The neighbours
    are resolved first and that exchange not counted: an echo sent while ARP is still waiting
    for its answer would wait for it too. Raises :class:`LabError` if nothing answers."""
    ip = net.peers[b].ip
    bound = 30 + count * (0.05 + 2 * net.rtt_ms(a, b) / 1000)
    if shutil.which("ping"):
        net.run(a, ["ping", "-n", "-c", "2", "-i", "0.2", "-w", "10", ip], timeout_s=bound)
        r = net.run(a, ["ping", "-n", "-c", str(count), "-i", "0.05", ip], timeout_s=bound)
        times = _ping_times(r.stdout)
    else:
        argv = [*PROBE, "connect", ip, str(probe.PORT), str(count + 1), "0.05"]
        r = net.run(a, argv, timeout_s=bound)
        times = json.loads(r.stdout)["rtt_ms"][1:] if r.returncode == 0 else []
    if not times:
        raise LabError(f"no round trips measured from peer {a} to {ip}: {r.stderr.strip()}")
    return times


def serve_probe(net: WanNetwork, which: int) -> subprocess.Popen[str]:
    """Start the probe's server on peer ``which`` and wait (bounded) until it listens."""
    proc = net.popen(which, [*PROBE, "serve", str(probe.PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints as soon as it listens, or exits
    if "listening" not in line:
        proc.kill()
        raise LabError(f"the probe server on peer {which} did not start")
    return proc


def windowed(net: WanNetwork, a: int, b: int, *, seconds: float, window: int) -> dict[str, Any]:
    """A transfer from ``a`` to ``b`` (where :func:`serve_probe` runs) with ``window`` bytes
    at most unacknowledged (0: none); returns the probe's ``{"bytes", "seconds", "mbit"}``."""
    argv = [*PROBE, "send", net.peers[b].ip, str(probe.PORT), str(seconds), str(window)]
    r = net.run(a, [*argv, str(seconds / 3)], timeout_s=seconds + 60)
    if r.returncode != 0 or not r.stdout.strip():
        raise LabError(f"windowed transfer failed (exit {r.returncode}): {r.stderr.strip()}")
    return json.loads(r.stdout)


def _iperf3(net: WanNetwork, seconds: float) -> dict[str, Any]:
    srv = net.popen(1, ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)  # iperf3 prints nothing when it listens; it takes milliseconds
        argv = ["iperf3", "-c", net.peers[1].ip, "-t", str(seconds), "-O", str(seconds / 3), "-J"]
        r = net.run(0, argv, timeout_s=seconds + 60)
    finally:
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
    if r.returncode != 0:
        raise LabError(f"iperf3 failed: {r.stdout[-500:]} {r.stderr.strip()}")
    end = json.loads(r.stdout)["end"]
    stream = end["streams"][0]["sender"]
    return {
        "tool": "iperf3",
        "mbit": round(end["sum_received"]["bits_per_second"] / 1e6, 2),
        "retransmits": end["sum_sent"].get("retransmits"),
        "max_cwnd_bytes": stream.get("max_snd_cwnd"),
        "mean_rtt_ms": round(stream["mean_rtt"] / 1000, 2) if "mean_rtt" in stream else None,
    }


def _cpu(net: WanNetwork) -> tuple[float, float]:
    user = system = 0.0
    for line in net.lines:
        u, s = line.cpu_times() or (0.0, 0.0)
        user, system = user + u, system + s
    return user, system


def _wmem_max(net: WanNetwork) -> int | None:
    r = net.run(0, ["sysctl", "-n", "net.ipv4.tcp_wmem"])
    parts = r.stdout.split()
    return int(parts[2]) if r.returncode == 0 and len(parts) == 3 else None


def _one(cfg: LinkBenchConfig, rtt: float) -> dict[str, Any]:
    imp = Impairment(rtt_ms=rtt, jitter_ms=min(cfg.jitter_ms, rtt), loss=cfg.loss)
    with WanNetwork(
        2,
        rates_mbit=cfg.rate_mbit,
        impairments=imp,
        prefix=cfg.prefix,
        congestion_control=cfg.congestion_control,
    ) as net:
        srv = serve_probe(net, 1)
        times = measure_rtt_ms(net, 0, 1, cfg.pings)
        window = cfg.window_kib * 1024
        win = windowed(net, 0, 1, seconds=cfg.seconds, window=window)
        srv.kill()
        cpu0, t0 = _cpu(net), time.monotonic()
        if shutil.which("iperf3"):
            bulk = _iperf3(net, cfg.seconds)
        else:
            srv = serve_probe(net, 1)
            bulk = {"tool": "probe", **windowed(net, 0, 1, seconds=cfg.seconds, window=0)}
        cpu1, wall = _cpu(net), time.monotonic() - t0
        wmem = _wmem_max(net)
        cc = net.tcp_congestion_control()
    rate_bps = cfg.rate_mbit * 1e6 if cfg.rate_mbit else math.inf
    payload_bps = rate_bps * PAYLOAD_SHARE
    predicted_win = min(payload_bps, window * 8 / (rtt / 1000 + probe.CHUNK * 8 / rate_bps)) / 1e6
    ceiling = min(payload_bps, wmem * 8 / (rtt / 1000) if wmem and rtt else math.inf) / 1e6
    return {
        "rtt_ms": rtt,
        "tcp_congestion_control": cc,
        "ping_min_ms": round(min(times), 2),
        "ping_median_ms": round(statistics.median(times), 2),
        "ping_max_ms": round(max(times), 2),
        "ping_error": round(statistics.median(times) / rtt - 1, 4) if rtt else None,
        "window_kib": cfg.window_kib,
        "window_mbit": win["mbit"],
        "window_predicted_mbit": round(predicted_win, 2),
        "bulk": bulk,
        "bulk_ceiling_mbit": round(ceiling, 1),
        "tcp_wmem_max": wmem,
        "line_cpu_cores": round((sum(cpu1) - sum(cpu0)) / wall, 3),
        "line_user_cores": round((cpu1[0] - cpu0[0]) / wall, 3),
    }


def run_link_bench(cfg: LinkBenchConfig) -> dict[str, Any]:
    """Measure every round trip of ``cfg``; returns ``{"rate_mbit", "jitter_ms", "loss",
    "rows": [...]}`` (keys of a row: see :func:`format_link_bench`)."""
    rows = [_one(cfg, rtt) for rtt in cfg.rtts_ms]
    return {"rate_mbit": cfg.rate_mbit, "jitter_ms": cfg.jitter_ms, "loss": cfg.loss, "rows": rows}


def format_link_bench(r: dict[str, Any]) -> str:
    """The result of :func:`run_link_bench` as a Markdown table."""
    rate = f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped"
    cc = r["rows"][0].get("tcp_congestion_control") if r["rows"] else None
    lines = [
        f"link {rate}, jitter {r['jitter_ms']:g} ms, loss {r['loss']:g}, TCP {cc or 'unknown'}",
        "",
        "| RTT set (ms) | ping min / median / max (ms) | window (KiB) | windowed Mbit/s "
        "(predicted) | bulk TCP Mbit/s (ceiling) | retrans | max cwnd (KiB) | TCP mean RTT (ms) "
        "| line CPU, all / user (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        b = x["bulk"]
        cwnd = f"{b['max_cwnd_bytes'] / 1024:.0f}" if b.get("max_cwnd_bytes") else "-"
        lines.append(
            f"| {x['rtt_ms']:g} | {x['ping_min_ms']} / {x['ping_median_ms']} / {x['ping_max_ms']} "
            f"| {x['window_kib']} | {x['window_mbit']:.1f} ({x['window_predicted_mbit']:.1f}) "
            f"| {b['mbit']:.1f} ({x['bulk_ceiling_mbit']:.0f}) | {b.get('retransmits', '-')} "
            f"| {cwnd} | {b.get('mean_rtt_ms') or '-'} | {x['line_cpu_cores']:.2f} / "
            f"{x['line_user_cores']:.2f} |"
        )
    return "\n".join(lines)
