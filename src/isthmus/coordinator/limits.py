"""Bounds on what one client can make the coordinator do, so that a flood costs the flooder.

* request bodies: ``max_body_bytes`` (aiohttp answers 413 beyond it, before reading the rest);
  websocket messages: ``max_ws_message_bytes`` (the socket is closed);
* requests: a token bucket per identity (a join token's name, or ``admin``), so one peer's
  flood is answered 429 while the others go on; failed logins: a bucket per remote address, so
  guessing tokens is slow and costs only the guesser's address;
* registrations: a bucket per identity, and at most ``max_peers_per_identity`` live peers for a
  join token (the admin token, used by every peer of a single-token run, is bounded only by
  ``max_peers``);
* heartbeats: a websocket sending faster than ``ws_messages_per_s`` (with a burst) is closed.

A slow client cannot hold the event loop: every handler awaits the network (aiohttp reads
bodies and frames without blocking the loop), and long-polls are bounded by ``poll_s``.

Everything here is pure apart from the clock passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Buckets", "Limits", "TokenBucket"]


@dataclass(kw_only=True)
class Limits:
    """The coordinator's bounds (defaults are far above what a healthy run of hundreds of peers
    needs)."""

    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body (a begin carries one hash per tensor: ~100 bytes each)."""
    max_ws_message_bytes: int = 1024 * 1024
    """Largest websocket message (a heartbeat is a few hundred bytes)."""
    requests_per_s: float = 500.0
    """Sustained requests per second per identity (a single-token run's peers share one)."""
    request_burst: float = 2000.0
    auth_failures_per_s: float = 5.0
    """Sustained refused-token requests per second per remote address, after the burst."""
    auth_failure_burst: float = 50.0
    registrations_per_s: float = 5.0
    """Sustained registrations per second per identity, after the burst."""
    registration_burst: float = 50.0
    max_peers_per_identity: int = 16
    """Live peers one join token may hold at once."""
    max_peers: int = 10_000
    """Live peers in the run, all identities together."""
    ws_messages_per_s: float = 50.0
    """Sustained websocket messages per second per peer (heartbeats come every second or so)."""
    ws_burst: float = 200.0
    max_store_keys: int = 100_000
    """Keys the rendezvous store holds; the oldest go first beyond it (old epochs' keys)."""
    max_store_value_bytes: int = 64 * 1024
    """Largest value in the rendezvous store (Gloo's addresses are tens of bytes)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"limits.{name} must be positive, got {value}")


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`take` spends one if there is one."""

    __slots__ = ("burst", "level", "rate", "t")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.level, self.t = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level >= 1.0:
            self.level -= 1.0
            return True
        return False


class Buckets:
    """One :class:`TokenBucket` per key, at most ``max_keys`` of them (the least recently used
    go first: a flood of distinct keys, e.g. spoofed names, cannot grow this without bound)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._b: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        """Spend one token of ``key``'s bucket; False when it is empty."""
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = TokenBucket(self.rate, self.burst, now)
            if len(self._b) > self.max_keys:
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
        return b.take(now)

    def __len__(self) -> int:
        return len(self._b)
