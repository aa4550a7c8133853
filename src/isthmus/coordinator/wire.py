"""The wire codec: the protocol version, and one decoder and encoder for every message type.

Every message the coordinator and the peers exchange (:mod:`isthmus.coordinator.protocol`) is a
frozen dataclass. :func:`decode` turns parsed JSON into one, checking every field against the
class's type hints, and :func:`encode` turns one back into JSON-ready values; the server and the
client both call them, so a message is checked the same way on both sides. A field that is
missing or of the wrong type raises :class:`WireError` naming the field by its path
(``schema[2]``, ``plan.transfers[0].src``) and what was expected. Fields a message does not
declare are ignored.

Decoding understands ``int`` (not ``bool``), ``float`` (an int is accepted), ``str``, ``bool``,
``Any``, ``Literal[...]``, ``X | None``, ``tuple[X, ...]``, ``list[X]``, ``dict[str, X]`` and
nested message types. A class may take over its own JSON form with ``__wire_decode__(value,
path)`` and ``__wire_encode__()`` (a tensor spec travels as a list). A class whose
``__wire_tags__`` maps the values of its ``__wire_tag__`` key to subclasses is a tagged union:
decoding it gives the subclass the tag names (a member's tag is its ``__wire_tag_value__``, or
the default of its tag field).

:data:`PROTOCOL_VERSION` is the one version of everything isthmus says on a wire: the
coordinator's API and websocket and the peer-to-peer handshakes. Two sides that differ refuse
each other with :func:`version_mismatch`'s message instead of misreading each other.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "PROTOCOL_VERSION",
    "UNVERSIONED",
    "ProtocolMismatch",
    "WireError",
    "check_version",
    "decode",
    "encode",
    "refusal",
    "version_mismatch",
]

PROTOCOL_VERSION = 2
"""The version of the isthmus wire protocol this code speaks. Raise it with any change that a
peer or coordinator of the previous version would misread (a field removed, renamed or retyped,
a required field added, a handshake's layout changed); adding an optional field needs none."""

UNVERSIONED = 1
"""The version a side that sends none is taken to speak: releases from before versions."""

T = TypeVar("T")
_Decoder = Callable[[Any, str], Any]


class WireError(ValueError):
    """A message that does not match its type; :attr:`field` is the offending field's path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r} {problem}" if field else problem)
        self.field = field


class ProtocolMismatch(RuntimeError):
    """The other side speaks another version of the isthmus protocol (the message names both)."""


def version_mismatch(theirs: int, ours: int, *, them: str, us: str) -> str:
    """The message for two sides that speak different protocol versions, e.g. ``"peer speaks
    isthmus protocol 1, coordinator speaks 2; upgrade one of them"``."""
    note = " (it sends no version: a release from before versions)" if theirs == UNVERSIONED else ""
    return f"{them} speaks isthmus protocol {theirs}{note}, {us} speaks {ours}; upgrade one of them"


def refusal(theirs: int, *, them: str, us: str) -> str | None:
    """Why a side speaking version ``theirs`` cannot talk to this one, or None when it speaks
    :data:`PROTOCOL_VERSION`."""
    if theirs == PROTOCOL_VERSION:
        return None
    return version_mismatch(theirs, PROTOCOL_VERSION, them=them, us=us)


def check_version(theirs: int, *, them: str, us: str) -> None:
    """Raise :class:`ProtocolMismatch` (naming both versions) unless ``theirs`` is
    :data:`PROTOCOL_VERSION`."""
    why = refusal(theirs, them=them, us=us)
    if why is not None:
        raise ProtocolMismatch(why)


# -- decoding --------------------------------------------------------------------------------------
def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _scalar(want: type, name: str) -> _Decoder:
    def dec(v: Any, path: str) -> Any:
        if isinstance(v, want) and not (want is not bool and isinstance(v, bool)):
            return v
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        raise WireError(path, f"expected {name}, got {_kind(v)}")

    return dec


_SCALARS: dict[Any, _Decoder] = {
    int: _scalar(int, "an integer"),
    float: _scalar(float, "a number"),
    str: _scalar(str, "a string"),
    bool: _scalar(bool, "true or false"),
}


def _decoder(tp: Any) -> _Decoder:
    """A function ``(value, path) -> decoded`` for type ``tp`` (built once per type)."""
    if tp is Any:
        return lambda v, path: v
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        allowed = args
        shown = ", ".join(repr(a) for a in allowed)

        def literal(v: Any, path: str) -> Any:
            if v in allowed and not isinstance(v, bool):
                return v
            raise WireError(path, f"expected one of {shown}, got {v!r}")

        return literal
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"only X | None unions are supported on the wire, not {tp}")
        inner = _decoder(rest[0])
        return lambda v, path: None if v is None else inner(v, path)
    if origin in (tuple, list):
        if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
            raise TypeError(f"only tuple[X, ...] is supported on the wire, not {tp}")
        item, make = _decoder(args[0]), origin
        exact = args[0] if args[0] in (int, str) else None  # a fast check for the common case

        def sequence(v: Any, path: str) -> Any:
            if not isinstance(v, list | tuple):
                raise WireError(path, f"expected a list, got {_kind(v)}")
            if exact is not None and set(map(type, v)) <= {exact}:
                return make(v)
            return make(item(x, _at(path, i)) for i, x in enumerate(v))

        return sequence
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"wire dicts have string keys, not {tp}")
        value = _decoder(args[1])
        exact = args[1] if args[1] in (int, str) else None

        def mapping(v: Any, path: str) -> Any:
            if not isinstance(v, dict):
                raise WireError(path, f"expected an object, got {_kind(v)}")
            if args[1] is Any or (exact is not None and set(map(type, v.values())) <= {exact}):
                return dict(v)
            return {k: value(x, _at(path, str(k))) for k, x in v.items()}

        return mapping
    if isinstance(tp, type) and hasattr(tp, "__wire_decode__"):
        return tp.__wire_decode__  # type: ignore[no-any-return]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return lambda v, path: _decode_message(tp, v, path)
    raise TypeError(f"type {tp} cannot travel on the wire")


_PLANS: dict[type, list[tuple[str, _Decoder, bool]]] = {}


def _plan(cls: type) -> list[tuple[str, _Decoder, bool]]:
    """(name, decoder, required) of each field of message class ``cls``, built once."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        plan = [
            (
                f.name,
                _decoder(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        ]
        _PLANS[cls] = plan
    return plan


def _tag_of(cls: Any) -> Any:
    """The tag value of a member of a tagged union (a class variable, or its tag field's
    default)."""
    return getattr(cls, "__wire_tag_value__", None) or getattr(cls, cls.__wire_tag__)


def _decode_message(cls: type[T], v: Any, path: str) -> T:
    if not isinstance(v, dict):
        raise WireError(path, f"expected an object, got {_kind(v)}")
    tag_field: str | None = getattr(cls, "__wire_tag__", None)
    if tag_field is not None:
        tag = v.get(tag_field)
        tags: dict[str, type] = cls.__wire_tags__  # type: ignore[attr-defined]
        if "__wire_tags__" in cls.__dict__:  # the union itself: the tag picks the member
            sub = tags.get(tag) if isinstance(tag, str) else None
            if sub is None:
                shown = ", ".join(repr(t) for t in tags)
                raise WireError(_at(path, tag_field), f"expected one of {shown}, got {tag!r}")
            cls = sub  # type: ignore[assignment]
        elif tag_field in v and tag != (want := _tag_of(cls)):
            raise WireError(_at(path, tag_field), f"expected {want!r}, got {tag!r}")
    kwargs = {}
    for name, dec, required in _plan(cls):
        if name in v:
            kwargs[name] = dec(v[name], _at(path, name))
        elif required:
            raise WireError(_at(path, name), "is missing")
    try:
        return cls(**kwargs)
    except WireError:
        raise
    except (TypeError, ValueError) as e:  # the class's own checks (__post_init__)
        raise WireError(path, f"is invalid: {e}") from e


_DECODERS: dict[Any, _Decoder] = {}


def decode(cls: type[T], value: Any, path: str = "") -> T:
    """``value`` (parsed JSON) as a ``cls``, every field checked. Raises :class:`WireError`
    naming the first field that is missing or does not match its type."""
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = _decoder(cls)
    return dec(value, path)  # type: ignore[no-any-return]


# -- encoding --------------------------------------------------------------------------------------
def encode(value: Any) -> Any:
    """``value`` as JSON-ready values: a message becomes an object of its fields (those that are
    None are left out), tuples become lists; a member of a tagged union also carries its tag."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    custom = getattr(value, "__wire_encode__", None)
    if custom is not None:
        return custom()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        tag = getattr(value, "__wire_tag__", None)
        if tag is not None:
            out[tag] = _tag_of(value)
        for f in dataclasses.fields(value):
            x = getattr(value, f.name)
            if x is not None:
                out[f.name] = encode(x)
        return out
    if isinstance(value, list | tuple):
        return [encode(x) for x in value]
    if isinstance(value, dict):
        return {str(k): encode(x) for k, x in value.items()}
    raise TypeError(f"{type(value).__name__} cannot travel on the wire")
