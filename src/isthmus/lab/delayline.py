"""Latency, jitter and loss in user space: this kernel has no netem, so a process carries them.

A **delay line** is one process that owns two or more TAP devices, each in a namespace of the run,
and moves Ethernet frames between them: every frame read from one port waits in a queue for its
path's one-way delay (plus jitter) before it is written to the port it is going to, or is dropped
with the path's loss probability. The kernel still does everything else: the bridge switches,
tbf/htb shape the rate on the TAPs' egress (so a frame is serialized first and then propagates,
as on a real link), TCP runs unmodified in the namespaces.

Two shapes of line exist (:mod:`isthmus.lab.wan` builds them):

* an **access link**: two ports, a node's ``wan0`` in its namespace and its bridge port in the
  bridge's namespace, in place of the veth pair an undelayed link uses;
* a **site core**: one port per site, each enslaved to its site's bridge; frames go to the port
  that learned their destination MAC (broadcasts and unknown destinations to every other port),
  with each pair of sites its own delay, jitter and loss.

Why it is fast enough in Python: the TAPs use virtio-net headers with checksum and TCP
segmentation offload, so the stack hands the line 64 KiB super-packets (TSO) and takes them back
whole: at 1 Gbit/s that is a few thousand reads and writes a second, not 80,000. A port of a lossy
path is opened without TSO, so loss hits single MTU frames as on a real link (at a higher CPU cost
per byte). Order is kept on each path (a frame never leaves before the one ahead of it, even when
jitter would say so); each path's queue is bounded in bytes (tail drop). Frames are timed with
``select``'s microsecond timeout, and the process runs SCHED_FIFO where allowed, so that a frame
does not wait behind a peer's training step for its turn on a CPU (hosts and network share this
machine's cores; on a real WAN they do not).

This module imports only the standard library and runs as a file (``python -I delayline.py``):
a line starts in a small fraction of the time ``import isthmus`` (torch) takes.

The process ends when its lifeline (a pipe whose write end only the process that built the network
holds) reaches end of file, so a SIGKILLed owner takes its lines with it; SIGTERM and SIGINT end it
too. Its TAPs are not persistent: they vanish with its file descriptors. It stays in the namespace
``home`` so that tearing that namespace down (or :func:`isthmus.lab.netns.cleanup_stale`) finds and
kills it. A port that disappears under it (its namespace deleted first) ends it with exit status
1 and the reason on stderr. On exit it prints one JSON line of counters on stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import resource
import select
import signal
import struct
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "VNET_HDR_LEN",
    "Forwarder",
    "LineConfig",
    "PathConfig",
    "PortConfig",
    "main",
    "open_tap",
]

# linux/if_tun.h
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM = 0x01
_TUN_F_TSO4 = 0x02
_TUN_F_TSO6 = 0x04

VNET_HDR_LEN = 10
"""sizeof(struct virtio_net_hdr): every frame read or written carries one in front."""
_READ_SIZE = 65536 + 1024
_READ_BATCH = 256
"""Frames read from one port per wake-up before the others get a turn (and due frames leave)."""
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True, kw_only=True)
class PortConfig:
    """One TAP device of a line."""

    netns: str
    """The namespace it is created in."""
    ifname: str
    """Its name there (at most 15 characters)."""
    tso: bool = True
    """Accept TCP super-packets from the stack (off on ports of a lossy path: loss per frame)."""


@dataclass(frozen=True, kw_only=True)
class PathConfig:
    """One direction between two ports: what a frame going from ``src`` to ``dst`` goes through."""

    src: int
    dst: int
    delay_s: float = 0.0
    """One-way delay."""
    jitter_s: float = 0.0
    """Each frame's delay is ``delay_s`` plus a uniform draw in ``[-jitter_s, +jitter_s]``
    (never below zero, never ahead of the frame before it)."""
    loss: float = 0.0
    """Probability that a frame is dropped on this path."""
    limit_bytes: int = 64 << 20
    """Bound on the bytes waiting on this path; frames beyond it are dropped."""


@dataclass(frozen=True, kw_only=True)
class LineConfig:
    """A whole line: its ports, its paths (pairs without a path are not connected) and where the
    process lives."""

    name: str
    """For messages (``peer2``, ``core``)."""
    ports: tuple[PortConfig, ...]
    paths: tuple[PathConfig, ...]
    home: str
    """Namespace the process stays in once its ports exist (teardown of it kills the process)."""
    seed: int = 0
    """Seed of the jitter and loss draws."""

    def __post_init__(self) -> None:
        if len(self.ports) < 2:
            raise ValueError(f"delay line {self.name!r} needs at least two ports")
        for p in self.paths:
            if not (0 <= p.src < len(self.ports) and 0 <= p.dst < len(self.ports)) or (
                p.src == p.dst
            ):
                raise ValueError(f"delay line {self.name!r}: bad path {p.src}->{p.dst}")
            if p.delay_s < 0 or p.jitter_s < 0 or not 0 <= p.loss < 1 or p.limit_bytes < 1:
                raise ValueError(f"delay line {self.name!r}: bad path values {p}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LineConfig:
        raw = json.loads(text)
        return cls(
            name=raw["name"],
            ports=tuple(PortConfig(**p) for p in raw["ports"]),
            paths=tuple(PathConfig(**p) for p in raw["paths"]),
            home=raw["home"],
            seed=raw["seed"],
        )


def open_tap(ifname: str, *, tso: bool) -> int:
    """Create TAP device ``ifname`` in the calling thread's namespace; returns its non-blocking
    file descriptor (the device lives as long as it is open). Raises ``OSError`` (no
    ``/dev/net/tun``, a name already taken, no CAP_NET_ADMIN)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", ifname.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
        offload = _TUN_F_CSUM | (_TUN_F_TSO4 | _TUN_F_TSO6 if tso else 0)
        fcntl.ioctl(fd, _TUNSETOFFLOAD, offload)
    except BaseException:
        os.close(fd)
        raise
    return fd


def enter_namespace(netns: str) -> None:
    """Move this (single-threaded) process into network namespace ``netns``; ``OSError`` if it
    cannot. (:mod:`isthmus.lab.netns` has the same, but importing ``isthmus`` imports torch.)"""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, _CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- the process


class _Stop(Exception):
    pass


class _Path:
    """A path's queue and counters (the forwarder's hot state)."""

    __slots__ = (
        "bytes_out",
        "cfg",
        "dropped_limit",
        "dropped_loss",
        "dropped_write",
        "dst_fd",
        "frames_in",
        "frames_out",
        "last_due",
        "max_queued",
        "queue",
        "queued",
    )

    def __init__(self, cfg: PathConfig, dst_fd: int) -> None:
        self.cfg = cfg
        self.dst_fd = dst_fd
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.last_due = 0.0
        self.frames_in = self.frames_out = self.bytes_out = 0
        self.dropped_loss = self.dropped_limit = self.dropped_write = self.max_queued = 0

    def counters(self) -> dict[str, Any]:
        return {
            "src": self.cfg.src,
            "dst": self.cfg.dst,
            "frames_in": self.frames_in,
            "frames_out": self.frames_out,
            "bytes_out": self.bytes_out,
            "dropped_loss": self.dropped_loss,
            "dropped_limit": self.dropped_limit,
            "dropped_write": self.dropped_write,
            "max_queued_bytes": self.max_queued,
        }


class Forwarder:
    """The line's loop over already-open descriptors, one per port (TAPs in the process; any
    datagram socket in tests): :meth:`run` forwards until the lifeline reaches end of file,
    :meth:`counters` reports per path."""

    def __init__(self, cfg: LineConfig, fds: list[int]) -> None:
        self.cfg = cfg
        self.fds = fds
        self.rng = random.Random(cfg.seed)
        self.paths: dict[tuple[int, int], _Path] = {
            (p.src, p.dst): _Path(p, fds[p.dst]) for p in cfg.paths
        }
        self.out_of: list[list[_Path]] = [
            [q for (s, _), q in self.paths.items() if s == i] for i in range(len(fds))
        ]
        self.port_of_fd = {fd: i for i, fd in enumerate(fds)}
        self.mac_port: dict[bytes, int] = {}
        self.two_ports = len(fds) == 2
        self.scheduling = "normal"
        """How the process is scheduled (see :func:`_prioritize`), for the counters."""

    def _targets(self, src: int, frame: bytes) -> list[_Path]:
        if self.two_ports:
            return self.out_of[src]
        # a learning switch: remember where each source MAC lives; broadcast, multicast and
        # unknown destinations go to every other port
        h = VNET_HDR_LEN
        self.mac_port[frame[h + 6 : h + 12]] = src
        dst = frame[h : h + 6]
        if not dst[0] & 1:
            port = self.mac_port.get(dst)
            if port is not None:
                path = self.paths.get((src, port))
                return [path] if path is not None else []
        return self.out_of[src]

    def _take(self, src: int, frame: bytes, now: float) -> None:
        for path in self._targets(src, frame):
            c = path.cfg
            path.frames_in += 1
            if c.loss and self.rng.random() < c.loss:
                path.dropped_loss += 1
                continue
            if path.queued + len(frame) > c.limit_bytes:
                path.dropped_limit += 1
                continue
            due = now + c.delay_s
            if c.jitter_s:
                due = max(now, due + self.rng.uniform(-c.jitter_s, c.jitter_s))
            # order is kept: a frame never overtakes the one ahead of it on its path
            if due < path.last_due:
                due = path.last_due
            path.last_due = due
            path.queue.append((due, frame))
            path.queued += len(frame)
            if path.queued > path.max_queued:
                path.max_queued = path.queued

    def _release(self, now: float) -> float | None:
        """Write every frame that is due; returns the earliest due time still waiting."""
        nxt: float | None = None
        for path in self.paths.values():
            q = path.queue
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                path.queued -= len(frame)
                try:
                    os.write(path.dst_fd, frame)
                except OSError:
                    # the device is going away (teardown) or the kernel is out of buffers
                    path.dropped_write += 1
                    continue
                path.frames_out += 1
                path.bytes_out += len(frame) - VNET_HDR_LEN
            if q and (nxt is None or q[0][0] < nxt):
                nxt = q[0][0]
        return nxt

    def run(self, lifeline: int) -> None:
        watch = [*self.fds, lifeline]
        nxt: float | None = None
        while True:
            now = time.monotonic()
            # select, not poll: its timeout has microsecond resolution, poll's milliseconds
            timeout = None if nxt is None else max(0.0, nxt - now)
            readable, _, _ = select.select(watch, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == lifeline:
                    if not os.read(lifeline, 64):
                        return  # the owner is gone: so is the network
                    continue
                src = self.port_of_fd[fd]
                for _ in range(_READ_BATCH):
                    try:
                        frame = os.read(fd, _READ_SIZE)
                    except BlockingIOError:
                        break
                    except OSError as e:
                        # the device is gone (its namespace was deleted): the link is cut for
                        # good, and select would report the descriptor ready forever
                        raise OSError(e.errno, f"port {self.cfg.ports[src].ifname}: {e}") from e
                    self._take(src, frame, now)
            nxt = self._release(time.monotonic())

    def counters(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "name": self.cfg.name,
            "scheduling": self.scheduling,
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "user_s": round(ru.ru_utime, 3),
            "paths": [p.counters() for p in self.paths.values()],
        }


RT_PRIORITY = 10
"""SCHED_FIFO priority of a line: above every normal process, far below the kernel's threads."""


def _prioritize() -> str:
    """Run ahead of the peers: on a real WAN the network does not wait for a host's CPU, and a
    line that waits behind a training step delays every frame it holds. SCHED_FIFO where allowed
    (the kernel's real-time throttling still leaves 5% of each CPU to others, and the loop never
    spins: it sleeps in select until a frame arrives or one is due), else a lower nice value,
    else nothing. Returns which one it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        return f"fifo:{RT_PRIORITY}"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-10)
        return "nice:-10"
    except OSError:
        return "normal"


def _serve(cfg: LineConfig, lifeline: int) -> int:
    def stop(signum: int, frame: Any) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    fds: list[int] = []
    forwarder: Forwarder | None = None
    try:
        for port in cfg.ports:
            enter_namespace(port.netns)
            fds.append(open_tap(port.ifname, tso=port.tso))
        enter_namespace(cfg.home)
        forwarder = Forwarder(cfg, fds)
        forwarder.scheduling = _prioritize()
        print("ready", flush=True)
        forwarder.run(lifeline)
    except _Stop:
        pass
    except OSError as e:
        print(f"delay line {cfg.name}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if forwarder is not None:
            with contextlib.suppress(OSError, ValueError):
                print(json.dumps(forwarder.counters()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -I .../delayline.py LIFELINE_FD CONFIG_JSON``, as
    :class:`isthmus.lab.lines.DelayLine` starts it."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -I delayline.py LIFELINE_FD CONFIG_JSON", file=sys.stderr)
        return 2
    return _serve(LineConfig.from_json(args[1]), int(args[0]))


if __name__ == "__main__":
    sys.exit(main())
