"""One line, not a traceback, for malformed HTTP in the coordinator's log.

aiohttp logs a request it cannot parse (an over-long header, a broken request line, bad
chunking) on its ``aiohttp.server`` logger with the parser's whole traceback. That is the
client's fault, not the coordinator's, and a scanner or a fuzzer would fill the log with them:
:func:`install` adds a filter that turns each such record into one line naming the error.
Errors of the coordinator's own handlers keep their traceback.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["OneLineBadRequests", "install"]


class OneLineBadRequests(logging.Filter):
    """Rewrites records whose exception is a malformed request (:class:`HttpProcessingError`)
    as one line (``malformed HTTP request: LineTooLong: ...``) without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            text = " ".join(str(exc).split())[:300]
            record.msg = "malformed HTTP request: %s: %s"
            record.args = (type(exc).__name__, text)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_FILTER = OneLineBadRequests()


def install() -> None:
    """Add the filter to aiohttp's server logger (once, however often it is called)."""
    logger = logging.getLogger("aiohttp.server")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
