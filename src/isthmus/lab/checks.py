"""Checks of the lab's own scenario values (network, churn), each raising a
:class:`~isthmus.spec.SpecError` that names the key and says what to write instead (see
:mod:`isthmus.lab.scenario`). TOML values are typed, so nothing here parses text: an integer
must be written as one."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from isthmus.lab.rates import parse_rate
from isthmus.settings import check_keys
from isthmus.spec import SpecError, suggest

__all__ = [
    "OptionValue",
    "Scalar",
    "array_of_tables",
    "check_float",
    "check_int",
    "check_options",
    "check_scalar",
    "check_str",
    "construct",
    "one_of",
    "rate_or_unlimited",
]

Scalar = str | int | float | bool
OptionValue = Scalar | tuple[Scalar, ...]

_MOVED = {"ScenarioError": SpecError, "suggest": suggest, "table_keys": check_keys}


def __getattr__(name: str) -> Any:
    # the lab's own error type and helpers became the project's one set (isthmus.spec)
    if name in _MOVED:
        new = "SpecError" if name == "ScenarioError" else _MOVED[name].__name__  # type: ignore[attr-defined]
        warnings.warn(
            f"isthmus.lab.checks.{name} is isthmus.spec.{new}", DeprecationWarning, stacklevel=2
        )
        return _MOVED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def construct(cls: type, key: str, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, with a :class:`SpecError` it raises put under ``key``."""
    try:
        return cls(**kwargs)
    except SpecError as e:
        raise e.within(key) from None


def array_of_tables(raw: Any, key: str) -> list[Any]:
    """``raw`` if it is a list (TOML's ``[[key]]``), else a :class:`SpecError` saying so."""
    if not isinstance(raw, list):
        raise SpecError(f"write each entry as a [[{key}]] table", key=key)
    return raw


def one_of(value: str, choices: Sequence[str], what: str, key: str) -> None:
    if value not in choices:
        raise SpecError(
            f"unknown {what} {value!r}{suggest(value, choices)}; choose one of {', '.join(choices)}",
            key=key,
        )


def rate_or_unlimited(value: Any, key: str) -> float | None:
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return None
    try:
        return parse_rate(value)
    except ValueError as e:
        raise SpecError(f"{e} (or 'unlimited' for an unshaped link)", key=key) from None


def check_int(value: Any, key: str, *, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"must be an integer, got {value!r}", key=key)
    if minimum is not None and value < minimum:
        raise SpecError(f"must be at least {minimum}, got {value}", key=key)
    return value


def check_float(
    value: Any, key: str, *, minimum: float | None = None, positive: bool = False
) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SpecError(f"must be a number, got {value!r}", key=key)
    if not math.isfinite(value):
        raise SpecError(f"must be finite, got {value!r}", key=key)
    if positive and value <= 0:
        raise SpecError(f"must be above zero, got {value}", key=key)
    if minimum is not None and value < minimum:
        raise SpecError(f"must be at least {minimum}, got {value}", key=key)
    return float(value)


def check_str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"must be a non-empty string, got {value!r}", key=key)
    return value


def check_scalar(value: Any, key: str) -> Scalar:
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"must be finite, got {value!r}", key=key)
    if isinstance(value, (str, int, float, bool)):
        return value
    kind = "a table" if isinstance(value, Mapping) else type(value).__name__
    raise SpecError(
        f"options are strings, numbers, booleans or lists of those; got {kind}", key=key
    )


def check_options(value: Any, key: str) -> dict[str, OptionValue]:
    """A table of options (strategy or attack) as written: scalars or lists of scalars, finite
    numbers; their meaning is checked by the config they are for."""
    if not isinstance(value, Mapping):
        raise SpecError(f"must be a table of options, got {value!r}", key=key)
    out: dict[str, OptionValue] = {}
    for name, item in value.items():
        if isinstance(item, (list, tuple)):
            out[name] = tuple(check_scalar(x, f"{key}.{name}[{i}]") for i, x in enumerate(item))
        else:
            out[name] = check_scalar(item, f"{key}.{name}")
    return out
