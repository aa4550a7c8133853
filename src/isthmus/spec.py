"""One grammar for component specs, and the registries that turn them into typed configs.

Every pluggable component (compressors, aggregators, attacks, faults, gossip topologies and
schedules, strategies) is chosen by a short string on the command line or in a scenario file.
They all share this grammar::

    spec := part { "+" part }
    part := NAME [ "@" AT ] [ ":" args ]
    args := arg { "," arg }
    arg  := VALUE | KEY "=" VALUE          (positional values come before named ones)

Examples: ``int8``, ``topk:0.01+ef21``, ``nnm+multi_krum:m=3``, ``alie:tau=1.5``,
``kill@collective:step=20``, ``late_heavy:start_every=8,end_every=2``. Whitespace is ignored,
names and keys are case-insensitive and ``-`` reads as ``_``; values keep their case.

Each component family keeps a :class:`Registry`; each entry names the component's config
dataclass (the config *is* the entry). Values are coerced through the config's type hints
(``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``X | None``), so a spec, a scenario
table and a ``--option KEY=VALUE`` flag are all checked by the same code, and a bad one fails
once, early, with a :class:`SpecError` that names the spec, the key and a close match.
Parsing and validating never build a model, a tensor or a process group.

:class:`SpecError` is the one error of all configuration (specs, the run's config, scenario
files: it names the file too) and :func:`suggest` the one "did you mean".
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, Union, get_args, get_origin

__all__ = [
    "Entry",
    "Part",
    "Registry",
    "SpecError",
    "coerce",
    "config_from",
    "format_spec",
    "not_one_of",
    "option_names",
    "parse",
    "parse_assignment",
    "suggest",
]

T = TypeVar("T")
C = TypeVar("C")


class SpecError(ValueError):
    """A spec, an option, a config value or a scenario file is wrong: the one error type of every
    configuration. ``key`` is the dotted path of what is wrong (``strategy.options.outer_lr``,
    ``churn[2].peer``), ``spec`` the text it came from, ``source`` the file (empty when the value
    came from the command line or from code)."""

    def __init__(self, problem: str, *, key: str = "", spec: str = "", source: str = "") -> None:
        self.problem = problem
        self.key = key
        self.spec = spec
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        where = [w for w in (self.source, self.key, repr(self.spec) if self.spec else "") if w]
        return f"{': '.join(where)}: {self.problem}" if where else self.problem

    def within(self, prefix: str, source: str | None = None) -> SpecError:
        """The same error with ``prefix`` put in front of its key (``churn`` and ``[2].peer``
        join without a dot) and, if given, ``source`` as its file."""
        if not prefix or not self.key:
            key = prefix or self.key
        else:
            key = prefix + self.key if self.key.startswith("[") else f"{prefix}.{self.key}"
        return SpecError(self.problem, key=key, spec=self.spec, source=source or self.source)


def suggest(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string. The one
    "did you mean" of the project: specs, configs, scenario files and link rates use it."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_")


# ---------------------------------------------------------------------------- the grammar


@dataclass(frozen=True)
class Part:
    """One ``NAME[@AT][:args]`` of a spec: positional values in order, named ones by key."""

    name: str
    at: str | None = None
    positional: tuple[str, ...] = ()
    named: Mapping[str, str] = field(default_factory=dict)
    text: str = ""


def parse(spec: str, *, what: str = "spec") -> tuple[Part, ...]:
    """Split ``spec`` into its ``+``-joined parts. Raises :class:`SpecError` for an empty spec
    or part, an empty argument, a key given twice, or a positional value after a named one."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"{what} must be a non-empty string, got {spec!r}")
    text = "".join(spec.split())
    parts = []
    for piece in text.split("+"):
        if not piece:
            raise SpecError(f"empty part in {what} (two '+' in a row, or one at an end)", spec=spec)
        head, _, args = piece.partition(":")
        name, at_sign, at = head.partition("@")
        if not name:
            raise SpecError(f"a part of the {what} has no name: {piece!r}", spec=spec)
        if at_sign and not at:
            raise SpecError(f"nothing after '@' in {piece!r}", spec=spec)
        positional: list[str] = []
        named: dict[str, str] = {}
        for raw in args.split(",") if args else []:
            if not raw:
                raise SpecError(f"empty argument in {piece!r}", spec=spec)
            key, eq, value = raw.partition("=")
            if eq:
                key = _norm(key)
                if not key:
                    raise SpecError(f"argument {raw!r} has no key", spec=spec)
                if key in named:
                    raise SpecError(f"argument {key!r} given twice in {piece!r}", spec=spec)
                named[key] = value
            elif named:
                raise SpecError(
                    f"positional argument {raw!r} after named ones in {piece!r}", spec=spec
                )
            else:
                positional.append(raw)
        parts.append(Part(_norm(name), at or None, tuple(positional), named, piece))
    return tuple(parts)


def parse_assignment(text: str, *, flag: str = "--option") -> tuple[str, str]:
    """``"key=value"`` -> ``("key", "value")`` (key normalized); raises :class:`SpecError`."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise SpecError(f"{flag} takes KEY=VALUE, got {text!r}")
    return _norm(key), value.strip()


def format_spec(name: str, options: Mapping[str, Any] | None = None) -> str:
    """The canonical text of one part: ``name`` or ``name:k=v,k=v`` (booleans as true/false)."""
    if not options:
        return name
    items = ",".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()
    )
    return f"{name}:{items}"


# ---------------------------------------------------------------------------- coercion

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _describe(hint: Any) -> str:
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    return getattr(hint, "__name__", str(hint))


def coerce(value: Any, hint: Any, *, key: str = "", strict: bool = False) -> Any:
    """Convert ``value`` (a string from a spec or a flag, or a TOML/JSON value) to ``hint``.

    Understands ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, unions with ``None``
    (``none``/``null`` read as None), and ``tuple[X, ...]``/``list[X]`` of those; anything else
    passes through for the config to check. ``strict`` is for typed sources (a TOML file): no
    text is parsed, a float is no integer, 1 is no boolean, and numbers must be finite. Raises
    :class:`SpecError` naming ``key``.
    """
    origin = get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) < len(get_args(hint)) and (
            value is None
            or (not strict and isinstance(value, str) and value.lower() in ("none", "null"))
        ):
            return None
        errors = []
        for a in args:
            try:
                return coerce(value, a, key=key, strict=strict)
            except SpecError as e:
                errors.append(e.problem)
        raise SpecError(errors[0] if len(errors) == 1 else "; or ".join(errors), key=key)
    if origin is Literal:
        choices = get_args(hint)
        for c in choices:
            if value == c or (isinstance(value, str) and isinstance(c, str) and _norm(value) == c):
                return c
        raise not_one_of(value, hint, key)
    if origin in (tuple, list, Sequence):
        args = get_args(hint)
        inner = args[0] if args else Any
        if isinstance(value, str) and not strict:
            items: list[Any] = [v for v in value.split("|") if v] if value else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise SpecError(f"must be a list, got {value!r}", key=key)
        out = [coerce(v, inner, key=f"{key}[{i}]", strict=strict) for i, v in enumerate(items)]
        return tuple(out) if origin is tuple else out
    if hint is bool:
        return _to_bool(value, key, strict)
    if hint is int:
        return _to_int(value, key, strict)
    if hint is float:
        return _to_float(value, key, strict)
    if hint is str:
        if isinstance(value, str):
            return value
        raise SpecError(f"must be a string, got {value!r}", key=key)
    return value


def not_one_of(value: Any, hint: Any, key: str) -> SpecError:
    """The error for ``value`` that is none of the ``Literal`` ``hint``'s choices, with a close
    match."""
    choices = [str(c) for c in get_args(hint)]
    close = suggest(_norm(value), choices) if isinstance(value, str) else ""
    return SpecError(f"must be {_describe(hint)}, got {value!r}{close}", key=key)


def _to_bool(value: Any, key: str, strict: bool) -> bool:
    if isinstance(value, bool):
        return value
    if strict:
        raise SpecError(f"must be true or false, got {value!r}", key=key)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise SpecError(f"must be true or false (or 1/0), got {value!r}", key=key)


def _to_int(value: Any, key: str, strict: bool) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not strict and isinstance(value, float) and value.is_integer():
        return int(value)
    if not strict and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise SpecError(f"must be an integer, got {value!r}", key=key)


def _to_float(value: Any, key: str, strict: bool) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if strict and not math.isfinite(value):
            raise SpecError(f"must be finite, got {value!r}", key=key)
        return float(value)
    if not strict and isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            pass
        else:
            if math.isfinite(x) or value.strip().lower() in ("inf", "+inf", "-inf"):
                return x
    raise SpecError(f"must be a number, got {value!r}", key=key)


def option_names(cls: type) -> list[str]:
    """The settable options of config dataclass ``cls``: its init fields not starting with ``_``."""
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def config_from(
    cls: type[C],
    options: Mapping[str, Any],
    *,
    what: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> C:
    """Build config dataclass ``cls`` from ``options`` (strings or typed values), coercing each
    through the field's type hint. ``aliases`` maps extra spellings to field names.

    Raises :class:`SpecError`: an unknown option (with the closest valid one and the list), a
    value of the wrong type (naming the key), or the config's own validation error.
    """
    what = what or cls.__name__
    names = option_names(cls)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for raw_key, value in options.items():
        key = _norm(raw_key)
        key = (aliases or {}).get(key, key)
        if key not in names:
            # the aliases are valid spellings too (often the documented ones: powersgd's min_rate)
            valid = ", ".join(names) if names else "none"
            if aliases:
                valid += "; also " + ", ".join(f"{a} for {n}" for a, n in aliases.items())
            raise SpecError(
                f"unknown option {raw_key!r} for {what}"
                f"{suggest(key, [*names, *(aliases or {})])}; valid: {valid}",
                key=raw_key,
            )
        values[key] = coerce(value, hints[key], key=key)
    try:
        return cls(**values)
    except SpecError:
        raise
    except (ValueError, TypeError) as e:
        raise SpecError(f"{what}: {e}") from None


# ---------------------------------------------------------------------------- registries


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its name, options dataclass and builder.

    ``positional`` names the options that may be given without ``key=`` (in that order);
    ``option_aliases`` maps other spellings (``lambda``) to field names (``lam``).
    ``build(config, **context)`` makes the component; ``config`` is None when the entry takes
    no options (``config_cls`` None).
    """

    name: str
    config_cls: type | None = None
    build: Callable[..., T] | None = None
    aliases: tuple[str, ...] = ()
    positional: tuple[str, ...] = ()
    option_aliases: Mapping[str, str] = field(default_factory=dict)
    help: str = ""

    def options(self, part: Part, *, spec: str = "") -> dict[str, Any]:
        """The part's arguments as ``{option: raw value}`` (positional ones named)."""
        if len(part.positional) > len(self.positional):
            extra = part.positional[len(self.positional)]
            takes = (
                f"takes at most {len(self.positional)} ({', '.join(self.positional)})"
                if self.positional
                else "takes no"
            )
            raise SpecError(
                f"{self.name} {takes} positional arguments; write {extra!r} as KEY=VALUE",
                spec=spec or part.text,
            )
        out: dict[str, Any] = dict(zip(self.positional, part.positional, strict=False))
        for k, v in part.named.items():
            k = self.option_aliases.get(k, k)
            if k in out:
                raise SpecError(f"option {k!r} given twice", spec=spec or part.text)
            out[k] = v
        return out

    def config(self, options: Mapping[str, Any], *, spec: str = "") -> Any:
        """The typed config for ``options`` (None for an entry without options)."""
        if self.config_cls is None:
            if options:
                raise SpecError(
                    f"{self.name} takes no options, got {', '.join(options)}", spec=spec
                )
            return None
        try:
            return config_from(
                self.config_cls, options, what=self.name, aliases=self.option_aliases
            )
        except SpecError as e:
            raise SpecError(e.problem, key=e.key, spec=spec or e.spec) from None


class Registry(Generic[T]):
    """Named components of one family (``kind``: "compressor", "aggregator", ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}

    def add(
        self,
        name: str,
        *,
        config: type | None = None,
        build: Callable[..., T] | None = None,
        aliases: Sequence[str] = (),
        positional: Sequence[str] = (),
        option_aliases: Mapping[str, str] | None = None,
        help: str = "",
    ) -> Entry[T]:
        """Register a component; raises ValueError if the name or an alias is taken."""
        entry = Entry(
            _norm(name),
            config,
            build,
            tuple(_norm(a) for a in aliases),
            tuple(positional),
            dict(option_aliases or {}),
            help,
        )
        for n in (entry.name, *entry.aliases):
            if n in self._entries or n in self._aliases:
                raise ValueError(f"{self.kind} {n!r} is registered twice")
        self._entries[entry.name] = entry
        self._aliases.update(dict.fromkeys(entry.aliases, entry.name))
        return entry

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            _norm(name) in self._entries or _norm(name) in self._aliases
        )

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        """Registered names in registration order (aliases not included)."""
        return list(self._entries)

    def lookup(self, name: str, *, spec: str = "") -> Entry[T]:
        """The entry for ``name`` or an alias; :class:`SpecError` with a close match otherwise."""
        key = _norm(name)
        key = self._aliases.get(key, key)
        entry = self._entries.get(key)
        if entry is None:
            known = [*self._entries, *self._aliases]
            raise SpecError(
                f"unknown {self.kind} {name!r}{suggest(key, known)}; "
                f"choose one of {', '.join(self._entries)}",
                spec=spec,
            )
        return entry

    def resolve(self, part: Part | str, *, spec: str = "") -> tuple[Entry[T], Any]:
        """The entry and its typed config for one part (or a one-part spec string)."""
        if isinstance(part, str):
            parts = parse(part, what=self.kind)
            if len(parts) != 1:
                raise SpecError(
                    f"expected one {self.kind}, got {len(parts)} joined by '+'", spec=part
                )
            spec, part = spec or part, parts[0]
        entry = self.lookup(part.name, spec=spec or part.text)
        return entry, entry.config(entry.options(part, spec=spec), spec=spec or part.text)

    def build(self, spec: str | Part, **context: Any) -> T:
        """Resolve a one-part spec and build it with its entry's builder."""
        entry, config = self.resolve(spec)
        if entry.build is None:
            raise SpecError(f"{self.kind} {entry.name!r} cannot be built from a spec")
        return (
            entry.build(config, **context)
            if entry.config_cls is not None
            else entry.build(**context)
        )
