"""Data a member handed to its kernel that never reaches the member it was sent to, and what a
heartbeat says of a peer's round (:func:`transfer_info`, ``info.transfer``).

A collective completes on a member once its last data is in the kernel's send buffer. If the
link to the member that should receive it is cut at that moment, the sender reports success and
goes on, while the receiver waits with nothing in flight: on its side a cut link looks exactly
like a partner that has not sent yet (late, or computing), which it must wait for. Only the
sender's connection shows the cut: data in flight that its remote never acknowledges, which the
kernel keeps retransmitting. :class:`Unacked` keeps looking at a group's connections after its
operations completed, until they hold nothing in flight, and names the members whose
connections are silent by the rule that fails a wait (:mod:`isthmus.comm.progress`:
unacknowledged for ``stall_s``, with ``min_retransmits`` retransmission timeouts in a row). The
coordinator aborts a round whose only unreported members say nothing moves when a member that
reported names one of them so (docs/PROTOCOL.md, "How stuck transfers are detected").
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, Protocol

from isthmus.comm.handle import Watch
from isthmus.comm.wires import Wires

__all__ = ["Groups", "Unacked", "transfer_info"]

_RANKED = re.compile(r"rank (\d+) at \S+")
"""How a group's connection is labelled when the member at its other end is known
(:func:`isthmus.comm.connect.connect_gloo`)."""


class Unacked:
    """The members whose connections from this member (of rank ``rank``) hold data that
    ``watch`` judges silent, by rank, for one group (whose ``wires`` name the connections
    labelled by address only). The group calls :meth:`issued` for every operation it issues."""

    def __init__(self, watch: Watch | None, wires: Wires | None, rank: int) -> None:
        self._watch, self._wires, self._rank = watch, wires, rank
        self._lock = threading.Lock()
        # operations issued, and how many had been when a sample last found the group idle
        # with nothing in flight: members() samples only while they differ
        self._issued = 0
        self._settled = 0
        self._ranks: dict[str, int | None] = {}  # address labels named on a thread

    def issued(self) -> None:
        """An operation was issued on the group: its data may be left in flight."""
        with self._lock:
            self._issued += 1

    def members(
        self, busy: Callable[[], bool], sample: Callable[[], None]
    ) -> list[tuple[int, float]]:
        """``(rank, seconds unacknowledged)`` of every silent connection, longest first, after
        ``sample()`` (the group's rate-limited sample of its connections); ``busy()`` says
        whether an operation still runs. Samples nothing once the connections held nothing in
        flight with no operation running, until the next operation (a heartbeat asks every
        interval: between rounds this costs nothing). A connection labelled by address only
        is named on a thread of its own (naming it may ask the epoch's store, which must not
        hold a heartbeat), and counted from the next call on. Empty where the watch cannot
        say (no watch, or one without ``silent``). Never raises."""
        watch = self._watch
        silent = getattr(watch, "silent", None)
        if watch is None or silent is None:
            return []
        issued = self._issued
        if issued == self._settled:
            return []
        sample()
        if not busy() and not watch.in_flight():
            self._settled = issued
            return []
        out: list[tuple[int, float]] = []
        for remote, for_s in silent():
            rank = self._rank_of(remote)
            if rank is not None and rank != self._rank:
                out.append((rank, for_s))
        return out

    def _rank_of(self, label: str) -> int | None:
        """The rank a connection's ``label`` leads to; None while (or when) it is not known."""
        ranked = _RANKED.fullmatch(label)
        if ranked is not None:
            return int(ranked.group(1))
        wires = self._wires
        if wires is None:
            return None
        with self._lock:
            if label in self._ranks:
                return self._ranks[label]
            self._ranks[label] = None  # asked once; the thread fills it in

        def name() -> None:
            found = _RANKED.fullmatch(wires.name_of(label))  # name_of never raises
            with self._lock:
                self._ranks[label] = None if found is None else int(found.group(1))

        threading.Thread(target=name, daemon=True, name="isthmus-name-conn").start()
        return None


class _Round(Protocol):
    epoch: int
    round: int


class _Group(Protocol):
    epoch: int | None

    def busy(self) -> bool: ...

    def moving(self) -> bool: ...


def transfer_info(plan: _Round | None, group: _Group | None) -> dict[str, Any] | None:
    """What a heartbeat says of this peer's round (``info.transfer``). Inside a round (from its
    go until this peer reports it): the round's ``epoch`` and ``round`` and whether it is
    ``moving``: about to transfer, or transferring with some connection of ``group`` advancing
    (:meth:`~isthmus.comm.group.Group.moving`). The coordinator gives the round's members a
    longer heartbeat bound unless one of them says, for that very round, that nothing moves.

    In a round or not, ``silent`` lists each member whose connection from this peer holds data
    it does not acknowledge (:meth:`~isthmus.comm.group.Group.silent_members`) as ``{"epoch",
    "rank", "for_s"}``; a peer that reported its round says only that (``{"silent": [...]}``),
    and nothing (None) when no connection is silent."""
    found = getattr(group, "silent_members", None)  # a group of another kind says nothing
    silent = [
        {"epoch": getattr(group, "epoch", None), "rank": rank, "for_s": round(for_s, 1)}
        for rank, for_s in (found() if found is not None else ())
    ]
    if plan is None:
        return {"silent": silent} if silent else None
    moving = group is None or not group.busy() or group.moving()
    out: dict[str, Any] = {"epoch": plan.epoch, "round": plan.round, "moving": moving}
    if silent:
        out["silent"] = silent
    return out


class Groups:
    """Several groups of one epoch (the main one first) seen as one by :func:`transfer_info`:
    busy while an operation on any of them runs, moving while any of them moves (one that moves
    nothing is idle, or stuck), and silent toward each member any of them is silent toward (the
    longest silence). A rank of an island beside islands of other sizes holds one cross-island
    group per tuple of owners, and its round may wait on any of them: a transfer stuck on one
    is the rank's."""

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups
        self.epoch = groups[0].epoch

    def busy(self) -> bool:
        return any(x.busy() for x in self.groups)

    def moving(self) -> bool:
        return any(x.moving() for x in self.groups)

    def silent_members(self) -> list[tuple[int, float]]:
        longest: dict[int, float] = {}
        for x in self.groups:
            found = getattr(x, "silent_members", None)  # a group of another kind says nothing
            for rank, for_s in found() if found is not None else ():
                longest[rank] = max(for_s, longest.get(rank, 0.0))
        return sorted(longest.items(), key=lambda kv: (-kv[1], kv[0]))
