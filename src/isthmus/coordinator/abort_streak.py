"""Rounds that abort again and again for the same cause: the pure counter that stops them.

The partition rule (:mod:`isthmus.coordinator.partition`) changes the membership when a pair
fails, so a round that keeps aborting for one cause is one no membership change helps (a cause
that is no pair's, or every pair failing). Retrying it up to a peer's ``max_attempts`` only
hides the cause; :class:`AbortStreak` says when to stop and with which error.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

__all__ = ["AbortStreak", "normalize_cause"]

_VOLATILE = [
    (re.compile(r"\b(epoch|round|attempt)\s+\d+"), r"\1 N"),
    (re.compile(r"\d+(\.\d+)?\s*(ms|s|B|bytes|MB|GB)\b"), "N"),
    (re.compile(r"(\]|\d):\d{2,5}\b"), r"\1:PORT"),
]


def normalize_cause(reason: str) -> str:
    """``reason`` with what differs between attempts of the same failure replaced (epoch and
    round numbers, durations, byte counts, port numbers): two aborts for one cause give the same
    text. Member names and addresses are kept, so different members stay different causes."""
    s = reason.strip()
    for pat, rep in _VOLATILE:
        s = pat.sub(rep, s)
    return s


class AbortStreak:
    """Consecutive aborts of a round for the same cause.

    :meth:`aborted` records one (any hashable ``cause``, e.g. :func:`normalize_cause` of the
    abort reason, or a pair); :meth:`committed` ends the streak. :meth:`stop` is the error text
    once ``limit`` consecutive aborts had the same cause, else None. A different cause starts a
    new streak of one.
    """

    def __init__(self, limit: int = 5) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 2:
            raise ValueError(f"AbortStreak limit: must be an integer >= 2, got {limit!r}")
        self.limit = limit
        self.cause: Hashable | None = None
        self.text = ""
        self.count = 0

    def aborted(self, cause: Hashable, text: str = "") -> None:
        if cause == self.cause:
            self.count += 1
        else:
            self.cause, self.count = cause, 1
        self.text = text or str(cause)

    def committed(self) -> None:
        self.cause, self.text, self.count = None, "", 0

    def stop(self) -> str | None:
        if self.count < self.limit:
            return None
        return f"the round aborted {self.count} times in a row for the same cause: {self.text}"
