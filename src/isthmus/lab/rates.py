"""Link rates as tc writes them: ``"100mbit"`` <-> bits per second (``parse_rate``, ``format_rate``)."""

from __future__ import annotations

import math
import re

from isthmus.spec import suggest

__all__ = ["format_rate", "parse_rate"]


_RATE_RE = re.compile(r"^\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*$")
_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 2.0**10,
    "mibit": 2.0**20,
    "gibit": 2.0**30,
    "tibit": 2.0**40,
}
_UNITS_HINT = (
    "write a positive number and a unit: bit, kbit, mbit, gbit, tbit (or kibit, mibit, gibit)"
)


def parse_rate(text: str) -> float:
    """Parse a link rate such as ``"100mbit"``, ``"10Mbit"``, ``"1gbit"`` into bits per second.

    Units follow tc: ``kbit`` = 1000 bit, ``kibit`` = 1024 bit, case-insensitive. Byte-based
    spellings (``mbps``, ``MB``) are refused, because tc reads ``mbps`` as megabytes per second
    while people usually mean megabits. Raises ``ValueError`` saying what to write for anything
    that is not a finite positive rate with a unit ("-5mbit", "fast", "100", "0gbit").
    """
    if not isinstance(text, str):
        raise ValueError(f"a rate must be a string such as '100mbit', got {text!r}")
    m = _RATE_RE.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a rate: {_UNITS_HINT}, e.g. '100mbit'")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _RATE_UNITS:
        if unit.endswith("bps") or unit.endswith("b") or unit.endswith("byte"):
            raise ValueError(
                f"{text!r}: unit {m.group(2)!r} is ambiguous (tc reads 'mbps' as megaBYTES per "
                f"second); write megabits as '{m.group(1)}mbit'"
            )
        raise ValueError(
            f"{text!r}: unknown unit {m.group(2)!r}{suggest(unit, list(_RATE_UNITS))}; {_UNITS_HINT}"
        )
    bps = number * _RATE_UNITS[unit]
    if not math.isfinite(bps) or bps <= 0:
        raise ValueError(f"{text!r}: a rate must be finite and above zero; {_UNITS_HINT}")
    return bps


def format_rate(bps: float | None) -> str:
    """``1e8`` -> ``"100mbit"``; ``None`` -> ``"unlimited"`` (the inverse of :func:`parse_rate`)."""
    if bps is None:
        return "unlimited"
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
