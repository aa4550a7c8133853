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
an abort is sent three times, since a datagram may be dropped. It also carries the probes of a
pair of islands rank to rank (:mod:`isthmus.comm.island_probe`): the leader asks one follower
for its paths (:meth:`IslandWatch.tell_probe`, ``{"probe": [token, [host:port, ...]]}``) and
the follower answers (:meth:`IslandWatch.tell_probed`, ``{"probed": [token, [how, ...]]}``); a
lost one costs that probe its outcome, never a wrong one.

Only the leader heartbeats, so each follower's beat to the leader also carries what its own
cross-island connections say of the round (its ``status``: ``{epoch, round, moving, silent}``,
as :func:`isthmus.comm.unacked.transfer_info` makes it, at most :data:`MAX_RELAYED` silent
entries), and :func:`island_transfer` merges those into the island's ``info.transfer``: the
island moves if any rank's transfer moves or a rank has not said (lately, about this round)
that nothing moves; its ``silent`` lists every rank's claims. A claim's ``rank`` is already the
member (island) it names: every cross-island group of an epoch ranks its members in the round
plan's order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

__all__ = ["ISLAND_LOST_EXIT", "IslandWatch", "bind_watch", "island_lost", "island_transfer"]

log = logging.getLogger(__name__)

ABORT_COPIES = 3

ISLAND_LOST_EXIT = 75
"""The exit status of a rank that found another rank of its island silent (stopped or dead)
for the coordinator's ``heartbeat_timeout``: it ends itself so that its island leaves whole."""

MAX_RELAYED = 16
"""At most this many ``silent`` entries travel in one follower's beat (a datagram stays small;
a claim names a member, and a round has few members that one rank's groups reach)."""

MAX_MERGED = 64
"""At most this many ``silent`` entries in the island's merged ``info.transfer`` (the
coordinator reads no more)."""

STALE_BEATS = 3
"""A follower's relayed transfer is used while it is at most this many beat intervals old; an
older one says nothing (and the island counts as moving)."""


def _claims(value: Any) -> dict[tuple[int, int], float]:
    """``transfer.silent`` entries as ``{(epoch, rank): for_s}``; malformed ones are left out."""
    out: dict[tuple[int, int], float] = {}
    if not isinstance(value, list):
        return out
    for e in value:
        if not isinstance(e, dict):
            continue
        epoch, rank, for_s = e.get("epoch"), e.get("rank"), e.get("for_s")
        if any(isinstance(x, bool) for x in (epoch, rank, for_s)):
            continue
        if isinstance(epoch, int) and isinstance(rank, int) and isinstance(for_s, (int, float)):
            key = (epoch, rank)
            out[key] = max(float(for_s), out.get(key, 0.0))
    return out


def _silent_list(claims: Mapping[tuple[int, int], float], limit: int) -> list[dict[str, Any]]:
    """Claims as ``transfer.silent`` entries, the longest silence first, at most ``limit``."""
    ordered = sorted(claims.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return [{"epoch": e, "rank": r, "for_s": round(s, 1)} for (e, r), s in ordered]


def island_transfer(
    own: dict[str, Any] | None, followers: Mapping[int, dict[str, Any] | None], size: int
) -> dict[str, Any] | None:
    """The island's ``info.transfer``, from the leader's own (``own``, of its cross-island
    group) and each follower's relayed one (``followers``, by local rank; a rank absent or None
    has said nothing lately) in an island of ``size`` ranks.

    Inside a round (``own`` names its ``epoch`` and ``round``) the island is ``moving`` unless
    every rank says, about that very round, that nothing moves: one rank that moves, has not
    begun the round, or has not been heard from keeps the island in its transfer (as a plain
    peer's unknown is). ``silent`` is the union of every rank's claims (the longest per member
    and epoch), whether or not the round still runs. None when outside a round nothing is
    silent. Malformed relayed entries are ignored."""
    claims = _claims((own or {}).get("silent"))
    for info in followers.values():
        for key, s in _claims((info or {}).get("silent")).items():
            claims[key] = max(s, claims.get(key, 0.0))
    silent = _silent_list(claims, MAX_MERGED)
    if own is None or "round" not in own:
        return {"silent": silent} if silent else None
    key = (own.get("epoch"), own.get("round"))
    moving = own.get("moving") is not False
    for r in range(1, size):
        info = followers.get(r)
        if not isinstance(info, dict) or (info.get("epoch"), info.get("round")) != key:
            moving = True  # not heard, or not in this round yet: about to transfer
        elif info.get("moving") is not False:
            moving = True
    out: dict[str, Any] = {"epoch": own.get("epoch"), "round": own.get("round"), "moving": moving}
    if silent:
        out["silent"] = silent
    return out


def island_lost(who: str, ranks: list[int]) -> NoReturn:
    """End this process with :data:`ISLAND_LOST_EXIT`, saying why on stderr: ``ranks`` of
    ``who``'s island were silent for the watch's bound. Called on the watch's thread while
    the main thread may be blocked in a collective with the silent rank, which nothing can
    interrupt: ending the process ends the island."""
    print(
        f"isthmus island: {who}: rank(s) {ranks} of the island silent (stopped or dead); this "
        f"rank exits with {ISLAND_LOST_EXIT} so that the island leaves as a whole",
        file=sys.stderr,
        flush=True,
    )
    os._exit(ISLAND_LOST_EXIT)


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
    ``status()``, on a follower: its transfer as its heartbeat would say it, sent with each beat
    to rank 0 (its ``silent`` cut to :data:`MAX_RELAYED` entries; a status that raises sends
    nothing); the leader reads the followers' latest with :meth:`transfers`.
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
        status: Callable[[], dict[str, Any] | None] | None = None,
        on_probe: Callable[[int, list[str]], None] | None = None,
        on_probed: Callable[[int, int, list[str | None]], None] | None = None,
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
        self._on_probe, self._on_probed = on_probe, on_probed
        self._status = status if rank != 0 else None
        self._relayed: dict[int, tuple[float, dict[str, Any] | None]] = {}  # on rank 0
        self._status_failed = False
        self._stop = threading.Event()
        self.lost: list[int] = []
        """The ranks found silent (empty while every rank is heard)."""
        self._thread = threading.Thread(target=self._run, name=f"island-watch{rank}", daemon=True)
        self._thread.start()

    def tell_abort(self, epoch: int, round: int, reason: str) -> None:
        """Relay a round abort to every other rank (their ``on_abort`` runs)."""
        self._send({"abort": [epoch, round, reason[:500]]}, copies=ABORT_COPIES)

    def tell_probe(self, rank: int, token: int, addresses: list[str]) -> None:
        """Ask rank ``rank`` to probe ``addresses`` (its ``on_probe(token, addresses)`` runs)."""
        self._send_to(rank, {"probe": [token, addresses[:32]]})

    def tell_probed(self, token: int, hows: list[str | None]) -> None:
        """Answer the leader's probe ``token`` (its ``on_probed(rank, token, hows)`` runs)."""
        self._send_to(0, {"probed": [token, hows[:32]]})

    def _send_to(self, rank: int, body: dict[str, object]) -> None:
        addr = self._peers.get(rank)
        if addr is not None:
            with contextlib.suppress(OSError):  # lost: the probe is dropped without an outcome
                self._sock.sendto(json.dumps({"r": self.rank, **body}).encode(), addr)

    def transfers(self) -> dict[int, dict[str, Any] | None]:
        """Each follower's latest relayed transfer (by local rank), of those heard within
        :data:`STALE_BEATS` beat intervals; the others are absent."""
        horizon = time.monotonic() - STALE_BEATS * self.interval
        return {r: info for r, (t, info) in list(self._relayed.items()) if t >= horizon}

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

    def _beat(self) -> None:
        if self._status is None:
            self._send({})
            return
        try:
            info = self._status()
        except Exception:  # a beat must go out: liveness does not depend on the status
            if not self._status_failed:  # once: it runs at every beat
                log.exception("island rank %d: its transfer status failed", self.rank)
            self._status_failed = True
            info = None
        if isinstance(info, dict) and isinstance(info.get("silent"), list):
            info = {**info, "silent": _silent_list(_claims(info["silent"]), MAX_RELAYED)}
        # only the leader heartbeats: the other ranks get the plain beat
        relayed = json.dumps({"r": self.rank, "t": info}).encode()
        plain = json.dumps({"r": self.rank}).encode()
        for r, addr in list(self._peers.items()):
            with contextlib.suppress(OSError):  # an unreachable rank is found by silence
                self._sock.sendto(relayed if r == 0 else plain, addr)

    def _run(self) -> None:
        next_beat = 0.0
        self._sock.settimeout(self.interval / 4)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
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
            self._relayed.pop(r, None)
            return
        self._heard[r] = time.monotonic()
        if "t" in msg and self.rank == 0:
            t = msg["t"]
            self._relayed[r] = (self._heard[r], t if isinstance(t, dict) else None)
        abort = msg.get("abort")
        if abort and self._on_abort is not None:
            epoch, rnd, reason = abort
            self._on_abort(int(epoch), int(rnd), str(reason))
        try:
            if (ask := msg.get("probe")) and self._on_probe is not None and r == 0:
                self._on_probe(int(ask[0]), [str(a) for a in ask[1]])
            if (got := msg.get("probed")) and self._on_probed is not None and self.rank == 0:
                hows = [None if h is None else str(h) for h in got[1]]
                self._on_probed(r, int(got[0]), hows)
        except (ValueError, TypeError, IndexError):
            return  # malformed: that probe gets no outcome
