"""The kernel's counters of this process's TCP connections: how many bytes each has had
acknowledged and received, and whether data is waiting, from ``getsockopt(TCP_INFO)``.

Why: Gloo reports nothing while a collective runs, so the only place to see whether its bytes
still move is the kernel's view of the group's connections. ``struct tcp_info`` (what ``ss -ti``
shows; ``/proc/net/tcp`` only has queue sizes) holds, per connection, ``bytes_acked`` (what the
remote kernel confirmed) and ``bytes_received``, the data in flight (``unacked``, in segments)
and written but not yet sent (``notsent_bytes``), and how long ago the last acknowledgement
arrived. These tell a slow link (counters advance), a silent path (data in flight, no
acknowledgement: retransmitting; or data queued, nothing in flight, probes unanswered: a path
that died behind a closed window, or a local firewall that drops what is sent) and a remote
process that stopped reading (nothing in flight, data queued, the window closed,
acknowledgements of window probes still arriving) apart.

Sockets are read on a private duplicate of a descriptor found by inode (as
:mod:`isthmus.comm.wires` cuts them), so a descriptor Gloo closes meanwhile is never touched.
Linux only; elsewhere, or on a kernel without these fields, readers return nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

from isthmus.comm.progress import ConnSample, ProgressConfig, ProgressWatch, Verdict

__all__ = ["TcpInfo", "TcpWatch", "conn_sample", "parse_tcp_info", "read_fd", "read_inodes"]

# Offsets in struct tcp_info (include/uapi/linux/tcp.h); the fields this module needs are all in
# the part that Linux 4.6 and later return.
_BASE = struct.Struct("=BBBBBBBB")  # state, ca_state, retransmits, probes, backoff, ...
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_OFF_RTO = 8
_OFF_UNACKED = 24
_OFF_LAST_DATA_RECV = 52
_OFF_LAST_ACK_RECV = 56
_OFF_RTT = 68
_OFF_TOTAL_RETRANS = 100
_OFF_BYTES_ACKED = 120
_OFF_BYTES_RECEIVED = 128
_OFF_NOTSENT = 144
_OFF_DATA_SEGS_IN = 152
_OFF_SND_WND = 228  # newer kernels only
_NEEDED = _OFF_NOTSENT + 4
_READ = 256  # more than any field read; the kernel returns what it has

_ESTABLISHED = 1


@dataclass(frozen=True)
class TcpInfo:
    """One connection's counters at one instant.

    ``bytes_acked``/``bytes_received``: totals since the connection opened. ``unacked``:
    segments in flight. ``notsent``: bytes written but not yet sent. ``last_ack_ms``/
    ``last_data_ms``: milliseconds since the last acknowledgement / data arrived.
    ``retransmits``, ``backoff``: the current retransmission (or window probe) streak.
    ``probes``: window probes (or attempts to send queued data) unanswered in a row.
    ``snd_wnd``: the window the remote offers, None where the kernel does not say.
    ``rto_us``: the current retransmission timeout. ``data_segs_in``: data segments received,
    in order or not (duplicates too), None where the kernel does not say.
    """

    established: bool
    bytes_acked: int
    bytes_received: int
    unacked: int
    notsent: int
    last_ack_ms: int
    last_data_ms: int
    retransmits: int
    backoff: int
    total_retrans: int
    rtt_us: int
    snd_wnd: int | None
    rto_us: int = 0
    data_segs_in: int | None = None
    probes: int = 0


def parse_tcp_info(buf: bytes) -> TcpInfo | None:
    """Decode ``getsockopt(IPPROTO_TCP, TCP_INFO)``'s bytes; None if they are too short to hold
    the byte counters (a kernel older than 4.6)."""
    if len(buf) < _NEEDED:
        return None
    state, _ca, retransmits, probes, backoff, *_ = _BASE.unpack_from(buf, 0)
    u32 = lambda off: _U32.unpack_from(buf, off)[0]  # noqa: E731
    return TcpInfo(
        established=state == _ESTABLISHED,
        bytes_acked=_U64.unpack_from(buf, _OFF_BYTES_ACKED)[0],
        bytes_received=_U64.unpack_from(buf, _OFF_BYTES_RECEIVED)[0],
        unacked=u32(_OFF_UNACKED),
        notsent=u32(_OFF_NOTSENT),
        last_ack_ms=u32(_OFF_LAST_ACK_RECV),
        last_data_ms=u32(_OFF_LAST_DATA_RECV),
        retransmits=retransmits,
        backoff=backoff,
        total_retrans=u32(_OFF_TOTAL_RETRANS),
        rtt_us=u32(_OFF_RTT),
        snd_wnd=u32(_OFF_SND_WND) if len(buf) >= _OFF_SND_WND + 4 else None,
        rto_us=u32(_OFF_RTO),
        data_segs_in=u32(_OFF_DATA_SEGS_IN) if len(buf) >= _OFF_DATA_SEGS_IN + 4 else None,
        probes=probes,
    )


def read_fd(fd: int) -> TcpInfo | None:
    """The counters of the TCP socket open as ``fd``, read on a private duplicate (closed
    again); None if ``fd`` is not a TCP socket (or was closed meanwhile)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with s:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        try:
            return parse_tcp_info(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _READ))
        except OSError:
            return None


def read_inodes(inodes: Iterable[int]) -> dict[int, TcpInfo]:
    """The counters of the sockets ``inodes`` that this process still has open, by inode.

    A socket no longer open (Gloo closed it, or it never was this process's) is left out; the
    descriptor found for an inode is checked again on the duplicate before it is read."""
    want = set(inodes)
    out: dict[int, TcpInfo] = {}
    if not want:
        return out
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing can be found
        return out
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not link.startswith("socket:["):
            continue
        inode = int(link[8:-1])
        if inode not in want or inode in out:
            continue
        info = _read_checked(int(name), inode)
        if info is not None:
            out[inode] = info
    return out


def _read_checked(fd: int, inode: int) -> TcpInfo | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:  # the number names another socket now
            return None
        return read_fd(dup)
    finally:
        os.close(dup)


def conn_sample(key: Hashable, remote: str, info: TcpInfo) -> ConnSample:
    """``info`` as a :class:`~isthmus.comm.progress.ConnSample`: data in flight when segments
    await acknowledgement, queued when written bytes wait (the remote's window is closed), with
    the current streak of retransmission timeouts and of unanswered probes, the data segments
    received (in order or not) and the retransmission timeout."""
    return ConnSample(
        key=key,
        remote=remote,
        acked=info.bytes_acked,
        received=info.bytes_received,
        in_flight=info.unacked > 0,
        queued=info.notsent > 0 or info.snd_wnd == 0,
        retransmits=info.retransmits,
        probes=info.probes,
        segs_in=info.data_segs_in,
        rto_s=info.rto_us / 1e6 if info.rto_us else None,
    )


class TcpWatch:
    """A :class:`~isthmus.comm.progress.ProgressWatch` over sockets of this process, sampled
    every ``period_s`` on a daemon thread. ``conns()`` says which sockets to watch at each
    sample (inode -> the remote's name or address); a socket it no longer lists, or that is
    closed, is forgotten. :meth:`verdict` is safe from any thread. The thread ends at
    :meth:`stop` (also as a context manager); an exception from ``conns()`` skips that sample.
    """

    def __init__(
        self,
        conns: Callable[[], Mapping[int, str]],
        config: ProgressConfig | None = None,
        *,
        period_s: float = 0.25,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"TcpWatch period_s: must be > 0, got {period_s!r}")
        self._conns = conns
        self._period = period_s
        self._lock = threading.Lock()
        self._watch = ProgressWatch(config, started=time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="isthmus-tcpwatch")

    def start(self) -> TcpWatch:
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> None:
        """Take one sample now (the thread does this every ``period_s``)."""
        try:
            named = dict(self._conns())
        except Exception:  # the caller's view of its sockets failed: try again next period
            return
        infos = read_inodes(named)
        now = time.monotonic()
        with self._lock:
            self._watch.sample(now, [conn_sample(k, named[k], i) for k, i in infos.items()])

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.sample()

    def verdict(self, *, since: float | None = None) -> Verdict:
        """The watch's verdict now, for a transfer that began at ``since`` (monotonic seconds;
        default: when the watch was made)."""
        with self._lock:
            return self._watch.verdict(now=time.monotonic(), since=since)

    def in_flight(self) -> bool:
        """:meth:`ProgressWatch.in_flight` at the last sample."""
        with self._lock:
            return self._watch.in_flight()

    def silent(self) -> list[tuple[str, float]]:
        """:meth:`ProgressWatch.silent` now."""
        with self._lock:
            return self._watch.silent(time.monotonic())

    def describe(self) -> str:
        """:meth:`ProgressWatch.describe` now."""
        with self._lock:
            return self._watch.describe(time.monotonic())

    def moved_within(self, floor_s: float) -> bool:
        """:meth:`ProgressWatch.moved_within` now."""
        with self._lock:
            return self._watch.moved_within(floor_s, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def __enter__(self) -> TcpWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
