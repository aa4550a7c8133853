"""Every message the coordinator and the peers exchange, each one typed message defined here.

The server (:mod:`isthmus.coordinator.server`) decodes each request body into its message with
:func:`~isthmus.coordinator.wire.decode` and answers with :func:`~isthmus.coordinator.wire.encode`
of a response message; the peer's client (:mod:`isthmus.coordinator.client`, used by
:mod:`isthmus.comm.session`) does the reverse with the same types, so a field is declared and
checked in one place. A malformed request is answered 400 naming the field; a malformed answer
raises :class:`~isthmus.coordinator.wire.WireError` on the peer.

Requests: :class:`Register` (``POST /v1/register``), :class:`Begin`, :class:`Commit`,
:class:`Leave`, :class:`CheckpointPart` and :class:`CheckpointManifest` (``POST
/v1/checkpoint``), and :class:`Heartbeat` on the websocket. Answers: :class:`Registered`, a
:class:`Decision` (one subclass per outcome: :class:`Wait`, :class:`Go`, :class:`SendHashes`,
:class:`Refused`, :class:`Evicted`, :class:`Finished`, :class:`Restore`, :class:`Committed`,
:class:`Aborted`, :class:`Stopped`), and pushes on the websocket (:class:`AbortPush`,
:class:`EvictedPush`, :class:`ProbePush`).
docs/PROTOCOL.md describes the exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from isthmus.coordinator.shapes import decode_shape
from isthmus.coordinator.wire import UNVERSIONED, WireError, decode, encode

__all__ = [
    "HASH_DIGEST",
    "INFO_IN_BEGIN",
    "MAX_DIGEST",
    "VOTE_IN_BEGIN",
    "AbortPush",
    "Aborted",
    "Begin",
    "CheckpointManifest",
    "CheckpointPart",
    "Commit",
    "Committed",
    "Decision",
    "Evicted",
    "EvictedPush",
    "Finished",
    "Go",
    "Heartbeat",
    "HeartbeatLost",
    "Leave",
    "ProbeOutcome",
    "ProbePush",
    "Push",
    "Refused",
    "Register",
    "Registered",
    "Restore",
    "RestorePoint",
    "RoundPlan",
    "SendHashes",
    "Stopped",
    "TensorSpec",
    "Transfer",
    "Unreached",
    "Vote",
    "Wait",
    "checkpoint_report",
    "schema_mismatch",
]


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one shared tensor. All peers of a run must agree on the list.
    It travels (and is stored in checkpoints) as the list ``[name, shape, dtype]``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype]

    __wire_encode__ = to_json

    @staticmethod
    def __wire_decode__(x: Any, path: str = "") -> TensorSpec:
        if not (isinstance(x, list | tuple) and len(x) == 3):
            raise WireError(path, f"expected [name, shape, dtype], got {x!r:.80}")
        name, shape, dtype = x
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise WireError(
                path, f"expected [name, shape, dtype] with string name and dtype, got {x!r:.80}"
            )
        return TensorSpec(name, decode_shape(shape, f"{path}[1]"), dtype)

    @staticmethod
    def from_json(x: Any) -> TensorSpec:
        """Inverse of :meth:`to_json`; raises :class:`WireError` (a ValueError) if malformed."""
        return TensorSpec.__wire_decode__(x)


def schema_mismatch(run: list[TensorSpec], peer: list[TensorSpec]) -> str | None:
    """Describe the first difference between the run's shared-state schema and a peer's, or None."""
    run_by_name = {s.name: s for s in run}
    peer_by_name = {s.name: s for s in peer}
    for s in run:
        p = peer_by_name.get(s.name)
        if p is None:
            return f"tensor {s.name!r} (shape {list(s.shape)}, {s.dtype}) is missing on this peer"
        if p.shape != s.shape:
            return (
                f"tensor {s.name!r} has shape {list(p.shape)} on this peer but "
                f"{list(s.shape)} in the run"
            )
        if p.dtype != s.dtype:
            return f"tensor {s.name!r} has dtype {p.dtype} on this peer but {s.dtype} in the run"
    for p in peer:
        if p.name not in run_by_name:
            return f"tensor {p.name!r} exists on this peer but not in the run"
    if [s.name for s in run] != [p.name for p in peer]:
        return "shared tensors are registered in a different order than in the run"
    return None


@dataclass(frozen=True)
class Transfer:
    """``dst`` must receive tensors ``names`` from ``src`` (peer ids) before the round's work."""

    src: int
    dst: int
    names: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return encode(self)  # type: ignore[no-any-return]

    @staticmethod
    def from_json(x: Any) -> Transfer:
        """Inverse of :meth:`to_json`; raises :class:`WireError` naming a malformed field."""
        return decode(Transfer, x)


@dataclass(frozen=True)
class RoundPlan:
    """Everything a member needs to run one round."""

    round: int
    epoch: int
    members: tuple[int, ...]  # peer ids; a member's rank is its index
    transfers: tuple[Transfer, ...]
    expected: dict[str, str]  # canonical hash of every transferred tensor
    new_epoch: bool
    stale: tuple[int, ...] = ()
    """Members whose local work must not count although they need no transfer: a peer repaired
    in an attempt of this round that aborted, or one registered after the run started (a new
    peer id) that has not been in a committed round yet."""
    reach: dict[str, str] | None = None
    """Each member's probe listener (peer id as text -> ``host:port``), for members that sent
    one: a member whose group cannot connect probes the others there to name who it cannot
    reach; an island's follower's under ``<peer id>.<local rank>`` (keys that are not numbers
    are skipped by readers that know only members). None from a coordinator that sends none."""

    def rank_of(self, peer_id: int) -> int:
        return self.members.index(peer_id)

    @property
    def resynced(self) -> frozenset[int]:
        """Peers whose local contribution is stale and must not count: repaired in this round,
        or :attr:`stale`."""
        return frozenset(t.dst for t in self.transfers) | frozenset(self.stale)

    def to_json(self) -> dict[str, Any]:
        return encode(self)  # type: ignore[no-any-return]

    @staticmethod
    def from_json(x: Any) -> RoundPlan:
        """Inverse of :meth:`to_json` (a ``go`` decision's plan). Raises :class:`WireError`
        naming the first malformed field; the session treats that as a protocol error."""
        return decode(RoundPlan, x)


HOWS = ("refused", "timed out", "reset", "stalled")
"""How a connection to another member failed (:class:`isthmus.coordinator.partition.How`)."""


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 300:
        raise ValueError(f"address: expected host:port, got {address!r:.80}")


@dataclass(frozen=True)
class Unreached:
    """In a failure report: this peer could not reach member ``peer`` at ``address``
    (``host:port``), and ``how``."""

    peer: int
    address: str
    how: Literal["refused", "timed out", "reset", "stalled"]

    def __post_init__(self) -> None:
        _check_address(self.address)


@dataclass(frozen=True)
class ProbeOutcome:
    """On a heartbeat: a probe this peer made to member ``peer`` (asked by a
    :class:`ProbePush`) connected (``ok``), or failed ``how``."""

    peer: int
    ok: bool
    how: Literal["refused", "timed out", "reset", "stalled"] | None = None


@dataclass(frozen=True)
class RestorePoint:
    """The complete checkpoint a run continues from when no live peer holds its state: the
    checkpoint root ``url`` (every peer must be able to read it) and its ``revision``."""

    url: str
    revision: int

    def to_json(self) -> dict[str, Any]:
        return encode(self)  # type: ignore[no-any-return]

    @staticmethod
    def from_json(x: Any) -> RestorePoint:
        """Inverse of :meth:`to_json`; raises :class:`WireError` naming a malformed field."""
        return decode(RestorePoint, x)


# -- the coordinator's answers to begin and commit ----------------------------------------------
Kind = Literal[
    "wait",
    "go",
    "hashes",
    "refused",
    "evicted",
    "finished",
    "restore",
    "committed",
    "aborted",
    "stopped",
]


@dataclass(frozen=True)
class Decision:
    """Answer to begin or commit: one subclass per ``kind``, so a peer matches on the type.

    ``Decision(kind, reason, plan=..., restore=...)`` builds the subclass that ``kind`` names
    (the coordinator's rules build them this way); ``reason`` says why, for logs and errors.
    Raises ValueError for an unknown kind, a go without a plan or a restore without a restore
    point.
    """

    kind: Kind
    reason: str = ""
    plan: RoundPlan | None = None
    restore: RestorePoint | None = None
    prev: str = ""
    """Answering a begin that carried a vote (:attr:`Begin.prev`): ``"committed"`` once the
    round voted on committed (the rest is the begin's answer); empty otherwise, where an
    ``aborted`` or ``evicted`` answer is the vote's outcome."""

    __wire_tag__: ClassVar[str] = "kind"
    __wire_tags__: ClassVar[dict[str, type[Decision]]] = {}

    def __new__(cls, kind: str = "", *args: Any, **kwargs: Any) -> Decision:
        if cls is Decision:
            kind = kwargs.get("kind", kind)
            sub = Decision.__wire_tags__.get(kind)
            if sub is None:
                known = ", ".join(Decision.__wire_tags__)
                raise ValueError(f"unknown decision {kind!r} (one of {known})")
            cls = sub
        return object.__new__(cls)

    def __post_init__(self) -> None:
        want = type(self).__dataclass_fields__["kind"].default
        if self.kind != want:
            raise WireError("kind", f"expected {want!r}, got {self.kind!r}")
        if isinstance(self, Go) and self.plan is None:
            raise WireError("plan", "is missing (a go decision carries the round's plan)")
        if isinstance(self, Restore) and self.restore is None:
            raise WireError("restore", "is missing (a restore decision names the checkpoint)")

    def to_json(self) -> dict[str, Any]:
        return encode(self)  # type: ignore[no-any-return]

    @staticmethod
    def from_json(x: Any) -> Decision:
        """The subclass ``x["kind"]`` names; raises :class:`WireError` naming a bad field."""
        return decode(Decision, x)


@dataclass(frozen=True)
class Wait(Decision):
    """Not yet: ask again (the long poll ended, or the round is still forming)."""

    kind: Kind = "wait"


@dataclass(frozen=True)
class Go(Decision):
    """The round formed with this peer in it: run :attr:`plan`."""

    kind: Kind = "go"


@dataclass(frozen=True)
class SendHashes(Decision):
    """Ask again with the hashes of the shared state, for the parity check."""

    kind: Kind = "hashes"


@dataclass(frozen=True)
class Refused(Decision):
    """This peer's shared-state schema differs from the run's: do not retry."""

    kind: Kind = "refused"


@dataclass(frozen=True)
class Evicted(Decision):
    """This peer id is gone (removed, or from before a coordinator restart): register again."""

    kind: Kind = "evicted"


@dataclass(frozen=True)
class Finished(Decision):
    """Every member left after the last round and no peer holds the state: nothing to join."""

    kind: Kind = "finished"


@dataclass(frozen=True)
class Restore(Decision):
    """No live peer holds the run's state: load the shared state of checkpoint
    :attr:`restore` and ask again."""

    kind: Kind = "restore"


@dataclass(frozen=True)
class Committed(Decision):
    """Every member reported success: apply the round's result."""

    kind: Kind = "committed"


@dataclass(frozen=True)
class Aborted(Decision):
    """The round failed somewhere: discard its result and begin again."""

    kind: Kind = "aborted"


@dataclass(frozen=True)
class Stopped(Decision):
    """The round aborted again and again for the same cause (:attr:`reason` names it): stop
    instead of retrying."""

    kind: Kind = "stopped"


Decision.__wire_tags__.update(
    (c.__dataclass_fields__["kind"].default, c)
    for c in (
        Wait,
        Go,
        SendHashes,
        Refused,
        Evicted,
        Finished,
        Restore,
        Committed,
        Aborted,
        Stopped,
    )
)


# -- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Register:
    """``POST /v1/register``: a peer asks to join. ``protocol`` is the version it speaks (a peer
    that sends none speaks the unversioned protocol and is refused with both versions named)."""

    name: str = "peer"
    info: dict[str, Any] = field(default_factory=dict)
    protocol: int = UNVERSIONED


@dataclass(frozen=True)
class Registered:
    """The answer to :class:`Register`: the peer's id, the run's id and the run's rules. A
    coordinator that sends no ``protocol`` speaks the unversioned protocol."""

    peer_id: int
    run_id: str
    heartbeat_interval: float
    store_port: int = 0
    rendezvous: Literal["coordinator", "tcpstore"] = "tcpstore"
    heartbeat_timeout: float | None = None
    parity_every: int = 1
    min_peers: int | None = None
    restore: RestorePoint | None = None
    protocol: int = UNVERSIONED
    features: tuple[str, ...] = ()
    """Optional requests this coordinator understands (:data:`VOTE_IN_BEGIN`); a peer uses
    one only when it is listed (an older coordinator lists none)."""


VOTE_IN_BEGIN = "vote-in-begin"
"""The feature of a coordinator that records :attr:`Begin.prev` as a ``commit(ok)``."""

INFO_IN_BEGIN = "info-in-begin"
"""The feature of a coordinator that records :attr:`Begin.info` as a heartbeat's info: a peer
that sends it there may leave out the heartbeat it stands for."""

HASH_DIGEST = "hash-digest"
"""The feature of a coordinator that takes :attr:`Begin.digest` for the hashes: a peer sends
one digest of its hashes where it would send them, and the whole list only when the answer to
that begin asks for hashes (the digests disagree)."""

MAX_DIGEST = 128
"""The longest :attr:`Begin.digest` taken (a digest is 32 characters)."""


@dataclass(frozen=True)
class Vote:
    """A member's ``ok`` for round ``round`` of epoch ``epoch``, carried by its next begin."""

    epoch: int
    round: int


@dataclass(frozen=True)
class Begin:
    """``POST /v1/begin``: peer ``peer`` at ``revision`` is ready for the next round. ``nonce``
    names this attempt; ``hashes`` (tensor name -> content hash) and ``schema`` are sent when
    the coordinator needs them (a new peer sends both). ``run`` is the run id from
    :class:`Registered` (a request naming another run is answered :class:`Evicted`)."""

    peer: int
    nonce: str
    revision: int
    run: str | None = None
    hashes: dict[str, str] | None = None
    schema: tuple[TensorSpec, ...] | None = None
    prev: Vote | None = None
    """This peer's ``ok`` for the round it just finished, recorded as a ``commit`` would be
    before the begin is looked at (only to a coordinator listing :data:`VOTE_IN_BEGIN`)."""
    info: dict[str, Any] | None = None
    """What this peer's next :class:`Heartbeat` would carry, recorded as that heartbeat before
    the vote and the begin are looked at (only to a coordinator listing
    :data:`INFO_IN_BEGIN`; the peer then sends its next heartbeat one interval after this)."""
    digest: str | None = None
    """In place of ``hashes`` (only to a coordinator listing :data:`HASH_DIGEST`): the
    :func:`~.parity.state_digest` of the hashes this peer would send; answered ``hashes`` when
    the parity check needs the list itself. At most :data:`MAX_DIGEST` characters."""

    def __post_init__(self) -> None:
        if self.digest is not None and not 0 < len(self.digest) <= MAX_DIGEST:
            raise ValueError(
                f"digest: expected 1 to {MAX_DIGEST} characters, got {len(self.digest)}"
            )


@dataclass(frozen=True)
class Commit:
    """``POST /v1/commit``: this peer's outcome of ``round`` of ``epoch``; with a failure,
    ``unreached`` names the members it could not reach (empty when it cannot tell)."""

    peer: int
    epoch: int
    round: int
    ok: bool
    run: str | None = None
    error: str = ""
    unreached: tuple[Unreached, ...] = ()


@dataclass(frozen=True)
class Leave:
    """``POST /v1/leave``: the peer leaves between rounds, with its state's ``digest`` at
    ``revision`` and its last counters ``info``."""

    peer: int
    run: str | None = None
    digest: str | None = None
    revision: int | None = None
    info: dict[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointPart:
    """``POST /v1/checkpoint``: this peer wrote part ``part`` of ``parts`` of the checkpoint at
    ``revision`` (``ok``), with its tensors' ``hashes``, or failed to (``error``)."""

    revision: int
    part: int
    parts: int
    ok: bool
    peer: int | None = None
    run: str | None = None
    hashes: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    writer: str = ""
    local: str = ""
    error: str = ""


@dataclass(frozen=True)
class CheckpointManifest:
    """``POST /v1/checkpoint``: the manifest of ``revision`` is written at ``manifest``, under
    the checkpoint root ``url`` (the run's new restore point when given)."""

    revision: int
    manifest: str
    peer: int | None = None
    run: str | None = None
    url: str | None = None


def checkpoint_report(body: Any) -> CheckpointPart | CheckpointManifest:
    """A ``/v1/checkpoint`` body as its message: a manifest when it names one, else a part.
    Raises :class:`WireError` naming a malformed field."""
    if isinstance(body, dict) and "manifest" in body:
        return decode(CheckpointManifest, body)
    return decode(CheckpointPart, body)


# -- the websocket -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Heartbeat:
    """Peer -> coordinator on the websocket, every ``heartbeat_interval``: alive, with the
    metrics ``info`` the peer reports (revision, bytes, timing, links ...)."""

    info: dict[str, Any] = field(default_factory=dict)

    __wire_tag_value__: ClassVar[str] = "hb"
    __wire_tag__: ClassVar[str] = "type"
    __wire_tags__: ClassVar[dict[str, type]] = {}


@dataclass(frozen=True)
class Push:
    """Coordinator -> peer on the websocket; decoding a Push gives the subclass its ``type``
    names (:class:`AbortPush`, :class:`EvictedPush`)."""

    reason: str = ""

    __wire_tag_value__: ClassVar[str] = ""
    __wire_tag__: ClassVar[str] = "type"
    __wire_tags__: ClassVar[dict[str, type[Push]]] = {}


@dataclass(frozen=True)
class AbortPush(Push):
    """Round ``round`` of epoch ``epoch`` aborted: cut that epoch's group."""

    epoch: int = -1
    round: int = -1
    __wire_tag_value__: ClassVar[str] = "abort"


@dataclass(frozen=True)
class EvictedPush(Push):
    """The coordinator removed this peer (or refuses its websocket), for ``reason``."""

    __wire_tag_value__: ClassVar[str] = "evicted"


@dataclass(frozen=True)
class ProbePush(Push):
    """Probe member ``peer`` at ``address`` (its probe listener) and report the outcome on the
    next heartbeat (``info["probes"]``, a list of :class:`ProbeOutcome`). ``ranks``: when both
    ends are islands that sent their ranks' listeners, the other island's, by local rank: the
    island probes rank to rank the paths its groups would take, and reports one outcome."""

    peer: int = -1
    address: str = ""
    ranks: tuple[str, ...] | None = None
    __wire_tag_value__: ClassVar[str] = "probe"


@dataclass(frozen=True)
class HeartbeatLost(Push):
    """Not sent by the coordinator: the client's own notice that its websocket closed."""

    __wire_tag_value__: ClassVar[str] = "heartbeat_lost"


Push.__wire_tags__.update(
    (c.__wire_tag_value__, c) for c in (AbortPush, EvictedPush, ProbePush, HeartbeatLost)
)
Heartbeat.__wire_tags__.update({"hb": Heartbeat})
