"""Peers measure the links between them: round trip and rate, both ways, of every pair, over the
epoch's own connections, when membership changes (not every round).

Why: the coordinator orders an epoch's members around the ring by the bandwidth between them
(:mod:`isthmus.coordinator.ring`), and it needs every pair's rate. Outside the lab nobody hands
those in, so the peers measure them. :func:`probe_links` runs the schedule of
:mod:`isthmus.comm.probe_math` on a :class:`~isthmus.comm.group.Group`: the pairs of a
:func:`~isthmus.comm.probe_math.tournament` round at once, each pair a few one-byte ping-pongs
(the round trip) and then each way a :class:`~isthmus.comm.probe_math.Ladder` of transfers that
the receiving member asks for and times. The results go to the coordinator with the heartbeats,
as ``info["probed"]`` (``{"<peer id>": {"mbit", "rtt_ms"}}``: the rate at which this peer
receives from that one, and their round trip).

When: :class:`LinkProber` is the session's side. Every member states in the epoch's handshake
(:func:`isthmus.comm.stripes.connect_stripes`, which Gloo epochs run anyway) whether it wants a
probe (probing is on, the epoch has at least :data:`~isthmus.coordinator.ring.ORDERED_FROM`
members, and it has not probed this very member set yet) and whether its probing is off. The
epoch's first round probes when one member wants it and none has it off, so every member
decides alike (the run's first round, when its group connects behind it, leaves that to the next
round of the epoch, the first to take the group: :mod:`isthmus.comm.ahead`). A member set is probed once: a later epoch of the same members (after an aborted
round, or the coordinator reordering the ring by the new rates) does not probe again.

What happens on failure: every wait is bounded by the group's timeout, and a peer that dies or
is cut off fails the probe as it fails any collective (:class:`~isthmus.comm.group.
CollectiveError`, the group aborted): the round's set-up fails and the survivors retry in a new
epoch, which probes again when a member died (its member set is new). A probe that fails never
changes the links reported before it, and the same member set is not probed twice, so a probe
that cannot finish (a link too slow for ``collective_timeout``, a reset, an injected fault)
costs one retried round and never fails the run; but the ring of that member set then keeps the
order it had (the rates reported before, or name order) until the membership changes.
No probe runs on NCCL groups or on epochs of fewer members than the ring needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from isthmus.comm.group import CollectiveError, Group
from isthmus.comm.probe_math import Ladder, Link, LinkTable, tournament
from isthmus.coordinator.protocol import RoundPlan
from isthmus.coordinator.ring import ORDERED_FROM

__all__ = ["MAX_PROBE_BYTES", "PINGS", "PROBE_TAG", "LinkProber", "probe_links"]

log = logging.getLogger("isthmus.probe")

PINGS = 4
"""Timed ping-pongs per pair (after one untimed, which waits for the partner to arrive)."""
MAX_PROBE_BYTES = 64 * 1024 * 1024
"""The largest transfer a probe sends or accepts (``SessionConfig.probe_bytes`` is at most this)."""
PROBE_TAG = 1 << 28
"""Tags of the probe's messages: ``PROBE_TAG + 0..3`` (ping, pong, size, data), clear of the
resync transfers' and the exchange's."""
_PING, _PONG, _SIZE, _DATA = range(PROBE_TAG, PROBE_TAG + 4)


def probe_links(
    group: Group,
    members: Sequence[int],
    *,
    cap: int,
    pings: int = PINGS,
    between: Callable[[int], None] | None = None,
) -> dict[int, Link]:
    """Measure the links between this member of ``group`` and every other: ``{peer id: Link}``,
    the rate at which that peer sends to this one (``members[rank]`` is the peer id of a rank).
    Every member must call it at the same point. Transfers are at most ``cap`` bytes; the bytes
    count as ``probe`` in the group's stats.
    ``between(i)`` runs after this member's ``i``-th pair (fault injection: the ``probe``
    point). Raises :class:`~isthmus.comm.group.CollectiveError` when a partner dies, is cut off
    or is silent past the group's timeout (the group is then aborted)."""
    if len(members) != group.world:
        raise ValueError(f"{len(members)} member ids for a group of {group.world}")
    me = group.rank
    buf = torch.zeros(max(cap, 1), dtype=torch.uint8)
    out: dict[int, Link] = {}
    for pairs in tournament(group.world):
        for a, b in pairs:
            if me not in (a, b):
                continue
            other, first = (b, True) if me == a else (a, False)
            rtt_s = _ping(group, other, first, pings)
            if first:
                mbit = _measure(group, other, buf, cap, rtt_s)
                _serve(group, other, buf)
            else:
                _serve(group, other, buf)
                mbit = _measure(group, other, buf, cap, rtt_s)
            out[members[other]] = Link(mbit=mbit, rtt_ms=rtt_s * 1e3)
            if between is not None:
                between(len(out) - 1)
    return out


def _ping(group: Group, other: int, first: bool, pings: int) -> float:
    """The pair's round trip, seconds: the fastest of ``pings`` timed ping-pongs. The first
    member times ping to pong; the second, pong to the next ping."""
    ball = torch.zeros(1, dtype=torch.uint8)
    times = []
    last = 0.0
    for i in range(pings + 1):
        if first:
            t0 = time.monotonic()
            group.send(ball, other, _PING, label="probe")
            group.recv(ball, other, _PONG)
            if i:  # the first waited for the partner to arrive
                times.append(time.monotonic() - t0)
        else:
            group.recv(ball, other, _PING)
            if i:
                times.append(time.monotonic() - last)
            group.send(ball, other, _PONG, label="probe")
            last = time.monotonic()
    return min(times) if times else 0.0


def _measure(group: Group, other: int, buf: torch.Tensor, cap: int, rtt_s: float) -> float:
    """Measure the rate at which ``other`` sends to this member, Mbit/s: a ladder of transfers,
    each asked for by its size (0 ends the ladder). The receiver times them because Gloo's
    sender waits for the receiver's notice that the receive is posted: timed from posting the
    receive, a transfer takes one round trip plus its bytes at the link's rate, what
    :func:`~isthmus.comm.probe_math.rate_mbit` expects (timed at the sender it took two)."""
    ladder = Ladder(cap=cap, rtt_s=rtt_s)
    while True:
        size = ladder.next()
        t0 = time.monotonic()
        got = group.recv(buf[:size], other, _DATA, async_op=True) if size else None
        group.send(torch.tensor([size], dtype=torch.int64), other, _SIZE, label="probe")
        if got is None:
            return ladder.rate()
        got.wait()
        ladder.record(size, time.monotonic() - t0)


def _serve(group: Group, other: int, buf: torch.Tensor) -> None:
    """The other side of :func:`_measure`: send each transfer asked for. One larger than
    ``buf`` (the members were given different ``probe_bytes``) is sent from a buffer of its
    own, up to :data:`MAX_PROBE_BYTES`; a larger one aborts the group (CollectiveError)."""
    size = torch.zeros(1, dtype=torch.int64)
    while True:
        group.recv(size, other, _SIZE)
        n = int(size[0])
        if n == 0:
            return
        if not 0 < n <= MAX_PROBE_BYTES:
            group.abort(f"probe: a partner asked for a transfer of {n} bytes")
            raise CollectiveError(f"probe: rank {other} asked for a transfer of {n} bytes")
        data = buf[:n] if n <= buf.numel() else torch.zeros(n, dtype=torch.uint8)
        group.send(data, other, _DATA, label="probe")


class LinkProber:
    """A session's probing: what it wishes at an epoch's handshake, whether the epoch probes,
    running the probe, and the links measured so far (:attr:`table`)."""

    def __init__(self, *, enabled: bool, cap: int, owner: str = "") -> None:
        self.enabled = enabled
        self.cap = cap
        self.owner = owner
        self.table = LinkTable()
        self._probed: frozenset[int] | None = None  # the member set last probed (or tried)
        self._due: int | None = None  # the epoch whose first round (that has the group) probes
        self._warned = False
        self.failures = 0
        self.seconds = 0.0
        """Time spent probing, in all."""

    def wishes(self, plan: RoundPlan) -> list[int]:
        """This member's part of the epoch's handshake: [wants a probe, has probing off]."""
        want = (
            self.enabled
            and len(plan.members) >= ORDERED_FROM
            and frozenset(plan.members) != self._probed
        )
        return [int(want), int(not self.enabled)]

    def agree(self, plan: RoundPlan, agreed: Sequence[int]) -> None:
        """The handshake's outcome (every member's largest wishes): the epoch probes when one
        member wants it and no member has probing off."""
        wanted, off = (agreed[0], agreed[1]) if len(agreed) >= 2 else (0, 1)
        if wanted and off and self.enabled and not self._warned:
            self._warned = True
            log.warning(
                "%s: some peers have probe_links off, so no peer probes (the ring keeps the "
                "rates reported before, or name order)",
                self.owner,
            )
        if wanted and not off:
            self._due = plan.epoch
            self._probed = frozenset(plan.members)  # tried once, whatever comes of it

    def due(self, plan: RoundPlan) -> bool:
        """Whether this round (the first of its epoch) probes."""
        return self._due == plan.epoch

    def run(
        self, group: Group, plan: RoundPlan, between: Callable[[int], None] | None = None
    ) -> dict[str, dict[str, float]] | None:
        """Probe if this round is due to; returns the links to report (None: no probe ran).
        Raises :class:`~isthmus.comm.group.CollectiveError` as :func:`probe_links` does, also
        for any other error inside the probe (the group is aborted): the round fails and is
        retried, never the run. The table is then unchanged."""
        if not self.due(plan):
            return None
        self._due = None
        t0 = time.monotonic()
        sent0 = group.stats.by_op.get("probe", 0)
        try:
            measured = probe_links(group, plan.members, cap=self.cap, between=between)
        except CollectiveError as e:
            self.failures += 1
            # cut this member's connections too (an injected fault, or a timeout on one pair):
            # partners blocked on it then fail at once, not when the coordinator's abort arrives
            group.abort(f"probe failed: {e}")
            raise
        except Exception as e:  # not the network's doing: still the round's, never the run's
            self.failures += 1
            group.abort(f"probe failed: {e}")  # partners waiting on this member fail at once
            raise CollectiveError(f"probe failed: {type(e).__name__}: {e}") from e
        finally:
            self.seconds += time.monotonic() - t0
        self.table.update(measured)
        log.info(
            "%s probed %d links of epoch %d in %.2fs (%d bytes sent): %s",
            self.owner,
            len(measured),
            plan.epoch,
            time.monotonic() - t0,
            group.stats.by_op.get("probe", 0) - sent0,
            ", ".join(
                f"{pid}: {x.mbit:.0f} Mbit/s {x.rtt_ms:.1f} ms" for pid, x in measured.items()
            ),
        )
        return self.table.report()
