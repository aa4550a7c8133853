"""Checks of scenario values, each raising a :class:`ScenarioError` that names the key and says
what to write instead (see :mod:`isthmus.lab.scenario`)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from isthmus.lab.rates import parse_rate

__all__ = [
    "OptionValue",
    "Scalar",
    "ScenarioError",
    "check_float",
    "check_int",
    "check_options",
    "check_scalar",
    "check_spec",
    "check_str",
    "construct",
    "one_of",
    "rate_or_unlimited",
    "suggest",
    "table_keys",
]

Scalar = str | int | float | bool
OptionValue = Scalar | tuple[Scalar, ...]


class ScenarioError(ValueError):
    """A scenario is malformed. ``source`` is the file, ``key`` the dotted key, ``problem`` what is
    wrong and what to write instead."""

    def __init__(self, problem: str, *, key: str = "", source: str = "<scenario>") -> None:
        self.problem = problem
        self.key = key
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.source}: {self.key}" if self.key else self.source
        return f"{where}: {self.problem}"

    def within(self, prefix: str, source: str | None = None) -> ScenarioError:
        """The same error with ``prefix`` put in front of its key (and ``source`` set)."""
        if not prefix:
            key = self.key
        elif not self.key:
            key = prefix
        else:
            key = f"{prefix}{self.key}" if self.key.startswith("[") else f"{prefix}.{self.key}"
        return ScenarioError(self.problem, key=key, source=source or self.source)


def suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def table_keys(
    table: Any,
    key: str,
    allowed: Sequence[str],
    required: Sequence[str] = (),
    hints: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``table`` as a dict after checking it is a table with only ``allowed`` keys and every
    ``required`` one; an unknown key gets ``hints[key]`` or the closest known key as advice."""
    if not isinstance(table, Mapping):
        raise ScenarioError(f"must be a table, got {table!r}", key=key)
    for k in table:
        if k not in allowed:
            hint = (hints or {}).get(k) or suggest(k, allowed)
            raise ScenarioError(
                f"unknown key{hint}; known keys: {', '.join(allowed)}",
                key=f"{key}.{k}" if key else k,
            )
    for k in required:
        if k not in table:
            raise ScenarioError(f"missing required key {k!r}", key=f"{key}.{k}" if key else k)
    return dict(table)


def construct(cls: type, key: str, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, with a :class:`ScenarioError` it raises put under ``key``."""
    try:
        return cls(**kwargs)
    except ScenarioError as e:
        raise e.within(key) from None


def one_of(value: str, choices: Sequence[str], what: str, key: str) -> None:
    if value not in choices:
        raise ScenarioError(
            f"unknown {what} {value!r}{suggest(value, choices)}; choose one of {', '.join(choices)}",
            key=key,
        )


def rate_or_unlimited(value: Any, key: str) -> float | None:
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return None
    try:
        return parse_rate(value)
    except ValueError as e:
        raise ScenarioError(f"{e} (or 'unlimited' for an unshaped link)", key=key) from None


def check_int(value: Any, key: str, *, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ScenarioError(f"must be an integer, got {value!r}", key=key)
    if minimum is not None and value < minimum:
        raise ScenarioError(f"must be at least {minimum}, got {value}", key=key)
    return value


def check_float(
    value: Any, key: str, *, minimum: float | None = None, positive: bool = False
) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ScenarioError(f"must be a number, got {value!r}", key=key)
    if not math.isfinite(value):
        raise ScenarioError(f"must be finite, got {value!r}", key=key)
    if positive and value <= 0:
        raise ScenarioError(f"must be above zero, got {value}", key=key)
    if minimum is not None and value < minimum:
        raise ScenarioError(f"must be at least {minimum}, got {value}", key=key)
    return float(value)


def check_str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ScenarioError(f"must be a non-empty string, got {value!r}", key=key)
    return value


def check_scalar(value: Any, key: str) -> Scalar:
    if isinstance(value, float) and not math.isfinite(value):
        raise ScenarioError(f"must be finite, got {value!r}", key=key)
    if isinstance(value, (str, int, float, bool)):
        return value
    kind = "a table" if isinstance(value, Mapping) else type(value).__name__
    raise ScenarioError(
        f"options are strings, numbers, booleans or lists of those; got {kind}", key=key
    )


def check_options(value: Any, key: str) -> dict[str, OptionValue]:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"must be a table of options, got {value!r}", key=key)
    out: dict[str, OptionValue] = {}
    for name, item in value.items():
        if isinstance(item, (list, tuple)):
            out[name] = tuple(check_scalar(x, f"{key}.{name}[{i}]") for i, x in enumerate(item))
        else:
            out[name] = check_scalar(item, f"{key}.{name}")
    return out


def check_spec(value: Any, key: str, kind: str) -> str:
    """Check a component spec with the factory that will build it (imported lazily: it needs torch)."""
    text = check_str(value, key).strip()
    if kind == "compression":
        from isthmus.reduce.compress import make_compressor as factory
    elif kind == "aggregator":
        from isthmus.reduce.aggregate import make_aggregator as factory
    else:
        from isthmus.reduce.aggregate.attacks import make_attack as factory
    try:
        factory(text)
    except (ValueError, TypeError) as e:
        raise ScenarioError(f"bad {kind} spec {text!r}: {e}", key=key) from None
    return text
