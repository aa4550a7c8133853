"""Reading a request's JSON body and answering an error, shared by every room of the server.

A handler that finds a request malformed raises :class:`BadRequest`; the gate's middleware
answers it 400 with the message. :func:`error` is the one shape of every error answer:
``{"error": message}`` with the status.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

__all__ = ["BadRequest", "error", "read_json"]


class BadRequest(Exception):
    """A malformed request: answered 400 with this message."""


def error(status: int, msg: str) -> web.Response:
    """The JSON error answer ``{"error": msg}`` with HTTP status ``status``."""
    return web.json_response({"error": msg}, status=status)


# where the parsed body is kept on the request (a typed key where aiohttp has them)
_PARSED: Any = (
    web.RequestKey("isthmus.body", dict) if hasattr(web, "RequestKey") else "isthmus.body"
)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body, parsed once per request (the gate and the handler both
    read it; callers must not modify it). Raises :class:`BadRequest` when it is not valid JSON
    or not an object."""
    body = request.get(_PARSED)
    if body is not None:
        return body  # type: ignore[no-any-return]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    request[_PARSED] = body
    return body
