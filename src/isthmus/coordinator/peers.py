"""The rules of a run (:class:`MembershipConfig`) and what the coordinator knows of each peer
(:class:`Peer`, :class:`PeerState`, and the :class:`Roster` of them all); the state machine that
uses them is :mod:`.membership`. Pure: times are passed in."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from isthmus.coordinator.partition import PartitionConfig

__all__ = ["MembershipConfig", "Peer", "PeerState", "Roster"]


@dataclass(kw_only=True)
class MembershipConfig:
    """Rules of one run. All times are seconds."""

    min_peers: int = 1
    """A round forms only with at least this many ready peers; fewer means rounds wait."""
    start_peers: int | None = None
    """The very first round waits for this many peers (default: ``min_peers``) or ``start_timeout``."""
    start_timeout: float = 30.0
    """How long the first round waits for ``start_peers`` before starting with whoever is there."""
    restart_timeout: float = 10.0
    """How long a restart from a checkpoint waits for ``start_peers`` (counted from the first
    restored peer ready; never longer than ``start_timeout``) before forming with ``min_peers``:
    peers killed together come back together and form the restart as one, while a run that lost
    its peers one by one does not wait long for joiners still starting."""
    heartbeat_timeout: float = 5.0
    """A peer silent for this long is evicted (a stopped or partitioned process)."""
    transfer_heartbeat_timeout: float = 10.0
    """The same bound for a member of the running round (also after it reported: its kernel
    may still be sending what it wrote), unless another member's heartbeat since the round
    formed says nothing moves on its connections:
    its heartbeats share the link with the round's data and may queue behind it on a thin link
    (none may arrive until long after the transfer began), while a stopped member's partners
    soon see nothing move. Never shorter than ``heartbeat_timeout``."""
    quiet_after: float | None = None
    """A member of the last epoch that has not begun the next round and has been silent (no
    heartbeat, no request) this long is not waited for: the round forms without it. It is not
    evicted (that takes ``heartbeat_timeout``); if it speaks again it joins a later round, resynced
    if it missed a commit. Without this, a second member that went silent shortly after the first
    would hold the retry until its own eviction. Default: a third of ``heartbeat_timeout``."""
    begin_timeout: float = 600.0
    """A live member of the last epoch that has not called begin this long after another member
    did is evicted (joiners waiting do not start this clock).
    Generous on purpose: peers compute at different speeds between rounds."""
    commit_timeout: float = 600.0
    """A member that has not reported commit this long after the round formed is evicted."""
    parity_every: int = 1
    """Compare state hashes every this many rounds (joiners and stale peers are always checked)."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """When members that cannot reach each other sit out, and when they are probed and tried
    again (:mod:`.partition`)."""
    abort_limit: int = 5
    """A round that aborts this many times in a row for the same cause stops: every begin is
    answered ``stopped`` with the cause (:mod:`.abort_streak`)."""

    def __post_init__(self) -> None:
        if self.min_peers < 1:
            raise ValueError(f"min_peers must be >= 1, got {self.min_peers}")
        if self.start_peers is not None and self.start_peers < self.min_peers:
            raise ValueError(
                f"start_peers ({self.start_peers}) must be >= min_peers ({self.min_peers})"
            )
        for name in (
            "start_timeout",
            "restart_timeout",
            "heartbeat_timeout",
            "transfer_heartbeat_timeout",
            "begin_timeout",
            "commit_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.quiet_after is not None and self.quiet_after <= 0:
            raise ValueError(f"quiet_after must be positive, got {self.quiet_after}")
        if self.parity_every < 1:
            raise ValueError(f"parity_every must be >= 1, got {self.parity_every}")
        if not isinstance(self.abort_limit, int) or self.abort_limit < 2:
            raise ValueError(f"abort_limit must be an integer >= 2, got {self.abort_limit!r}")

    def silence_bound(self, moving: bool) -> float:
        """How long a peer may go without a heartbeat: ``heartbeat_timeout``, or while its
        transfer moves (``moving``) the longer ``transfer_heartbeat_timeout``."""
        if moving:
            return max(self.heartbeat_timeout, self.transfer_heartbeat_timeout)
        return self.heartbeat_timeout

    @property
    def quiet_after_s(self) -> float:
        """``quiet_after``, or its default."""
        return self.quiet_after if self.quiet_after is not None else self.heartbeat_timeout / 3


class PeerState(str, enum.Enum):
    ACTIVE = "active"  # registered and alive (waiting or member)
    LEFT = "left"
    DEAD = "dead"
    REFUSED = "refused"


@dataclass
class Peer:
    id: int
    name: str
    registered_at: float
    last_seen: float
    state: PeerState = PeerState.ACTIVE
    reason: str = ""
    revision: int | None = None
    hashes: dict[str, str] | None = None
    # the state digest its begin carried instead of hashes (or that of its hashes, once known)
    digest: str | None = None
    ready_nonce: str | None = None  # the begin attempt this peer is waiting with
    ready_since: float | None = None  # when that attempt began
    in_sync: bool = False  # holds the canonical state of the run's current revision
    schema_ok: bool = False  # its shared-state schema was checked against the run's
    # its local work must not count until a round it is in commits: registered after the run
    # started, or repaired in an attempt that aborted
    uncounted: bool = False
    told_restore: int | None = None  # the checkpoint revision it was last told to load
    info: dict[str, Any] = field(default_factory=dict)
    # why it sits out (it cannot reach a member, or one cannot reach it); None: it does not
    isolated: str | None = None
    # its last heartbeat said it was in a round with its transfer moving (or about to start)
    moving: bool = False
    # the (epoch, round) its last heartbeat's ``moving`` was about; None: it was in no round
    transfer_round: tuple[Any, Any] | None = None
    # when a heartbeat last said so: the commit bound counts from there
    progress_at: float | None = None
    # its last heartbeat's ``transfer.silent``: (epoch, rank, seconds) of each member its data
    # in flight does not reach (unacknowledged past the stall rule)
    silent: tuple[tuple[int, int, float], ...] = ()
    # heartbeat infos recorded so far (a repeated heartbeat is new only if another came between)
    beats: int = 0

    @property
    def probe_address(self) -> str | None:
        """Its probe listener's ``host:port`` (sent at registration), or None."""
        a = self.info.get("probe")
        return a if isinstance(a, str) else None

    @property
    def kind(self) -> str:
        """What it is, from its registration: "an island of N ranks" (``info.island``) or "a
        single-process peer"; the two hash their state differently (over the island-independent
        layout, or whole tensors) and connect different groups."""
        island = self.info.get("island")
        if isinstance(island, dict):
            return f"an island of {island.get('size', '?')} rank(s)"
        return "a single-process peer"

    def describe(self, now: float, *, member: bool) -> dict[str, Any]:
        """This peer as ``/v1/status`` lists it (``member``: of the current or last epoch)."""
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "member": member and self.state is PeerState.ACTIVE,
            "revision": self.revision,
            "in_sync": self.in_sync,
            "last_heartbeat_s": round(now - self.last_seen, 3),
            "isolated": self.isolated if self.state is PeerState.ACTIVE else None,
            "info": self.info,
        }


class Roster:
    """Every peer registered with one coordinator, by id (ids count up from 0 and are never
    reused), and the questions the membership asks about them. Peers stay listed after they
    leave or die (their state says so)."""

    def __init__(self) -> None:
        self.peers: dict[int, Peer] = {}
        self.live: set[int] = set()
        """The ids of the active peers (kept by :meth:`add` and :meth:`retire`)."""
        self._next_id = 0

    def add(self, name: str, now: float, info: dict[str, Any], *, uncounted: bool) -> int:
        """Register a new active peer; returns its id."""
        pid = self._next_id
        self._next_id += 1
        self.peers[pid] = Peer(pid, name, now, now, info=dict(info), uncounted=uncounted)
        self.live.add(pid)
        return pid

    def retire(self, p: Peer, state: PeerState) -> None:
        """Peer ``p`` is no longer active: it died, left or was refused (``state``)."""
        p.state = state
        self.live.discard(p.id)

    def active(self, pid: int) -> Peer | None:
        """Peer ``pid`` if it is registered and active, else None."""
        p = self.peers.get(pid)
        return p if p is not None and p.state is PeerState.ACTIVE else None

    def is_active(self, pid: int) -> bool:
        return self.active(pid) is not None

    def alive(self, pids: Iterable[int]) -> list[int]:
        """Those of ``pids`` that are active, in the order given."""
        return [pid for pid in pids if self.is_active(pid)]

    def kind_conflict(self, pid: int) -> str | None:
        """Why peer ``pid`` cannot join the run's checked peers, or None: one is an island and
        the other a single-process peer (see :attr:`Peer.kind`), which cannot compare their
        hashes nor meet in one group."""
        me = self.peers[pid]
        mine = "island" in me.info
        others = [q for q in self.peers.values() if q.schema_ok and q.state is PeerState.ACTIVE]
        for q in others:
            if q.id != pid and ("island" in q.info) != mine:
                return (
                    f"this peer ({me.name!r}) is {me.kind}, but {q.name!r} (peer {q.id}) in the "
                    f"run is {q.kind}: islands hash their state over the island-independent "
                    "layout and single-process peers over whole tensors, so they cannot train "
                    "in one run; start every peer as an island (an island may have one rank: "
                    "isthmus run --nproc-per-peer 2,1) or none"
                )
        return None

    def ready(self) -> list[int]:
        """Active peers waiting in a begin, by id."""
        return sorted(
            pid for pid, p in self.peers.items() if p.state is PeerState.ACTIVE and p.ready_nonce
        )

    def describe(self, now: float, members: Iterable[int]) -> list[dict[str, Any]]:
        """The peers ``/v1/status`` lists: the active ones and those seen in the last 10
        minutes (``members``: of the current or last epoch)."""
        of_epoch = set(members)
        return [
            p.describe(now, member=p.id in of_epoch)
            for p in self.peers.values()
            if p.state is PeerState.ACTIVE or now - p.last_seen <= 600
        ]
