"""Declared settings: config dataclass fields that carry their help text, bounds and choices.

A field declared with :func:`setting` holds, in its metadata, the help of its command-line flag
(read from the metadata, so an installed package without sources has it) and what values it
takes (``ge``, ``gt``, ``choices``, or a ``Literal`` type). One function, :func:`check_settings`,
enforces them; a dataclass that derives from :class:`Checked` runs it on construction. Every
error is a :class:`~isthmus.spec.SpecError` naming the dotted key. :func:`check_keys` checks the
keys of a table read from a file (unknown ones get the closest known key as a suggestion).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, Literal, Union, get_args, get_origin

from isthmus.spec import SpecError, not_one_of, suggest

__all__ = ["Checked", "check_keys", "check_settings", "setting"]


def check_keys(
    table: Any,
    key: str,
    allowed: Sequence[str],
    required: Sequence[str] = (),
    hints: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``table`` as a dict, after checking that it is a table with only ``allowed`` keys and every
    ``required`` one. Raises :class:`SpecError` under ``key``: an unknown key gets ``hints[k]``
    or the closest allowed key as advice, and the list of allowed keys."""
    if not isinstance(table, Mapping):
        raise SpecError(f"must be a table, got {table!r}", key=key)
    for k in table:
        if k not in allowed:
            hint = (hints or {}).get(k) or suggest(k, allowed)
            raise SpecError(
                f"unknown key{hint}; known keys: {', '.join(allowed)}",
                key=f"{key}.{k}" if key else k,
            )
    for k in required:
        if k not in table:
            raise SpecError(f"missing required key {k!r}", key=f"{key}.{k}" if key else k)
    return dict(table)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    choices: Sequence[str] | None = None,
    **metadata: Any,
) -> Any:
    """A field of a config dataclass that carries its help text and its bounds: the help of its
    command-line flag (``help``), and ``ge``/``gt`` (at least / above) or ``choices`` that
    :func:`check_settings` enforces with the value's type. Other ``metadata`` (``flat``,
    ``metavar``, ...) is kept as given."""
    meta = {"help": " ".join(help.split()), **metadata}
    meta.update({k: v for k, v in (("ge", ge), ("gt", gt), ("choices", choices)) if v is not None})
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_settings(obj: Any, section: str = "") -> None:
    """Check every field of config dataclass ``obj`` that declares bounds (``ge``, ``gt``) or
    choices (``choices``, or a ``Literal`` type). Raises :class:`SpecError` naming ``section.field``: ``must be
    an integer >= 1``, ``must be a positive number``, ``must be a number >= 0`` or ``must be one
    of ...`` with a close match."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        hint, meta = hints[f.name], f.metadata
        args = [a for a in get_args(hint) if a is not type(None)]
        value = getattr(obj, f.name)
        if get_origin(hint) in (Union, types.UnionType):
            if value is None:
                continue
            hint = args[0] if len(args) == 1 else hint
        key = f"{section}.{f.name}" if section else f.name
        if "choices" in meta:
            hint = Literal[tuple(meta["choices"])]  # type: ignore[valid-type]
        if get_origin(hint) is Literal:
            if value not in get_args(hint):
                raise not_one_of(value, hint, key)
        elif "ge" in meta or "gt" in meta:
            _check_bound(value, hint, meta, key)


def _check_bound(value: Any, hint: Any, meta: Mapping[str, Any], key: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= meta["ge"]
        if not ok:
            raise SpecError(f"must be an integer >= {meta['ge']}, got {value!r}", key=key)
        return
    ok = number and math.isfinite(value)
    if "gt" in meta:
        ok = ok and value > meta["gt"]
        want = "a positive number" if meta["gt"] == 0 else f"a number > {meta['gt']:g}"
    else:
        ok = ok and value >= meta["ge"]
        want = f"a number >= {meta['ge']:g}"
    if not ok:
        raise SpecError(f"must be {want}, got {value!r}", key=key)


class Checked:
    """Base of config dataclasses whose fields declare their bounds with :func:`setting`:
    checked on construction by :func:`check_settings`, errors under the class's ``SECTION``."""

    SECTION = ""

    def __post_init__(self) -> None:
        check_settings(self, self.SECTION)
