"""Liveness inside an island, and the leader's word to its followers, over UDP.

A rank of an island that is SIGSTOPped keeps its sockets open: the island's own process group
(the user's, with torch's default timeout of many minutes) and the cross-island groups would
wait for it, and the leader would keep heartbeating for an island that cannot work. So every
rank of an island runs an :class:`IslandWatch`: a thread that sends a datagram to every other
rank every ``interval`` seconds and calls ``on_lost`` with the ranks it has not heard from in
``timeout`` seconds (the coordinator's ``heartbeat_timeout``: a rank is held to the bound a peer
is held to). The island session's ``on_lost`` ends the process, which ends the island as a
whole: the launcher's agent (or torchrun) stops the other ranks, the leader's heartbeats stop,
the sockets of every group close, and ``--max-restarts`` starts the island again.

The same channel carries the leader's relay of the coordinator's round aborts
(:meth:`IslandWatch.tell_abort`), so that a follower cuts its own cross-island groups at once
rather than waiting for the far ends to close. Datagrams are tiny and never block the sender;
an abort is sent three times, since a datagram may be dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["IslandWatch", "bind_watch"]

log = logging.getLogger(__name__)

ABORT_COPIES = 3


def bind_watch() -> tuple[socket.socket, tuple[str, int]]:
    """A UDP socket for this rank's watch, and the address (host name, port) the other ranks
    reach it at (they use 127.0.0.1 when they run on the same host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    return sock, (socket.gethostname(), int(sock.getsockname()[1]))


class IslandWatch:
    """Rank ``rank``'s watch over the other ranks of its island (see the module docstring).

    ``addresses``: every rank's (host name, port), from :func:`bind_watch` on each, gathered in
    rank order. ``on_lost(ranks)`` runs once, on the watch's thread, when those ranks have been
    silent for ``timeout`` seconds; ``on_abort(epoch, round, reason)`` on every relayed abort.
    A rank that closes its watch (:meth:`close`) says goodbye and is no longer watched.
    """

    def __init__(
        self,
        rank: int,
        sock: socket.socket,
        addresses: list[tuple[str, int]],
        *,
        interval: float,
        timeout: float,
        on_lost: Callable[[list[int]], None],
        on_abort: Callable[[int, int, str], None] | None = None,
    ) -> None:
        if interval <= 0 or timeout <= interval:
            raise ValueError(f"need 0 < interval < timeout, got {interval} and {timeout}")
        self.rank = rank
        self.timeout = timeout
        self.interval = interval
        self._sock = sock
        me = addresses[rank][0]
        self._peers = {
            r: ("127.0.0.1" if host == me else host, port)
            for r, (host, port) in enumerate(addresses)
            if r != rank
        }
        now = time.monotonic()
        self._heard = dict.fromkeys(self._peers, now)
        self._on_lost = on_lost
        self._on_abort = on_abort
        self._stop = threading.Event()
        self.lost: list[int] = []
        """The ranks found silent (empty while every rank is heard)."""
        self._thread = threading.Thread(target=self._run, name=f"island-watch{rank}", daemon=True)
        self._thread.start()

    def tell_abort(self, epoch: int, round: int, reason: str) -> None:
        """Relay a round abort to every other rank (their ``on_abort`` runs)."""
        self._send({"abort": [epoch, round, reason[:500]]}, copies=ABORT_COPIES)

    def close(self) -> None:
        """Stop watching and tell the other ranks so, so that this rank's exit is not taken for
        a failure. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._send({"bye": True}, copies=ABORT_COPIES)
        self._thread.join(timeout=2 * self.interval)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _send(self, body: dict[str, object], *, copies: int = 1) -> None:
        data = json.dumps({"r": self.rank, **body}).encode()
        for _ in range(copies):
            for addr in list(self._peers.values()):
                with contextlib.suppress(OSError):  # an unreachable rank is found by silence
                    self._sock.sendto(data, addr)

    def _run(self) -> None:
        next_beat = 0.0
        self._sock.settimeout(self.interval / 4)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send({})
                next_beat = now + self.interval
            try:
                data, _addr = self._sock.recvfrom(2048)
            except (TimeoutError, OSError):
                data = b""
            if data:
                self._receive(data)
            now = time.monotonic()
            silent = sorted(r for r, t in self._heard.items() if now - t > self.timeout)
            if silent and not self._stop.is_set():
                self.lost = silent
                log.error(
                    "island rank %d: rank(s) %s silent for %.1f s (stopped or dead)",
                    self.rank, silent, self.timeout,
                )  # fmt: skip
                self._on_lost(silent)
                return

    def _receive(self, data: bytes) -> None:
        try:
            msg = json.loads(data)
            r = int(msg["r"])
        except (ValueError, KeyError, TypeError):
            return  # not ours: ignore
        if r not in self._heard:
            return
        if msg.get("bye"):
            del self._heard[r]
            return
        self._heard[r] = time.monotonic()
        abort = msg.get("abort")
        if abort and self._on_abort is not None:
            epoch, rnd, reason = abort
            self._on_abort(int(epoch), int(rnd), str(reason))
