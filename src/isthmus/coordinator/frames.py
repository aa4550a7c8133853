"""Begin and commit as frames on the heartbeat websocket: the frames, and their one codec.

A coordinator that lists :data:`WS_ROUNDS` in :attr:`~.protocol.Registered.features` takes a
peer's :class:`~.protocol.Begin` and :class:`~.protocol.Commit` as frames on the websocket the
peer already keeps for its heartbeats, instead of as HTTP requests: a :class:`BeginFrame` or
:class:`CommitFrame` carries the message and an ``id`` the peer chose, and the coordinator
answers each with one :class:`RoundReply` naming the same ``id``: the
:class:`~.protocol.Decision` it would have answered over HTTP (held the same way, up to its
``poll_s``), or a ``status`` and ``error`` where HTTP would have answered 400, 403 or 429. The
frames from a peer form the union :class:`Uplink` (a :class:`~.protocol.Heartbeat` is one of
them), the frames to it the union :class:`Downlink` (every :class:`~.protocol.Push`, and the
replies).

:func:`read_uplink` decodes a frame's text (with orjson where it reads the text exactly as the
standard ``json`` module does, else with ``json``) and says, for a malformed one, what is wrong
and which ``id`` it named (if any); :func:`reply_text` writes a reply, with a decision's JSON
already encoded (the coordinator encodes a round's ``go`` once for all its members).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from isthmus.coordinator.protocol import (
    MAX_DIGEST,
    Begin,
    Commit,
    Decision,
    Heartbeat,
    Push,
    Vote,
)
from isthmus.coordinator.wire import WireError, decode, encode

__all__ = [
    "MAX_FRAME_BYTES",
    "WS_ROUNDS",
    "BadFrame",
    "BeginFrame",
    "CommitFrame",
    "Downlink",
    "RoundReply",
    "Uplink",
    "read_uplink",
    "reply_frame",
    "reply_text",
]

try:
    from orjson import loads as _fast
except ImportError:  # an environment installed before the dependency: the standard parser
    _fast = None

_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
"""A byte table that keeps ASCII digits as ``0`` and makes every other byte a space."""

_LONG_RUN = b"0" * 19
"""Nineteen digits in a row (in a text passed through :data:`_DIGITS`): maybe an integer past
64 bits, which the fast parser would read as a float (the standard one as an integer)."""


def _long_number(text: str) -> bool:
    """Whether ``text`` has nineteen ASCII digits in a row (or cannot be encoded as UTF-8: a
    lone surrogate, which the fast parser refuses anyway). A byte table and one substring
    search, rather than a regular expression, which steps through every digit of the text."""
    try:
        data = text.encode()
    except UnicodeEncodeError:
        return True
    return _LONG_RUN in data.translate(_DIGITS)


def _loads(text: str) -> Any:
    """``json.loads(text)``, by the fast parser where it gives the same: a text it refuses (NaN,
    a number out of a double's range, a lone surrogate, malformed JSON) or one with a long run
    of digits is read by the standard parser, whose error says what is wrong."""
    if _fast is not None and not _long_number(text):
        try:
            return _fast(text)
        except ValueError:
            pass
    return json.loads(text)


WS_ROUNDS = "ws-rounds"
"""The feature of a coordinator that takes begin and commit as websocket frames."""

MAX_FRAME_BYTES = 64 * 1024
"""The largest begin or commit a peer sends as a frame; a larger one (the schema of a model
with thousands of tensors) goes as an HTTP request. A coordinator lists :data:`WS_ROUNDS` only
when its websocket message bound is at least this."""


@dataclass(frozen=True)
class Uplink:
    """A frame from a peer: decoding an Uplink gives the class its ``type`` names
    (``"hb"``: :class:`~.protocol.Heartbeat`, ``"begin"``, ``"commit"``)."""

    __wire_tag__: ClassVar[str] = "type"
    __wire_tags__: ClassVar[dict[str, type]] = {}


@dataclass(frozen=True)
class BeginFrame(Uplink):
    """``begin`` on the websocket, answered by the :class:`RoundReply` with the same ``id``."""

    id: int
    begin: Begin
    __wire_tag_value__: ClassVar[str] = "begin"


@dataclass(frozen=True)
class CommitFrame(Uplink):
    """``commit`` on the websocket, answered by the :class:`RoundReply` with the same ``id``."""

    id: int
    commit: Commit
    __wire_tag_value__: ClassVar[str] = "commit"


Uplink.__wire_tags__.update({"hb": Heartbeat, "begin": BeginFrame, "commit": CommitFrame})


@dataclass(frozen=True)
class RoundReply:
    """The coordinator's answer to the frame ``id``: ``decision`` (``status`` 200), or
    ``status`` 400 (malformed: ``error`` names the field), 403 (the frame names another peer
    than the socket's) or 429 (over the peer's request rate: ask again later, as after an HTTP
    429). ``id`` is -1 for a frame whose id could not be read."""

    id: int
    status: int = 200
    decision: Decision | None = None
    error: str = ""
    __wire_tag_value__: ClassVar[str] = "reply"
    __wire_tag__: ClassVar[str] = "type"
    __wire_tags__: ClassVar[dict[str, type]] = {}


@dataclass(frozen=True)
class Downlink:
    """A frame from the coordinator: a :class:`~.protocol.Push` (by its ``type``) or a
    :class:`RoundReply` (``"reply"``)."""

    __wire_tag__: ClassVar[str] = "type"
    __wire_tags__: ClassVar[dict[str, type]] = {}


RoundReply.__wire_tags__["reply"] = RoundReply
Downlink.__wire_tags__.update({**Push.__wire_tags__, "reply": RoundReply})


class BadFrame(ValueError):
    """A frame that is not a well-formed :class:`Uplink`; :attr:`id` is the id it named, or
    -1."""

    def __init__(self, message: str, id: int = -1, type: object = None) -> None:
        super().__init__(message)
        self.id = id
        self.type = type
        """The frame's ``type`` field, as sent (None when it had none)."""


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _made(cls: type, **given: Any) -> Any:
    """The frozen dataclass ``cls`` with the fields ``given`` (each already checked as its
    constructor and ``__post_init__`` would) and every other field at its default: the fields
    go into the new object's ``__dict__`` at once, where the constructor would set them one
    frozen ``object.__setattr__`` at a time (a few of these per member and round)."""
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        fs = fields(cls)
        if hasattr(cls, "__slots__") or any(f.default_factory is not MISSING for f in fs):
            return cls(**given)  # no plain __dict__ to fill, or defaults made per object
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in fs if f.default is not MISSING}
    obj = object.__new__(cls)
    obj.__dict__.update(defaults)
    obj.__dict__.update(given)
    return obj


def read_uplink(text: str) -> Heartbeat | BeginFrame | CommitFrame:
    """The frame ``text`` as its message. Raises :class:`BadFrame` saying what is wrong (not
    JSON, an unknown ``type``, a field missing or mistyped, named by its path) with the ``id``
    the frame named where it named an integer one."""
    try:
        raw: Any = _loads(text)
    except ValueError as e:
        raise BadFrame(f"frame is not JSON: {e}") from None
    frame = _read_common(raw)
    if frame is not None:
        return frame
    try:
        return decode(Uplink, raw)  # type: ignore[return-value]
    except WireError as e:
        fid, kind = (raw.get("id"), raw.get("type")) if isinstance(raw, dict) else (None, None)
        ok = isinstance(fid, int) and not isinstance(fid, bool)
        raise BadFrame(f"bad frame: {e}", fid if ok else -1, kind) from None


def _read_common(raw: Any) -> Heartbeat | BeginFrame | CommitFrame | None:
    """The frame ``raw`` (parsed JSON) in the shapes peers send every round, read without the
    codec's general walk, or None for any other shape (then :func:`.wire.decode` reads it, and
    names what is wrong). Takes exactly what the codec takes, and gives the same message: a
    field of another type, a schema, a failure's ``unreached`` all go the general way."""
    if type(raw) is not dict:
        return None
    kind = raw.get("type")
    if kind == "hb":
        info = raw.get("info", {})
        return Heartbeat(dict(info)) if type(info) is dict else None
    fid = raw.get("id")
    if type(fid) is not int:
        return None
    if kind == "begin":
        b = raw.get("begin")
        if type(b) is not dict:
            return None
        peer, nonce, revision = b.get("peer"), b.get("nonce"), b.get("revision")
        run, hashes, prev = b.get("run"), b.get("hashes"), b.get("prev")
        info, digest = b.get("info"), b.get("digest")
        if (
            type(peer) is not int
            or type(nonce) is not str
            or type(revision) is not int
            or (run is not None and type(run) is not str)
            or (info is not None and type(info) is not dict)
            or (
                digest is not None
                and (type(digest) is not str or not 0 < len(digest) <= MAX_DIGEST)
            )
            or b.get("schema") is not None
        ):
            return None
        if hashes is not None:
            if type(hashes) is not dict or not all(type(h) is str for h in hashes.values()):
                return None
            hashes = dict(hashes)
        vote = None
        if prev is not None:
            if type(prev) is not dict:
                return None
            epoch, rnd = prev.get("epoch"), prev.get("round")
            if type(epoch) is not int or type(rnd) is not int:
                return None
            vote = _made(Vote, epoch=epoch, round=rnd)
        return _made(
            BeginFrame,
            id=fid,
            begin=_made(
                Begin,
                peer=peer,
                nonce=nonce,
                revision=revision,
                run=run,
                hashes=hashes,
                prev=vote,
                info=None if info is None else dict(info),
                digest=digest,
            ),
        )
    if kind == "commit":
        c = raw.get("commit")
        if type(c) is not dict:
            return None
        peer, epoch, rnd, ok = c.get("peer"), c.get("epoch"), c.get("round"), c.get("ok")
        run, error = c.get("run"), c.get("error", "")
        if (
            type(peer) is not int
            or type(epoch) is not int
            or type(rnd) is not int
            or type(ok) is not bool
            or (run is not None and type(run) is not str)
            or type(error) is not str
            or c.get("unreached", ()) not in ((), [])
        ):
            return None
        commit = _made(Commit, peer=peer, epoch=epoch, round=rnd, ok=ok, run=run, error=error)
        return _made(CommitFrame, id=fid, commit=commit)
    return None


def reply_text(
    id: int,
    decision: Decision | None = None,
    *,
    status: int = 200,
    error: str = "",
    decision_json: str | None = None,
) -> str:
    """The text of a :class:`RoundReply`; ``decision_json``: the decision already encoded (it
    is spliced in as it is, so a round's plan is encoded once for every member)."""
    if decision_json is None and decision is not None:
        decision_json = json.dumps(encode(decision))
    if decision_json is not None:
        head = f'{{"type":"reply","id":{int(id)},"status":{int(status)},"decision":'
        return head + decision_json + "}"
    return json.dumps({"type": "reply", "id": int(id), "status": int(status), "error": error})


def reply_frame(id: int, decision_json: bytes) -> bytes:
    """:func:`reply_text` of a decision already encoded, as UTF-8: the frame's bytes, built
    from the decision's bytes (made once for a round's ``go``) with no text to encode for each
    member."""
    return b'{"type":"reply","id":%d,"status":200,"decision":%b}' % (int(id), decision_json)
