"""Delay lines in the emulated network (:mod:`isthmus.lab.delayline` is the process itself):
the owner's handle on a line process, the lines a network needs (a peer's access link, the core
joining sites) and per-destination shaping of the links between sites.

A :class:`DelayLine` is started by :class:`~isthmus.lab.wan.WanNetwork` while it builds, and
stopped at its teardown; if the owner dies first, the line's lifeline pipe reaches end of file
and the line exits by itself, taking its TAP devices with it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from isthmus.lab import delayline
from isthmus.lab.delayline import LineConfig, PathConfig, PortConfig
from isthmus.lab.netns import LabError, LabUnavailable, run_cmd, tbf_parameters
from isthmus.lab.netspec import Impairment, Sites

__all__ = [
    "DelayLine",
    "access_crossing",
    "access_line",
    "path_limit",
    "shape_per_destination",
    "site_core",
    "site_crossing",
]

READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 3.0


class DelayLine:
    """The owner's handle on one delay-line process.

    :meth:`start` spawns it and returns once its TAP devices exist (bounded by
    ``READY_TIMEOUT_S``); :meth:`stop` ends it and returns its counters. If the owner dies
    without stopping it, the lifeline's end of file ends it.
    """

    def __init__(self, cfg: LineConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[str] | None = None
        self._lifeline: int | None = None
        self._stderr: IO[bytes] | None = None
        self.final: dict[str, Any] | None = None
        self._error = ""
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_times(self) -> tuple[float, float] | None:
        """CPU seconds the process has used so far, ``(user, system)``; ``None`` once it has
        ended. System time includes the receive path of every frame it writes (the stack runs
        it in the writer's context), work a veth's softirq would do anyway."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # fields after the command name: utime and stime are the 12th and 13th, in clock ticks
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Spawn the process and wait until its ports exist. Raises :class:`LabError` with the
        process's own message if it fails or is not ready in ``timeout_s`` (it is killed then)."""
        if self.proc is not None:
            raise LabError(f"delay line {self.cfg.name} was already started")
        r, w = os.pipe()  # both ends close-on-exec: only the child we name gets r
        self._lifeline = w
        # kept open for the life of the process, read only when it fails
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(Path(delayline.__file__)), str(r), self.cfg.to_json()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                pass_fds=(r,),
                text=True,
                # its own session: a Ctrl-C at the terminal reaches the owner, whose teardown
                # then stops the line, instead of cutting every link while peers still run
                start_new_session=True,
            )
        finally:
            os.close(r)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.stop()
            why = self.error() or (
                f"not ready after {timeout_s:.0f}s" if not ready else "exited before it was ready"
            )
            raise LabError(f"delay line {self.cfg.name} could not start: {why}")

    def error(self) -> str:
        """What the process wrote on stderr (why it failed), or ``""``."""
        if self._stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                self._stderr.seek(0)
                self._error = self._stderr.read().decode(errors="replace").strip()[-2000:]
        return self._error

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[str, Any] | None:
        """End the process (lifeline closed, then SIGTERM, then SIGKILL, each bounded) and return
        its counters (``None`` if it printed none). Safe to call more than once."""
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = None
        proc = self.proc
        if proc is None or self._stopped:
            return self.final
        self._stopped = True
        if proc.poll() is None:
            try:
                out, _ = proc.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    out, _ = proc.communicate(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate(timeout=grace_s)
        else:
            out = proc.stdout.read() if proc.stdout else ""
        for text in reversed((out or "").splitlines()):
            with contextlib.suppress(ValueError):
                self.final = json.loads(text)
                break
        if self._stderr is not None:
            self.error()  # kept for messages after the file is gone
            with contextlib.suppress(OSError):
                self._stderr.close()
            self._stderr = None
        return self.final


# ---------------------------------------------------------------------------- building lines

UNSHAPED_LIMIT_BYTES = 64 << 20
"""What an unshaped path may hold in flight (64 MiB: 3.4 Gbit/s at 150 ms one way)."""


def access_crossing(imp: Impairment) -> tuple[float, float, float]:
    """Delay (s), jitter (s) and loss of one crossing of a peer's link: a round trip between two
    peers crosses each of their links twice, so a quarter of ``rtt_ms`` and ``jitter_ms``; two
    crossings one way lose ``loss`` together."""
    return imp.rtt_ms / 4000, imp.jitter_ms / 4000, 1 - math.sqrt(1 - imp.loss)


def site_crossing(imp: Impairment) -> tuple[float, float, float]:
    """Delay (s), jitter (s) and loss of one direction of a site link: half the round trip."""
    return imp.rtt_ms / 2000, imp.jitter_ms / 2000, imp.loss


def path_limit(rate_bps: float | None, hold_s: float) -> int:
    """Bytes one path of a line may hold: twice what ``rate_bps`` delivers while a frame waits
    ``hold_s`` plus tbf's 10 ms burst, at least 1 MiB; unshaped: :data:`UNSHAPED_LIMIT_BYTES`.
    tbf/htb in front already bound the rate, so this only cuts in for unshaped links (and stray
    bursts): the bottleneck queue stays the qdisc's, as the rate's."""
    if rate_bps is None:
        return UNSHAPED_LIMIT_BYTES
    return max(1 << 20, int(2 * rate_bps / 8 * (hold_s + 0.010)))


def access_line(
    *,
    name: str,
    node_netns: str,
    node_ifname: str,
    bridge_netns: str,
    bridge_port: str,
    impairment: Impairment,
    rate_bps: float | None,
    seed: int,
) -> DelayLine:
    """A peer's link as a delay line (not started): its ``node_ifname`` in its namespace and its
    ``bridge_port`` in the bridge's, both TAP devices, each direction delayed alike. Ports of a
    lossy link take no TCP super-packets, so loss hits single frames."""
    delay, jitter, loss = access_crossing(impairment)
    limit = path_limit(rate_bps, delay + jitter)
    tso = loss == 0
    return DelayLine(
        LineConfig(
            name=name,
            ports=(
                PortConfig(netns=node_netns, ifname=node_ifname, tso=tso),
                PortConfig(netns=bridge_netns, ifname=bridge_port, tso=tso),
            ),
            paths=tuple(
                PathConfig(
                    src=a, dst=1 - a, delay_s=delay, jitter_s=jitter, loss=loss, limit_bytes=limit
                )
                for a in (0, 1)
            ),
            home=bridge_netns,
            seed=seed,
        )
    )


def site_core(
    *, name: str, bridge_netns: str, ports: Sequence[str], sites: Sites, seed: int
) -> DelayLine:
    """The links between sites as one delay line (not started): port ``ports[k]`` (a TAP in the
    bridge namespace) joins site ``k``'s bridge, and every ordered pair of sites is a path with
    its link's delay, jitter and loss. The rate is not the line's business: each port's egress
    is shaped per destination site (:func:`shape_per_destination`)."""
    paths = []
    lossy: set[int] = set()
    n = len(sites.sites)
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            link = sites.link(a, b)
            delay, jitter, loss = site_crossing(link.impairment)
            if loss:
                lossy.add(a)
            paths.append(
                PathConfig(
                    src=a,
                    dst=b,
                    delay_s=delay,
                    jitter_s=jitter,
                    loss=loss,
                    limit_bytes=path_limit(link.rate_bps, delay + jitter),
                )
            )
    return DelayLine(
        LineConfig(
            name=name,
            ports=tuple(
                PortConfig(netns=bridge_netns, ifname=p, tso=k not in lossy)
                for k, p in enumerate(ports)
            ),
            paths=tuple(paths),
            home=bridge_netns,
            seed=seed,
        )
    )


def shape_per_destination(
    netns: str, dev: str, classes: Sequence[tuple[float, Sequence[str]]]
) -> None:
    """Shape ``dev``'s egress per destination: one htb class per ``(rate_bps, addresses)``, each
    with its own bounded FIFO (tbf's queue sizing), chosen by u32 filters on the destination
    address. Traffic to other addresses (ARP, the site's own) bypasses the classes unshaped
    (htb's direct queue). Raises :class:`LabError` (:class:`LabUnavailable` without htb)."""
    try:
        run_cmd(f"tc -n {netns} qdisc replace dev {dev} root handle 1: htb".split())
    except LabError as e:
        raise LabUnavailable(f"tc htb shaping is not available here: {e}") from e
    for k, (rate_bps, addresses) in enumerate(classes, start=1):
        burst, limit = tbf_parameters(rate_bps)
        rate = f"{int(rate_bps)}bit"
        run_cmd(
            f"tc -n {netns} class add dev {dev} parent 1: classid 1:{k} htb rate {rate} "
            f"ceil {rate} burst {burst} cburst {burst}".split()
        )
        run_cmd(
            f"tc -n {netns} qdisc add dev {dev} parent 1:{k} handle {k + 1}: bfifo "
            f"limit {limit}".split()
        )
        for ip in addresses:
            run_cmd(
                f"tc -n {netns} filter add dev {dev} parent 1: protocol ip prio 1 u32 "
                f"match ip dst {ip}/32 flowid 1:{k}".split()
            )
