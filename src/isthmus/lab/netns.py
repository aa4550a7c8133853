"""Network namespaces for the emulated WAN (:mod:`isthmus.lab.wan` builds the network itself):
create them, run a thread or a process inside one, kill what runs inside, delete them.

Every run gets unique names (``<prefix>-<pid>-<4 hex>-...``), so concurrent runs never collide,
and :func:`cleanup_stale` can tell a crashed run (its pid is gone) from a live one. Teardown
kills every process still inside the run's namespaces and deletes the namespaces (which destroys
their veths and the bridge) at normal exit, on exceptions and on SIGINT/SIGTERM; only SIGKILL can
leave anything behind, and :func:`cleanup_stale` removes that.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from isthmus.lab.netspec import Impairment

__all__ = [
    "LabError",
    "LabUnavailable",
    "Node",
    "cleanup_stale",
    "inside_namespace",
    "list_namespaces",
    "tbf_parameters",
    "unavailable_reason",
]

IFNAME = "wan0"
"""Interface name of every node's link (namespaces are separate, so the name can repeat)."""

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
CMD_TIMEOUT_S = 20.0
TERM_GRACE_S = 3.0


class LabError(RuntimeError):
    """Building or tearing down the emulated network failed; the message carries the command and
    what ``ip``/``tc`` said."""


class LabUnavailable(LabError):
    """The emulated network cannot be built here (not root, not Linux, ``ip``/``tc`` missing, or
    namespaces/tbf refused by the kernel). Callers fall back to loopback without shaping."""


def unavailable_reason() -> str | None:
    """Why :class:`WanNetwork` cannot work on this machine, or ``None`` if it should.

    Cheap static checks only (platform, root, tools on PATH); the kernel can still refuse when
    the network is built, which raises :class:`LabUnavailable` then.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or use the loopback fall-back)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH (install iproute2)"
    return None


def allowed_congestion_controls() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
    except OSError:
        return ""


def tbf_parameters(rate_bps: float) -> tuple[int, int]:
    """Burst and queue limit in bytes for a tbf shaping ``rate_bps``.

    * burst: 10 ms worth of traffic at the rate, at least 16 KiB. The bucket must hold at least
      one full frame plus what arrives between two wake-ups of the qdisc; with a smaller bucket
      the link idles between timer ticks and the achieved rate falls short at 100 Mbit/s and up.
      At 1-10 Mbit/s, 16 KiB is an initial burst of 13-130 ms, small next to the seconds a bulk
      transfer takes. (Linux splits GSO super-packets larger than the bucket, so it need not
      hold 64 KiB.)
    * limit (queue): 100 ms of traffic on top of the burst, at least 64 KiB; this is tc's
      ``latency 100ms``, with a floor so that slow links still queue a few packets. It is the
      only queueing delay the emulation adds. Shorter queues make TCP lose packets and fall
      short at 10 Mbit/s; longer ones only add delay.

    One bulk TCP flow gets close to the shaped rate less the TCP/IP headers at every rate from
    1 Mbit/s to 1 Gbit/s (docs/BENCHMARKS.md, "0. The shaping itself: one TCP flow per tbf
    rate").

    Raises ``ValueError`` for a rate that is not a finite positive number.
    """
    if not (isinstance(rate_bps, (int, float)) and math.isfinite(rate_bps) and rate_bps > 0):
        raise ValueError(f"rate must be a finite positive number of bits/s, got {rate_bps!r}")
    bytes_per_s = rate_bps / 8.0
    burst = max(16 * 1024, int(bytes_per_s * 0.010))
    limit = burst + max(64 * 1024, int(bytes_per_s * 0.100))
    return burst, limit


@dataclass(frozen=True, kw_only=True)
class Node:
    """One endpoint of the emulated network: the coordinator or a peer."""

    role: Literal["coordinator", "peer"]
    """What runs here."""
    index: int
    """Peer index 0..n-1; -1 for the coordinator."""
    netns: str
    """Name of its network namespace (``ip netns exec <netns> ...``)."""
    ip: str
    """Its address on the emulated network."""
    ifname: str
    """Its interface inside the namespace (set ``GLOO_SOCKET_IFNAME`` to this)."""
    bridge_port: str
    """The bridge-side end of its veth, in the bridge namespace (shapes its download)."""
    rate_bps: float | None
    """Shaped rate in each direction, bits/s; ``None``: unshaped."""
    impairment: Impairment | None = None
    """Round trip, jitter and loss of its link (a delay line carries it); ``None``: a veth."""
    bridge: str = "br0"
    """The bridge its link joins (its site's), in the bridge namespace."""
    wan_ip: str | None = None
    """Behind NAT: its router's address on the emulated network (``ip`` is then its private
    address behind the router, which nothing outside can reach); None: not behind NAT."""

    @property
    def router_netns(self) -> str | None:
        """Behind NAT: the namespace of its router (which holds the shaped link); else None."""
        return None if self.wan_ip is None else f"{self.netns}-r"


def run_cmd(argv: Sequence[str], *, check: bool = True, timeout_s: float = CMD_TIMEOUT_S) -> str:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LabError(f"`{' '.join(argv)}` failed: {e}") from e
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``); raises :class:`LabError`."""
    out = run_cmd(["ip", "netns", "list"])
    # lines look like "name (id: 3)" or just "name"
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(netns: str, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM every process in ``netns``, then SIGKILL those still there after ``grace_s``.

    Deleting a namespace's name while processes live in it would leave it (and its veth) alive but
    invisible, which is why this runs before ``ip netns del``.
    """

    def pids() -> list[int]:
        out = run_cmd(["ip", "netns", "pids", netns], check=False)
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    running = pids()
    if not running:
        return
    for pid in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = pids()
    for pid in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def delete_namespace(netns: str) -> None:
    kill_namespace_processes(netns)
    run_cmd(["ip", "netns", "del", netns], check=False)


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns failed: {os.strerror(err)}")


@contextlib.contextmanager
def inside_namespace(netns: str) -> Iterator[None]:
    """Move the *calling thread* into network namespace ``netns`` for the ``with`` block.

    Sockets created by this thread, and threads it starts, live in ``netns`` for good (a thread
    keeps the namespace it was created in); the thread itself returns to its own namespace when
    the block ends, also on an exception. The lab starts its embedded coordinator this way, so that
    the coordinator listens on the bridge while the rest of the process stays where it was.
    Needs root; raises :class:`LabError` if the namespace does not exist or cannot be entered.
    """
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    except OSError as e:
        raise LabError(f"cannot open this thread's network namespace: {e}") from e
    try:
        try:
            target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        except OSError as e:
            raise LabError(f"no network namespace {netns!r}: {e}") from e
        try:
            try:
                _setns(target)
            except OSError as e:
                raise LabError(f"cannot enter network namespace {netns!r}: {e}") from e
            try:
                yield
            finally:
                # failing to return would leave this thread cut off from the host's network
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def _run_name_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-([0-9a-f]{{4}})-(br|c|p\d+)$")


def cleanup_stale(prefix: str = "isth", *, include_live: bool = False) -> list[str]:
    """Remove namespaces left behind by crashed runs that used ``prefix``; returns their names.

    A run's names carry the pid of the process that built it; namespaces whose pid is still alive
    belong to a running network and are kept unless ``include_live`` is true. Processes still
    inside a removed namespace are terminated first. Raises :class:`LabUnavailable` without root
    or ``ip``, and ``ValueError`` for a malformed prefix.
    """
    check_prefix(prefix)
    reason = unavailable_reason()
    if reason is not None:
        raise LabUnavailable(reason)
    pattern = _run_name_re(prefix)
    removed = []
    # bridges last: deleting a peer namespace first destroys its veth cleanly
    names = sorted(list_namespaces(), key=lambda n: n.endswith("-br"))
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        if not include_live and _pid_alive(int(m.group(1))):
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"prefix must be 1-12 lowercase letters/digits starting with a letter, got {prefix!r}"
        )
